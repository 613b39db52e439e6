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

The digest is written as a ULID-shaped string (26 characters; :mod:`keyqueue_spark.rows`). The job id is the ``jobId``
option, by default the task's name: running the same rows again within the window adds
nothing. Use a new ``jobId`` to enqueue the same rows again on purpose.

A row that cannot become a request (no key, an invalid key, a value that is not plain) is not
published: it is counted and described in the job's summary. A row the server refuses for a
reason that passes (:func:`refused_for_now`: a full per-key backlog, no acknowledgement) is not
a bad row: its task fails with :class:`KeyqueueWriteRefused` and Spark runs it again. The commit logs the summary
(rows, accepted, duplicates, errors) to stderr, writes it as JSON to ``summaryPath`` if given,
and fails the job if there were more than ``maxErrors`` bad rows (default 0; -1 allows any) --
after the good rows are stored, so fixing the bad rows and running the same job again adds only
them.

With ``maxPending`` N each task waits for workers while the queue's backlog is high, so the
backlog stays at or under N (:mod:`keyqueue_spark.backlog`). With ``progressSubject`` each task
reports its counts for the driver's progress line (:mod:`keyqueue_spark.progress`).

:class:`PartitionWriter` is one task's work, shared with the streaming writer
(:mod:`keyqueue_spark.stream_sink`), which derives its request ids from the query, the
micro-batch and the row instead.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import DataType, StructType

from keyqueue.errors import (
    BacklogFull,
    ConnectionFailed,
    EnqueueError,
    EnqueueTimeout,
    JetStreamUnavailable,
    KeyqueueError,
    KeyqueueTimeout,
    TokenPublishFailed,
)
from keyqueue.ext import Client, Enqueued, OutgoingRequest, QueueNames
from keyqueue.wire import CBOR

from .backlog import BacklogGate, BacklogLimit
from .progress import TaskCounts, TaskProgress
from .rows import RowIdentity, derive_request_id, plain_converter
from .source import lower_keys, resolve_url
from .streams import connect_to, encode_fields, enqueue_many, ensure_queue, request_message, stream_bounds

MAX_ERROR_SAMPLES: Final = 20
"""Bad rows described in the summary (all of them are counted)."""

DEFAULT_BATCH_ROWS: Final = 10_000
"""Rows per pipelined batch of publishes (each batch then publishes its distinct keys' tokens)."""

DEFAULT_MAX_PENDING_WRITERS: Final = 8
"""Tasks assumed to write at once under ``maxPending`` unless ``maxPendingWriters`` says (backfill does)."""


class KeyqueueWriteError(RuntimeError):
    """A write finished with more bad rows than ``maxErrors`` allows; the message has the summary."""


class KeyqueueWriteRefused(RuntimeError):
    """The server refused rows for a reason that passes (a full per-key backlog, no acknowledgement,
    the connection down): the task fails so that Spark runs it again. The rows it stored before
    are not stored twice (the same request ids, within the duplicate window)."""


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
    max_pending: int | None
    max_pending_writers: int
    progress_subject: str | None

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
            max_pending=_positive(options, "maxPending"),
            max_pending_writers=_positive(options, "maxPendingWriters") or DEFAULT_MAX_PENDING_WRITERS,
            progress_subject=options.get("progresssubject") or None,
        )

    def backlog_limit(self) -> BacklogLimit | None:
        """The ``maxPending`` bound, or None when the write may flood."""
        if self.max_pending is None:
            return None
        return BacklogLimit(self.max_pending, self.max_pending_writers, self.batch_rows)


def _positive(options: Mapping[str, str], name: str) -> int | None:
    raw = options.get(name.lower())
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"option {name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"option {name} must be a positive integer, got {raw!r}")
    return value


@dataclass(frozen=True)
class SinkColumns:
    """Where the key, the id and the argument columns are in the rows of one schema."""

    key_index: int
    id_index: int | None
    arguments: tuple[tuple[str, int, DataType], ...]

    @classmethod
    def plan(cls, options: SinkOptions, schema: StructType) -> SinkColumns:
        """Check the options' columns against ``schema``; raises ValueError naming what is missing."""
        names = [f.name for f in schema.fields]
        wanted = [options.key, *([options.id_column] if options.id_column else []), *(options.columns or ())]
        unknown = [c for c in wanted if c not in names]
        if unknown:
            raise ValueError(f"column(s) {', '.join(unknown)} not in the DataFrame ({', '.join(names)})")
        skip = {options.key, options.id_column}
        arguments = options.columns or tuple(n for n in names if n not in skip)
        return cls(names.index(options.key), names.index(options.id_column) if options.id_column else None,
                   tuple((name, names.index(name), schema.fields[names.index(name)].dataType) for name in arguments))


# --- the summary -------------------------------------------------------------------------------------


