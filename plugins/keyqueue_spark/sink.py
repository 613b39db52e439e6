"""The ``keyqueue`` sink: a DataFrame written as keyed requests for one task.

::

    (df.write.format("keyqueue").mode("append")
       .option("queue", "rebaser").option("task", "EnqueueUpdatesRequest").option("key", "change_set")
       .option("jobId", "reindex-2026-11-22").save())

Each row becomes one request for the key in its ``key`` column: ``X-MESSAGE-TYPE`` is the task,
``X-MESSAGE-VERSION`` the ``version`` option (default 1), and the body a CBOR map of the row's
argument columns (every column but the key and the id column, or the ``columns`` option).
Each Spark partition opens its own connection and pipelines its publishes in row order, so a
key's rows from one partition are stored, and run, in that order.

Request ids (``Nats-Msg-Id``) are derived, never random, so that a Spark task that is retried,
or a whole job that is run again, publishes the same ids and JetStream drops the repeats within
the inbox stream's duplicate window (``QueueConfig.duplicate_window``, 2 minutes by default):

* with ``idColumn``: sha256(job id, task, version, key, that column's value);
* otherwise: sha256(job id, task, version, key, the encoded body, n), where n counts the rows
  with the same key and body seen before it in the partition. The id does not depend on the
  row's position, so it is stable even where a retried task receives its rows in another order
  (after a shuffle); identical rows stay distinct as long as they are in one partition.

The digest is written as a ULID-shaped string (26 characters). The job id is the ``jobId``
option, by default the task's name: running the same rows again within the window adds
nothing. Use a new ``jobId`` to enqueue the same rows again on purpose.

A row that cannot become a request (no key, an invalid key, a value that is not plain) is not
published: it is counted and described in the job's summary. The commit logs the summary
(rows, accepted, duplicates, errors) to stderr, writes it as JSON to ``summaryPath`` if given,
and fails the job if there were more than ``maxErrors`` bad rows (default 0; -1 allows any) --
after the good rows are stored, so fixing the bad rows and running the same job again adds only
them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Final

from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DateType,
    DecimalType,
    MapType,
    StructType,
    TimestampNTZType,
    TimestampType,
)
from ulid import ULID

from keyqueue.errors import KeyqueueError, TokenPublishFailed
from keyqueue.ext import Enqueued, OutgoingRequest
from keyqueue.wire import CBOR

from .source import lower_keys, resolve_url
from .streams import connect_to, encode_fields, enqueue_many, ensure_queue, request_message

ID_SCHEME: Final = "keyqueue-spark/1"
"""Mixed into every derived request id; bump it only to change how ids are derived."""

MAX_ERROR_SAMPLES: Final = 20
"""Bad rows described in the summary (all of them are counted)."""

DEFAULT_BATCH_ROWS: Final = 10_000
"""Rows per pipelined batch of publishes (each batch then publishes its distinct keys' tokens)."""


class KeyqueueWriteError(RuntimeError):
    """A write finished with more bad rows than ``maxErrors`` allows; the message has the summary."""


# --- options -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkOptions:
    url: str
    queue: str
    task: str
    key: str
    version: int
    columns: tuple[str, ...] | None
    job_id: str
    id_column: str | None
    content_type: str
    batch_rows: int
    summary_path: str | None
    max_errors: int
    create_queue: bool
    duplicate_window: float | None

    @classmethod
    def from_options(cls, given: Mapping[str, str]) -> SinkOptions:
        options = lower_keys(given)
        missing = [name for name in ("queue", "task", "key") if not options.get(name)]
        if missing:
            raise ValueError(f"the keyqueue sink needs option(s) {', '.join(missing)}: "
                             'e.g. .option("queue", "rebaser").option("task", "Reindex").option("key", "doc_id")')
        columns = options.get("columns")
        content = (options.get("contenttype") or "cbor").lower()
        content_type = {"cbor": CBOR, "json": "application/json"}.get(content, content)
        window = options.get("duplicatewindow")
        return cls(
            url=resolve_url(options), queue=str(options["queue"]), task=str(options["task"]),
            key=str(options["key"]), version=int(options.get("version") or 1),
            columns=tuple(c.strip() for c in columns.split(",") if c.strip()) if columns else None,
            job_id=str(options.get("jobid") or f"task:{options['task']}"),
            id_column=options.get("idcolumn") or None, content_type=content_type,
            batch_rows=max(1, int(options.get("batchrows") or DEFAULT_BATCH_ROWS)),
            summary_path=options.get("summarypath") or None,
            max_errors=int(options.get("maxerrors") or 0),
            create_queue=(options.get("createqueue") or "true").lower() != "false",
            duplicate_window=float(window) if window else None,
        )


# --- values and ids ----------------------------------------------------------------------------------


def plain_converter(data_type: DataType) -> Callable[[Any], Any]:
    """Turn a Spark value of ``data_type`` into a plain wire value.

    Timestamps become timezone-aware UTC datetimes (Spark hands them over as naive local time),
    timestamps without a zone, dates and decimals become ISO/exact text, binaries bytes, structs
    and maps dicts, arrays lists.
    """
    if isinstance(data_type, TimestampType):
        return lambda v: None if v is None else v.astimezone(UTC)
    if isinstance(data_type, TimestampNTZType | DateType):
        return lambda v: None if v is None else v.isoformat()
    if isinstance(data_type, DecimalType):
        return lambda v: None if v is None else str(v)
    if isinstance(data_type, BinaryType):
        return lambda v: None if v is None else bytes(v)
    if isinstance(data_type, ArrayType):
        element = plain_converter(data_type.elementType)
        return lambda v: None if v is None else [element(e) for e in v]
    if isinstance(data_type, MapType):
        value = plain_converter(data_type.valueType)
        return lambda v: None if v is None else {k: value(x) for k, x in v.items()}
    if isinstance(data_type, StructType):
        fields = [(f.name, plain_converter(f.dataType)) for f in data_type.fields]
        return lambda v: None if v is None else {name: conv(v[name]) for name, conv in fields}
    return _loose


def _loose(value: Any) -> Any:
    # Values whose Spark type says nothing more (ints, strings, ...), and stragglers.
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, Row):
        return {k: _loose(v) for k, v in value.asDict().items()}
    return value


