"""The plugin's pure logic, without a JVM: partition planning, request ids, value conversion, options."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DateType,
    DecimalType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from keyqueue.errors import (
    BacklogFull,
    Disconnected,
    EnqueueError,
    EnqueueTimeout,
    JetStreamError,
    JetStreamUnavailable,
    KeyqueueTimeout,
)
from keyqueue.events import EVENT_FIELD_NAMES, EVENT_FIELDS, event
from keyqueue_spark.backfill import guess_format
from keyqueue_spark.events import coerce_event, event_schema
from keyqueue_spark.report import MAX_BUCKETS, pick_bucket
from keyqueue_spark.rows import RowIdentity, derive_request_id, plain_converter
from keyqueue_spark.sink import SinkOptions, refused_for_now
from keyqueue_spark.source import SequenceRange, SourceOptions, plan_partitions, split_range


def test_split_range_covers_every_sequence_once() -> None:
    for first, last, parts in [(1, 10, 3), (5, 5, 4), (1, 100_000, 7), (10, 9, 2)]:
        ranges = split_range(first, last, parts)
        covered = [s for r in ranges for s in range(r.first, r.last + 1)]
        assert covered == list(range(first, last + 1))
        assert len(ranges) <= max(1, parts)


def test_partitions_follow_the_option_or_the_message_count() -> None:
    options = SourceOptions.from_options({"queue": "q", "rowsPerPartition": "1000"})
    assert len(plan_partitions(1, 5000, options, messages=2500)) == 3
    assert plan_partitions(1, 0, options) == []
    fixed = SourceOptions.from_options({"queue": "q", "PARTITIONS": "4"})
    assert plan_partitions(1, 100, fixed) == [SequenceRange(1, 25), SequenceRange(26, 50), SequenceRange(51, 75),
                                             SequenceRange(76, 100)]


def test_source_options_name_the_stream() -> None:
    assert SourceOptions.from_options({"queue": "shop"}).stream == "KQ_shop_EVENTS"
    dlq = SourceOptions.from_options({"queue": "shop", "stream": "dlq"})
    assert (dlq.stream, dlq.events) == ("KQ_shop_DLQ", False)
    with pytest.raises(ValueError, match="needs option queue"):
        SourceOptions.from_options({})
    with pytest.raises(ValueError, match="not one of"):
        SourceOptions.from_options({"queue": "shop", "stream": "tokens"})


def test_request_ids_are_stable_and_distinguish_what_matters() -> None:
    ident = RowIdentity()
    a1, a2 = ident.by_content("k", b"body"), ident.by_content("k", b"body")
    assert a1 != a2  # two identical rows in one partition stay two requests
    again = RowIdentity()
    assert again.by_content("k", b"body") == a1 and again.by_content("k", b"body") == a2  # a retried task
    rid = derive_request_id("job", "T", 1, "k", a1)
    assert rid == derive_request_id("job", "T", 1, "k", a1) and len(rid) == 26
    assert len({rid, derive_request_id("job2", "T", 1, "k", a1), derive_request_id("job", "T", 2, "k", a1),
                derive_request_id("job", "T", 1, "k2", a1), derive_request_id("job", "U", 1, "k", a1)}) == 5
    assert RowIdentity.by_column(17) == RowIdentity.by_column(17) != RowIdentity.by_column(18)


def test_spark_values_become_plain_wire_values() -> None:
    naive = datetime(2026, 1, 2, 3, 4, 5)
    assert plain_converter(TimestampType())(naive) == naive.astimezone(UTC)
    assert plain_converter(TimestampNTZType())(naive) == "2026-01-02T03:04:05"
    assert plain_converter(DateType())(date(2026, 1, 2)) == "2026-01-02"
    assert plain_converter(DecimalType(10, 2))(Decimal("1.10")) == "1.10"
    assert plain_converter(BinaryType())(bytearray(b"ab")) == b"ab"
    nested = StructType([StructField("when", DateType()), StructField("tags", ArrayType(StringType()))])
    assert plain_converter(ArrayType(nested))([{"when": date(2026, 1, 1), "tags": ["a"]}]) == [
        {"when": "2026-01-01", "tags": ["a"]}]
    assert plain_converter(MapType(StringType(), LongType()))({"a": 1}) == {"a": 1}
    assert plain_converter(LongType())(None) is None


def test_sink_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs option"):
        SinkOptions.from_options({"queue": "q"})
    opts = SinkOptions.from_options({"queue": "q", "task": "T", "key": "k", "maxErrors": "-1", "COLUMNS": "a, b"})
    assert (opts.job_id, opts.max_errors, opts.columns, opts.version) == ("task:T", -1, ("a", "b"), 1)


def test_events_follow_the_contract() -> None:
    body = event("started", 1, "q", key="k", wait=0.5, attempt=1)
    assert list(body) == list(EVENT_FIELD_NAMES) and body["ts"] == 1.0 and body["run"] is None
    assert coerce_event({**body, "wait": 2, "attempt": "x"})[EVENT_FIELD_NAMES.index("wait")] == 2.0
    assert coerce_event({**body, "attempt": "x"})[EVENT_FIELD_NAMES.index("attempt")] is None
    with pytest.raises(ValueError):
        event("started", 1, "q", colour="red")


def test_the_event_schema_is_the_contracts_fields_and_types() -> None:
    spark_types = {"string": StringType(), "double": DoubleType(), "long": LongType()}
    assert [(f.name, f.dataType, f.nullable) for f in event_schema().fields] == [
        (name, spark_types[kind], True) for name, kind, _ in EVENT_FIELDS]


def test_report_buckets_and_input_formats() -> None:
    assert pick_bucket(60) == 1 and pick_bucket(3600) == 30 and pick_bucket(86400 * 30) == 21600
    assert all(pick_bucket(span) * MAX_BUCKETS >= span for span in (1, 500, 10_000, 1e6))
    assert [guess_format(p) for p in ("a.csv", "a.JSONL", "dir", "x.parquet")] == ["csv", "json", "parquet", "parquet"]


def test_the_backlog_bound_holds_however_the_writers_interleave() -> None:
    from keyqueue.errors import ConfigError
    from keyqueue_spark.backlog import BacklogLimit

    limit = BacklogLimit(max_pending=40, writers=2, batch_rows=10_000)
    assert limit.chunk == 10
    assert limit.allows(20) and not limit.allows(21)
    # Worst case: every writer reads the same allowed backlog and sends a chunk before any is seen.
    for writers, pending in [(1, 1), (2, 40), (3, 100), (8, 25_000), (5, 7)]:
        bound = BacklogLimit(pending, writers, 10_000)
        highest_allowed = max(b for b in range(pending + 1) if bound.allows(b))
        assert highest_allowed + writers * bound.chunk <= pending
    assert BacklogLimit(25_000, 2, 10_000).chunk == 6_250
    assert BacklogLimit(1_000_000, 2, 10_000).chunk == 10_000  # never more than a batch
    with pytest.raises(ConfigError, match="less than the 3 tasks that write at once"):
        BacklogLimit(2, 3, 10_000)
    with pytest.raises(ValueError, match="option maxPending must be a positive integer, got '0'"):
        SinkOptions.from_options({"queue": "q", "task": "T", "key": "k", "maxPending": "0"})


def test_progress_counts_a_retried_tasks_rows_once_and_its_stored_requests_all() -> None:
    from keyqueue_spark.progress import JobProgress, TaskCounts

    progress = JobProgress(spark=None, url="nats://unused", subject="_KQSPARK.progress.t", total=300)
    # Partition 0 failed after 80 rows (all stored) and ran again: 80 duplicates, 20 new.
    progress.record(TaskCounts(0, 0, 80, 80, 0, 0, 0.0, None, None, False))
    progress.record(TaskCounts(0, 1, 100, 20, 80, 0, 0.0, None, None, True))
    progress.record(TaskCounts(1, 0, 150, 150, 0, 1, 2.5, 120, 100, False))
    assert progress.totals() == (250, 250, 80, 1)
    assert progress.waiting() == (120, 2.5)


def caused(cause: Exception) -> EnqueueError:
    error = EnqueueError(f"request not stored: {cause}")
    error.__cause__ = cause
    return error


def test_a_refusal_that_passes_is_told_from_one_about_the_row() -> None:
    for passing in (BacklogFull("q", "k"), EnqueueTimeout("q", "k", "r1", 5.0), caused(Disconnected("down")),
                    caused(KeyqueueTimeout("no ack")), caused(JetStreamUnavailable("electing"))):
        assert refused_for_now(passing), passing
    for about_the_row in (caused(JetStreamError("message size exceeds maximum allowed")), EnqueueError("?")):
        assert not refused_for_now(about_the_row), about_the_row