@dataclass
class WriteSummary(WriterCommitMessage):
    """What one partition (or, added up, the whole job or micro-batch) did."""

    rows: int = 0
    accepted: int = 0
    duplicates: int = 0
    errors: int = 0
    unscheduled: int = 0
    partitions: int = 0
    waited: float = 0.0
    """Seconds the partition's task waited for workers (``maxPending``); added up, the longest wait."""
    skipped: int = 0
    """Streaming: rows of a micro-batch committed before, not written again."""
    query_id: str | None = None
    """Streaming: the query whose micro-batch this is."""
    error_samples: list[str] = field(default_factory=list)

    def add(self, other: WriteSummary) -> None:
        self.rows += other.rows
        self.accepted += other.accepted
        self.duplicates += other.duplicates
        self.errors += other.errors
        self.unscheduled += other.unscheduled
        self.partitions += other.partitions
        self.waited = max(self.waited, other.waited)
        self.skipped += other.skipped
        self.query_id = self.query_id or other.query_id
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
        if self.skipped:
            text += f", {self.skipped} skipped (their micro-batch was committed before)"
        if self.waited:
            text += f", waited {self.waited:.1f}s for workers (maxPending)"
        return text

    @classmethod
    def total(cls, messages: Iterable[WriterCommitMessage | None]) -> WriteSummary:
        """The tasks' summaries added up (a failed task's message is None)."""
        total = cls()
        for message in messages:
            if isinstance(message, WriteSummary):
                total.add(message)
        return total


def report_write(total: WriteSummary, options: SinkOptions, what: str, **extra: Any) -> None:
    """Print the summary line to the driver's stderr; write it as JSON to ``summaryPath`` if given."""
    print(f"keyqueue {what} (queue {options.queue}, task {options.task}, job {options.job_id}): "
          f"{total.describe()}", file=sys.stderr)
    if options.summary_path:
        record = {**asdict(total), **extra, "queue": options.queue, "task": options.task, "job_id": options.job_id}
        with open(options.summary_path, "w") as out:
            json.dump(record, out, indent=2)


def check_errors(total: WriteSummary, options: SinkOptions) -> None:
    """Raise :class:`KeyqueueWriteError` when more than ``maxErrors`` rows were bad."""
    limit = options.max_errors
    if limit >= 0 and total.errors > limit:
        samples = "\n  ".join(total.error_samples)
        raise KeyqueueWriteError(
            f"keyqueue write to {options.queue}/{options.task}: {total.describe()}; "
            f"more than maxErrors={limit} rows were bad. The good rows are stored; fix the bad ones and "
            f"run the same job (same jobId) again within the duplicate window to add only them. "
            f"First errors:\n  {samples}"
        )


# --- one task's rows ---------------------------------------------------------------------------------


Identify = Callable[[str, bytes, Any], bytes]
"""A row's identity for its request id, from its key, its encoded body and its id column's value."""


