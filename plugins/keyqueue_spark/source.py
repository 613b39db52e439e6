"""The ``keyqueue`` Spark data source: read a queue's streams as DataFrames, write requests into it.

Reading (batch and streaming)::

    spark.read.format("keyqueue").option("queue", "rebaser").option("stream", "events").load()
    spark.readStream.format("keyqueue").option("queue", "rebaser").load()

Writing is in :mod:`keyqueue_spark.sink` (batch) and :mod:`keyqueue_spark.stream_sink`
(``writeStream``). Options (case-insensitive):

``url``               NATS URL(s); default ``$KEYQUEUE_URL`` on the driver, else nats://127.0.0.1:4222
``queue``             the queue whose stream is read (required unless ``streamName``)
``stream``            ``events`` (default), ``inbox`` or ``dlq``
``streamName``        any stream by name instead (read as requests)
``subject``           a subject filter inside the stream (``kq.rebaser.events.*.w1.>``: every event of keys under
                      ``w1``; a key's events are batched, so filter one event name with the ``event`` column)
``startSequence``     batch: first stream sequence read (default: the stream's first)
``endSequence``       batch: last stream sequence read (default: the stream's last at planning time)
``partitions``        how many sequence ranges; default one per ``rowsPerPartition`` messages
``rowsPerPartition``  default 50000
``startingOffsets``   streaming: ``earliest`` (default), ``latest`` or a stream sequence
``maxMessagesPerTrigger``  streaming: at most this many sequences per micro-batch

Streaming offsets are ``{"seq": N}``: every message up to and including sequence N has been
read. Spark checkpoints them, so a restarted query goes on from the sequence after N.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Final

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from keyqueue.events import EVENT_BATCH_MESSAGE_TYPE, decode_events
from keyqueue.wire.headers import is_release_marker

from .events import coerce_event, event_schema
from .streams import (
    DEFAULT_URL,
    Decoded,
    StoredMessage,
    StreamBounds,
    connect_to,
    decode_message,
    key_of_subject,
    read_range,
    stream_bounds,
    stream_name,
)

NAME: Final = "keyqueue"
"""The format name: ``spark.read.format("keyqueue")``."""

URL_ENV: Final = "KEYQUEUE_URL"

DEFAULT_ROWS_PER_PARTITION: Final = 50_000

META_SCHEMA: Final = StructType([
    StructField("seq", LongType(), False),
    StructField("subject", StringType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("message_type", StringType(), True),
    StructField("version", IntegerType(), True),
])
"""Columns every read has: stream sequence and subject, the server's store time, the wire type."""

REQUEST_SCHEMA: Final = StructType([
    *META_SCHEMA.fields,
    StructField("key", StringType(), True),
    StructField("request_id", StringType(), True),
    StructField("headers", MapType(StringType(), StringType()), True),
    StructField("fields", StringType(), True),
    StructField("decode_error", StringType(), True),
])
"""Inbox and DLQ reads: the key from the subject, the request's headers, its fields as JSON text."""

EVENTS_SCHEMA: Final = StructType([
    *META_SCHEMA.fields,
    *event_schema().fields,
    StructField("decode_error", StringType(), True),
])
"""Events reads: one column per event field (keyqueue.events.EVENT_FIELDS)."""


# --- options -----------------------------------------------------------------------------------------


def lower_keys(options: Mapping[str, str]) -> dict[str, str]:
    """Options with lower-case names (Spark's option names are case-insensitive)."""
    return {str(name).lower(): value for name, value in options.items()}


def resolve_url(options: Mapping[str, str]) -> str:
    """The ``url`` option, else ``$KEYQUEUE_URL``, else the local default (read on the driver only)."""
    return options.get("url") or os.environ.get(URL_ENV) or DEFAULT_URL


def _int_option(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = options.get(name.lower())
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"option {name} must be an integer, got {raw!r}") from None


@dataclass(frozen=True)
class SourceOptions:
    """The reader's options, checked once on the driver."""

    url: str
    stream: str
    events: bool
    subject: str | None
    start_sequence: int | None
    end_sequence: int | None
    partitions: int | None
    rows_per_partition: int
    starting_offsets: str
    max_per_trigger: int | None

    @classmethod
    def from_options(cls, given: Mapping[str, str]) -> SourceOptions:
        options = lower_keys(given)
        kind = (options.get("stream") or "events").lower()
        if options.get("streamname"):
            stream, events = str(options["streamname"]), kind == "events" and bool(options.get("stream"))
        elif options.get("queue"):
            stream, events = stream_name(str(options["queue"]), kind), kind == "events"
        else:
            raise ValueError("the keyqueue source needs option queue (and stream: events, inbox or dlq) "
                             "or option streamName")
        rows = _int_option(options, "rowsPerPartition", DEFAULT_ROWS_PER_PARTITION) or DEFAULT_ROWS_PER_PARTITION
        return cls(
            url=resolve_url(options), stream=stream, events=events, subject=options.get("subject") or None,
            start_sequence=_int_option(options, "startSequence", None),
            end_sequence=_int_option(options, "endSequence", None),
            partitions=_int_option(options, "partitions", None),
            rows_per_partition=max(1, rows),
            starting_offsets=(options.get("startingoffsets") or "earliest").lower(),
            max_per_trigger=_int_option(options, "maxMessagesPerTrigger", None),
        )


