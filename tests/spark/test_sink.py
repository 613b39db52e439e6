"""The sink: exactly once, in per-key order within a partition, reruns add nothing, bad rows reported."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from keyqueue import QueueConfig
from keyqueue.ext import JetStreamApi, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_spark.streams import connect_to
from tests.spark.helpers import message_count, run, stream_messages

ROWS, KEYS, PARTITIONS = 20_000, 2_000, 4


def write(frame: Any, url: str, summary: Path, **options: str) -> dict[str, Any]:
    writer = (frame.write.format("keyqueue").mode("append").option("url", url).option("queue", "backfill")
              .option("task", "Reindex").option("key", "doc").option("summaryPath", str(summary)))
    for name, value in options.items():
        writer = writer.option(name, value)
    writer.save()
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


def test_rows_arrive_exactly_once_in_per_key_order_and_a_rerun_adds_nothing(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    frame = (spark.range(ROWS, numPartitions=PARTITIONS)
             .select(F.format_string("doc-%d", F.col("id") % KEYS).alias("doc"), F.col("id").alias("n"),
                     F.spark_partition_id().alias("part"), F.lit("full").alias("mode")))

    first = write(frame, server.url, tmp_path / "first.json", jobId="reindex-1")
    assert (first["rows"], first["accepted"], first["duplicates"], first["errors"]) == (ROWS, ROWS, 0, 0)
    assert first["partitions"] == PARTITIONS

    stored = run(stream_messages(server.url, "KQ_backfill_INBOX"))
    assert sorted(body["n"] for _, _, _, body in stored) == list(range(ROWS))  # each row once
    by_key_and_partition: dict[tuple[str, int], list[int]] = defaultdict(list)
    for _, subject, headers, body in stored:
        assert subject == "kq.backfill.in.doc-" + str(body["n"] % KEYS)
        assert headers["X-MESSAGE-TYPE"] == "Reindex" and headers["X-MESSAGE-VERSION"] == "1"
        assert set(body) == {"n", "part", "mode"}
        by_key_and_partition[(subject, body["part"])].append(body["n"])
    assert all(ns == sorted(ns) for ns in by_key_and_partition.values())  # stored in row order
    assert len({h["Nats-Msg-Id"] for _, _, h, _ in stored}) == ROWS
    assert run(message_count(server.url, "KQ_backfill_TOKENS")) == KEYS  # every key scheduled once

    again = write(frame, server.url, tmp_path / "again.json", jobId="reindex-1")
    assert (again["accepted"], again["duplicates"], again["errors"]) == (ROWS, ROWS, 0)
    assert run(message_count(server.url, "KQ_backfill_INBOX")) == ROWS


def test_bad_rows_are_reported_not_dropped(spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    rows = [("doc-1", 1), (None, 2), ("has space", 3), ("doc-2", 4), ("", 5)]
    frame = spark.createDataFrame(rows, "doc string, n long").coalesce(1)

    summary = write(frame, server.url, tmp_path / "tolerant.json", maxErrors="-1")
    assert (summary["rows"], summary["accepted"], summary["errors"]) == (5, 2, 3)
    reasons = "\n".join(summary["error_samples"])
    assert "row 1: key column 'doc' is null" in reasons
    assert "row 2 (key 'has space')" in reasons and "whitespace" in reasons
    assert "row 4: key column 'doc' is empty" in reasons
    assert sorted(b["n"] for _, _, _, b in run(stream_messages(server.url, "KQ_backfill_INBOX"))) == [1, 4]

    with pytest.raises(Exception, match="key column 'doc' is null") as failed:
        write(frame, server.url, tmp_path / "strict.json", jobId="strict")
    assert "more than maxErrors=0 rows were bad" in str(failed.value)
    strict = json.loads((tmp_path / "strict.json").read_text())
    assert (strict["accepted"], strict["errors"]) == (2, 3)  # the good rows are stored even so


async def capped_queue(url: str, max_backlog_per_key: int) -> None:
    nc = await connect_to(url)
    try:
        await Topology(JetStreamApi(nc), QueueConfig("backfill", max_backlog_per_key=max_backlog_per_key)).ensure()
    finally:
        await nc.close()


def test_rows_a_full_backlog_refuses_fail_the_write_whatever_max_errors_allows(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    run(capped_queue(server.url, 2))  # nobody runs the queue: a key's third row finds its backlog full
    frame = spark.createDataFrame([("doc-1", n) for n in range(5)], "doc string, n long").coalesce(1)

    # Not bad rows (nothing is wrong with them): the write fails, it does not go on without them.
    with pytest.raises(Exception, match="rows refused for now") as failed:
        write(frame, server.url, tmp_path / "refused.json", maxErrors="-1")
    assert "BacklogFull" in str(failed.value) and "max_backlog_per_key" in str(failed.value)
    assert json.loads((tmp_path / "refused.json").read_text())["aborted"] is True  # Spark aborted it, no commit
    assert run(message_count(server.url, "KQ_backfill_INBOX")) == 2