def derive_request_id(job_id: str, task: str, version: int, key: str, identity: bytes) -> str:
    """A ULID-shaped request id from sha256 of the job, task, version, key and the row's identity."""
    digest = hashlib.sha256()
    for part in (ID_SCHEME, job_id, task, str(version), key):
        digest.update(part.encode())
        digest.update(b"\x00")
    digest.update(identity)
    return str(ULID.from_bytes(digest.digest()[:16]))


class RowIdentity:
    """The identity part of each row's request id, as the module docstring describes."""

    def __init__(self) -> None:
        self._seen: dict[bytes, int] = {}

    def by_content(self, key: str, body: bytes) -> bytes:
        content = hashlib.sha256(key.encode() + b"\x00" + body).digest()[:16]
        occurrence = self._seen.get(content, 0)
        self._seen[content] = occurrence + 1
        return b"content\x00" + content + str(occurrence).encode()

    @staticmethod
    def by_column(value: Any) -> bytes:
        return b"column\x00" + json.dumps(value, default=str, sort_keys=True).encode()


# --- the summary -------------------------------------------------------------------------------------


@dataclass
class WriteSummary(WriterCommitMessage):
    """What one partition (or, added up, the whole job) did."""

    rows: int = 0
    accepted: int = 0
    duplicates: int = 0
    errors: int = 0
    unscheduled: int = 0
    partitions: int = 0
    error_samples: list[str] = field(default_factory=list)

    def add(self, other: WriteSummary) -> None:
        self.rows += other.rows
        self.accepted += other.accepted
        self.duplicates += other.duplicates
        self.errors += other.errors
        self.unscheduled += other.unscheduled
        self.partitions += other.partitions
        room = MAX_ERROR_SAMPLES - len(self.error_samples)
        self.error_samples.extend(other.error_samples[:max(0, room)])

    def error(self, description: str) -> None:
        self.errors += 1
        if len(self.error_samples) < MAX_ERROR_SAMPLES:
            self.error_samples.append(description)

    def describe(self) -> str:
        text = (f"{self.rows} rows: {self.accepted} accepted ({self.accepted - self.duplicates} new, "
                f"{self.duplicates} duplicates), {self.errors} errors")
        if self.unscheduled:
            text += f", {self.unscheduled} stored but not yet scheduled (the reconciler will)"
        return text


# --- the writer --------------------------------------------------------------------------------------