@dataclass(frozen=True)
class SequenceRange(InputPartition):
    """One Spark partition: the stream sequences ``first``..``last``, both included."""

    first: int
    last: int


def split_range(first: int, last: int, parts: int) -> list[SequenceRange]:
    """``first``..``last`` cut into at most ``parts`` contiguous ranges of near-equal length."""
    if last < first:
        return []
    count = last - first + 1
    parts = max(1, min(parts, count))
    size = math.ceil(count / parts)
    return [SequenceRange(lo, min(lo + size - 1, last)) for lo in range(first, last + 1, size)]


def plan_partitions(first: int, last: int, options: SourceOptions, messages: int | None = None) -> list[SequenceRange]:
    """The ranges to read: ``partitions`` of them, else one per ``rows_per_partition`` messages."""
    if options.partitions:
        parts = options.partitions
    else:
        parts = math.ceil(max(1, messages if messages is not None else last - first + 1) / options.rows_per_partition)
    return split_range(first, last, parts)


# --- rows --------------------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _to_json(value: Any) -> str:
    return json.dumps(value, default=_json_default, ensure_ascii=False, separators=(",", ":"))


def _coercer(data_type: DataType) -> Callable[[Any], Any]:
    """Fit a decoded value to a column type; a value that does not fit becomes null."""
    if isinstance(data_type, StringType):
        return lambda v: v if v is None or isinstance(v, str) else _to_json(v)
    if isinstance(data_type, DoubleType | FloatType):
        return lambda v: float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
    if isinstance(data_type, LongType | IntegerType | ShortType | ByteType):
        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None
    if isinstance(data_type, BooleanType):
        return lambda v: v if isinstance(v, bool) else None
    if isinstance(data_type, BinaryType):
        return lambda v: bytes(v) if isinstance(v, bytes | bytearray) else None
    if isinstance(data_type, TimestampType):
        def timestamp(v: Any) -> Any:
            if isinstance(v, datetime):
                return v
            if isinstance(v, int | float) and not isinstance(v, bool):
                return datetime.fromtimestamp(v, UTC)
            return None
        return timestamp
    return lambda v: v


RowMaker = Callable[[StoredMessage, Decoded], tuple[Any, ...]]


def row_maker(schema: StructType, events: bool) -> RowMaker:
    """A function from a stored message to a row of ``schema``; columns are filled by name.

    Metadata columns (``seq``, ``subject``, ``timestamp``, ``message_type``, ``version``,
    ``key``, ``request_id``, ``headers``, ``fields``, ``decode_error``) come from the message;
    any other column is the body field of that name, fitted to the column's type.
    """
    if events and [f.name for f in schema.fields] == [f.name for f in EVENTS_SCHEMA.fields]:
        def event_row(m: StoredMessage, d: Decoded) -> tuple[Any, ...]:
            return (m.seq, m.subject, m.timestamp, d.message_type, d.version,
                    *coerce_event(d.fields or {}), d.error)
        return event_row

    getters: list[Callable[[StoredMessage, Decoded], Any]] = []
    for field in schema.fields:
        getters.append(_getter(field, events))

    def row(m: StoredMessage, d: Decoded) -> tuple[Any, ...]:
        return tuple(get(m, d) for get in getters)
    return row


def _getter(field: StructField, events: bool) -> Callable[[StoredMessage, Decoded], Any]:
    name = field.name
    fixed: dict[str, Callable[[StoredMessage, Decoded], Any]] = {
        "seq": lambda m, d: m.seq,
        "subject": lambda m, d: m.subject,
        "timestamp": lambda m, d: m.timestamp,
        "message_type": lambda m, d: d.message_type,
        "version": lambda m, d: d.version,
        "request_id": lambda m, d: d.request_id if not events else (d.fields or {}).get("request_id"),
        "headers": lambda m, d: dict(m.headers),
        "fields": lambda m, d: None if d.fields is None else _to_json(d.fields),
        "decode_error": lambda m, d: d.error,
    }
    if name == "key" and not events:
        return lambda m, d: key_of_subject(m.subject)
    if name in fixed:
        return fixed[name]
    fit = _coercer(field.dataType)
    return lambda m, d: fit((d.fields or {}).get(name))