class PartitionWriter:
    """One Spark task: its rows as requests, published in row order on one connection.

    Rows are encoded and given ids as they come, published ``batchRows`` at a time (or in the
    chunks of the ``maxPending`` bound, after waiting for room), and each batch's keys are
    scheduled once it is stored. ``identify`` makes each row's identity (see the module
    docstring); the summary counts what happened to every row.
    """

    def __init__(self, options: SinkOptions, columns: SinkColumns, job_id: str, identify: Identify,
                 summary: WriteSummary) -> None:
        self.options, self.columns, self.job_id, self.identify = options, columns, job_id, identify
        self.summary = summary
        self.partition, self.attempt = _task_partition()
        self.converters = [(name, index, plain_converter(data_type)) for name, index, data_type in columns.arguments]
        self.limit = options.backlog_limit()
        self.inbox = QueueNames(options.queue).inbox_stream

    def run(self, rows: Iterator[Row]) -> WriteSummary:
        opts = self.options
        summary = self.summary
        summary.partitions = 1
        size = self.limit.chunk if self.limit is not None else opts.batch_rows
        batch: list[OutgoingRequest] = []
        with asyncio.Runner() as runner:
            nc = runner.run(connect_to(opts.url))
            progress = TaskProgress(nc, opts.progress_subject)
            gate = self._gate(nc, progress)
            try:
                for index, row in enumerate(rows):
                    summary.rows += 1
                    request = self._request(row, index)
                    if request is not None:
                        batch.append(request)
                    if len(batch) >= size:
                        runner.run(self._flush(nc, batch, gate, progress))
                        batch = []
                if batch:
                    runner.run(self._flush(nc, batch, gate, progress))
                runner.run(progress.report(self._counts(None, done=True), now=True))
            finally:
                runner.run(nc.close())
        if gate is not None:
            summary.waited = gate.waited
        return summary

    def _gate(self, nc: Client, progress: TaskProgress) -> BacklogGate | None:
        if self.limit is None:
            return None

        async def backlog() -> int:
            return (await stream_bounds(nc, self.inbox)).messages

        async def waiting(pending: int, waited: float) -> None:
            self.summary.waited = waited
            await progress.report(self._counts(pending), now=True)

        return BacklogGate(self.limit, backlog, waiting)

    def _counts(self, backlog: int | None, *, done: bool = False) -> TaskCounts:
        s = self.summary
        return TaskCounts(self.partition, self.attempt, s.rows, s.accepted - s.duplicates, s.duplicates, s.errors,
                          s.waited, backlog, self.options.max_pending, done)

    def _request(self, row: Row, index: int) -> OutgoingRequest | None:
        opts = self.options
        where = f"partition {self.partition} row {index}"
        key = row[self.columns.key_index]
        if key is None or key == "":
            self.summary.error(f"{where}: key column {opts.key!r} is {'null' if key is None else 'empty'}")
            return None
        key = str(key)
        try:
            fields = {name: convert(row[i]) for name, i, convert in self.converters}
            body = encode_fields(fields, opts.content_type)
            id_value = row[self.columns.id_index] if self.columns.id_index is not None else None
            ident = self.identify(key, body, id_value)
            request_id = derive_request_id(self.job_id, opts.task, opts.version, key, ident)
            return request_message(key, opts.task, opts.version, body, request_id, opts.content_type)
        except (KeyqueueError, ValueError, TypeError) as e:
            self.summary.error(f"{where} (key {key!r}): {type(e).__name__}: {e}")
            return None

    async def _flush(self, nc: Client, batch: list[OutgoingRequest], gate: BacklogGate | None,
                     progress: TaskProgress) -> None:
        summary = self.summary
        if gate is not None:
            await gate.room()
            summary.waited = gate.waited
        results = await enqueue_many(nc, self.options.queue, batch)
        refused: list[EnqueueError] = []
        for request, result in zip(batch, results, strict=True):
            if isinstance(result, Enqueued):
                summary.accepted += 1
                summary.duplicates += int(result.duplicate)
            elif isinstance(result, TokenPublishFailed):
                summary.accepted += 1
                summary.unscheduled += 1
            elif refused_for_now(result):
                refused.append(result)
            else:
                summary.error(f"key {request.key!r} request {request.request_id}: {type(result).__name__}: {result}")
        await progress.report(self._counts(None))
        if refused:
            # Not bad rows: counting them as such would let the commit record rows never stored.
            # The task fails before its later rows (a key's rows stay in order) and runs again whole.
            raise KeyqueueWriteRefused(
                f"keyqueue write to {self.options.queue}/{self.options.task}, partition {self.partition}: "
                f"{len(refused)} rows refused for now, e.g. {type(refused[0]).__name__}: {refused[0]}. "
                "The task fails so that Spark runs it again; rows already stored are not stored twice. "
                "If it keeps failing: start workers for the queue, raise its max_backlog_per_key, or set "
                "maxPending to wait for room")


def refused_for_now(error: EnqueueError) -> bool:
    """Whether the server refused a row for a reason that passes (a full backlog, no acknowledgement,
    the connection or JetStream down), not because of the row: running the task again stores it."""
    if isinstance(error, BacklogFull | EnqueueTimeout):
        return True
    return isinstance(error.__cause__, ConnectionFailed | KeyqueueTimeout | JetStreamUnavailable)


def _task_partition() -> tuple[int, int]:
    """This task's partition and attempt number (-1, 0 outside a Spark task)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return (context.partitionId(), context.attemptNumber()) if context is not None else (-1, 0)


def create_queue_if_missing(options: SinkOptions) -> None:
    """Create the queue (if missing and ``createQueue``) from the driver, before any task publishes."""

    async def ensure() -> None:
        nc = await connect_to(options.url)
        try:
            await ensure_queue(nc, options.queue, create=options.create_queue,
                               duplicate_window=options.duplicate_window)
        finally:
            await nc.close()

    asyncio.run(ensure())


# --- the batch writer --------------------------------------------------------------------------------


class KeyqueueWriter(DataSourceWriter):
    """Writes each partition's rows as requests; commits a summary of the whole job."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise ValueError('the keyqueue sink only appends requests: use .mode("append")')
        self.options = SinkOptions.from_options(options)
        self.columns = SinkColumns.plan(self.options, schema)
        self.options.backlog_limit()  # a bad maxPending fails here, on the driver, not in every task
        create_queue_if_missing(self.options)

    def write(self, iterator: Iterator[Row]) -> WriteSummary:
        identity = RowIdentity()

        def identify(key: str, body: bytes, id_value: Any) -> bytes:
            if self.columns.id_index is not None:
                return RowIdentity.by_column(id_value)
            return identity.by_content(key, body)

        return PartitionWriter(self.options, self.columns, self.options.job_id, identify, WriteSummary()).run(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = WriteSummary.total(messages)
        report_write(total, self.options, "write committed", aborted=False)
        check_errors(total, self.options)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        report_write(WriteSummary.total(messages), self.options, "write aborted", aborted=True)


def read_summary(path: str) -> dict[str, Any]:
    """The JSON summary a write left at ``summaryPath``."""
    with open(path) as f:
        result: dict[str, Any] = json.load(f)
    return result