class KeyqueueWriter(DataSourceWriter):
    """Writes each partition's rows as requests; commits a summary of the whole job."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise ValueError('the keyqueue sink only appends requests: use .mode("append")')
        self.options = SinkOptions.from_options(options)
        names = [f.name for f in schema.fields]
        wanted = [self.options.key, *([self.options.id_column] if self.options.id_column else []),
                  *(self.options.columns or ())]
        unknown = [c for c in wanted if c not in names]
        if unknown:
            raise ValueError(f"column(s) {', '.join(unknown)} not in the DataFrame ({', '.join(names)})")
        skip = {self.options.key, self.options.id_column}
        arguments = self.options.columns or tuple(n for n in names if n not in skip)
        self.key_index = names.index(self.options.key)
        self.id_index = names.index(self.options.id_column) if self.options.id_column else None
        self.arguments = [(name, names.index(name), schema.fields[names.index(name)].dataType) for name in arguments]
        # Create the queue (if missing) once, here on the driver, before any task publishes.
        asyncio.run(self._ensure_queue())

    async def _ensure_queue(self) -> None:
        nc = await connect_to(self.options.url)
        try:
            await ensure_queue(nc, self.options.queue, create=self.options.create_queue,
                                  duplicate_window=self.options.duplicate_window)
        finally:
            await nc.close()

    def write(self, iterator: Iterator[Row]) -> WriteSummary:
        opts = self.options
        partition = _partition_id()
        converters = [(name, index, plain_converter(data_type)) for name, index, data_type in self.arguments]
        identity = RowIdentity()
        summary = WriteSummary(partitions=1)
        batch: list[OutgoingRequest] = []
        with asyncio.Runner() as runner:
            nc = runner.run(connect_to(opts.url))
            try:
                for index, row in enumerate(iterator):
                    summary.rows += 1
                    request = self._request(row, converters, identity, partition, index, summary)
                    if request is not None:
                        batch.append(request)
                    if len(batch) >= opts.batch_rows:
                        runner.run(self._flush(nc, batch, summary))
                        batch = []
                if batch:
                    runner.run(self._flush(nc, batch, summary))
            finally:
                runner.run(nc.close())
        return summary

    def _request(self, row: Row, converters: list[tuple[str, int, Callable[[Any], Any]]], identity: RowIdentity,
                 partition: int, index: int, summary: WriteSummary) -> OutgoingRequest | None:
        opts = self.options
        where = f"partition {partition} row {index}"
        key = row[self.key_index]
        if key is None or key == "":
            summary.error(f"{where}: key column {opts.key!r} is {'null' if key is None else 'empty'}")
            return None
        key = str(key)
        try:
            fields = {name: convert(row[i]) for name, i, convert in converters}
            body = encode_fields(fields, opts.content_type)
            if self.id_index is not None:
                ident = RowIdentity.by_column(row[self.id_index])
            else:
                ident = identity.by_content(key, body)
            request_id = derive_request_id(opts.job_id, opts.task, opts.version, key, ident)
            return request_message(key, opts.task, opts.version, body, request_id, opts.content_type)
        except (KeyqueueError, ValueError, TypeError) as e:
            summary.error(f"{where} (key {key!r}): {type(e).__name__}: {e}")
            return None

    async def _flush(self, nc: Any, batch: list[OutgoingRequest], summary: WriteSummary) -> None:
        results = await enqueue_many(nc, self.options.queue, batch)
        for request, result in zip(batch, results, strict=True):
            if isinstance(result, Enqueued):
                summary.accepted += 1
                summary.duplicates += int(result.duplicate)
            elif isinstance(result, TokenPublishFailed):
                summary.accepted += 1
                summary.unscheduled += 1
            else:
                summary.error(f"key {request.key!r} request {request.request_id}: {type(result).__name__}: {result}")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = self._total(messages)
        self._report(total, aborted=False)
        limit = self.options.max_errors
        if limit >= 0 and total.errors > limit:
            samples = "\n  ".join(total.error_samples)
            raise KeyqueueWriteError(
                f"keyqueue write to {self.options.queue}/{self.options.task}: {total.describe()}; "
                f"more than maxErrors={limit} rows were bad. The good rows are stored; fix the bad ones and "
                f"run the same job (same jobId) again within the duplicate window to add only them. "
                f"First errors:\n  {samples}"
            )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._report(self._total(messages), aborted=True)

    @staticmethod
    def _total(messages: list[WriterCommitMessage | None]) -> WriteSummary:
        total = WriteSummary()
        for message in messages:
            if isinstance(message, WriteSummary):
                total.add(message)
        return total

    def _report(self, total: WriteSummary, *, aborted: bool) -> None:
        opts = self.options
        state = "aborted" if aborted else "committed"
        print(f"keyqueue write {state} (queue {opts.queue}, task {opts.task}, job {opts.job_id}): {total.describe()}",
              file=sys.stderr)
        if opts.summary_path:
            record = {**asdict(total), "aborted": aborted, "queue": opts.queue, "task": opts.task,
                      "job_id": opts.job_id}
            with open(opts.summary_path, "w") as out:
                json.dump(record, out, indent=2)


def _partition_id() -> int:
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.partitionId() if context is not None else -1


def read_summary(path: str) -> dict[str, Any]:
    """The JSON summary a write left at ``summaryPath``."""
    with open(path) as f:
        result: dict[str, Any] = json.load(f)
    return result