def read_rows(url: str, stream: str, part: SequenceRange, subject: str | None, schema: StructType,
              events: bool) -> Iterator[tuple[Any, ...]]:
    """The rows of one partition, read page by page on this executor's own connection."""
    make = row_maker(schema, events)
    with asyncio.Runner() as runner:
        nc = runner.run(connect_to(url))
        pages = read_range(nc, stream, part.first, part.last, subject=subject)
        try:
            while True:
                try:
                    page = runner.run(pages.__anext__())
                except StopAsyncIteration:
                    break
                for message in page:
                    if is_release_marker(message.headers):
                        continue  # a key given back (it lives a second in the inbox): not a request
                    decoded = decode_message(message.headers, message.data)
                    if events and decoded.message_type == EVENT_BATCH_MESSAGE_TYPE and decoded.error is None:
                        # Several events of one key in one message: a row each (they share its seq).
                        for fields in decode_events(message.headers, message.data):
                            yield make(message, dataclasses.replace(decoded, fields=fields))
                        continue
                    yield make(message, decoded)
        finally:
            runner.run(pages.aclose())
            runner.run(nc.close())


def current_bounds(url: str, stream: str) -> StreamBounds:
    async def bounds() -> StreamBounds:
        nc = await connect_to(url)
        try:
            return await stream_bounds(nc, stream)
        finally:
            await nc.close()
    return asyncio.run(bounds())


# --- the data source ---------------------------------------------------------------------------------


class KeyqueueDataSource(DataSource):
    """``format("keyqueue")``: a queue's events, inbox or DLQ as a DataFrame; requests written to a queue."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        # Resolved here, on the driver, so every executor connects to the same place.
        self.options = lower_keys(options)
        self.options["url"] = resolve_url(self.options)

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return EVENTS_SCHEMA if SourceOptions.from_options(self.options).events else REQUEST_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return KeyqueueBatchReader(SourceOptions.from_options(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KeyqueueStreamReader(SourceOptions.from_options(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from .sink import KeyqueueWriter

        return KeyqueueWriter(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from .stream_sink import KeyqueueStreamWriter

        return KeyqueueStreamWriter(self.options, schema, overwrite)


class KeyqueueBatchReader(DataSourceReader):
    """A batch read of one stream, cut into sequence ranges read in parallel."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.source = options
        self.schema = schema

    def partitions(self) -> list[SequenceRange]:
        bounds = current_bounds(self.source.url, self.source.stream)
        first = max(bounds.first_seq, self.source.start_sequence or 0, 1)
        last = bounds.last_seq if self.source.end_sequence is None else min(bounds.last_seq, self.source.end_sequence)
        ranges = plan_partitions(first, last, self.source, bounds.messages)
        # Spark needs at least one partition; an empty range reads nothing.
        return ranges or [SequenceRange(1, 0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, SequenceRange)
        yield from read_rows(self.source.url, self.source.stream, partition, self.source.subject, self.schema,
                             self.source.events)


class KeyqueueStreamReader(DataSourceStreamReader):
    """Micro-batches of new messages; offsets are stream sequences (``{"seq": last read}``)."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.source = options
        self.schema = schema

    def initialOffset(self) -> dict[str, int]:
        bounds = current_bounds(self.source.url, self.source.stream)
        start = self.source.starting_offsets
        if start == "earliest":
            return {"seq": max(0, bounds.first_seq - 1)}
        if start == "latest":
            return {"seq": bounds.last_seq}
        try:
            return {"seq": max(0, int(start) - 1)}
        except ValueError:
            raise ValueError(f"startingOffsets must be earliest, latest or a stream sequence, got {start!r}") from None

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        if self.source.max_per_trigger:
            return ReadMaxRows(self.source.max_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
        last = current_bounds(self.source.url, self.source.stream).last_seq
        # Spark 4.2+ passes a ReadLimit; 4.0/4.1 pass nothing and read all that is available.
        max_rows = getattr(limit, "max_rows", None)
        if max_rows is None and limit is None:
            max_rows = self.source.max_per_trigger
        if start is not None and max_rows:
            last = min(last, int(start["seq"]) + int(max_rows))
        if start is not None:
            last = max(last, int(start["seq"]))
        return {"seq": last}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[SequenceRange]:
        first, last = int(start["seq"]) + 1, int(end["seq"])
        return plan_partitions(first, last, self.source)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, SequenceRange)
        yield from read_rows(self.source.url, self.source.stream, partition, self.source.subject, self.schema,
                             self.source.events)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: the streams keep their messages (limits retention)."""


__all__ = [
    "EVENTS_SCHEMA",
    "META_SCHEMA",
    "NAME",
    "REQUEST_SCHEMA",
    "KeyqueueBatchReader",
    "KeyqueueDataSource",
    "KeyqueueStreamReader",
    "SequenceRange",
    "SourceOptions",
    "lower_keys",
    "plan_partitions",
    "resolve_url",
    "split_range",
]
