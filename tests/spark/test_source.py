"""The reader: a batch read returns exactly the stream's messages; a restarted stream sees each once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from keyqueue.events import EVENT_FIELD_NAMES
from keyqueue.server.embedded import EmbeddedServer
from tests.spark.fixtures import history, publish_history
from tests.spark.helpers import run


def test_batch_read_returns_the_streams_messages_with_decoded_columns(spark: Any, server: EmbeddedServer) -> None:
    events = history("shop", requests=300)
    run(publish_history(server.url, "shop", events))

    frame = (spark.read.format("keyqueue").option("url", server.url).option("queue", "shop")
             .option("partitions", "3").load())
    assert frame.rdd.getNumPartitions() == 3
    rows = frame.orderBy("seq").collect()

    assert [r["seq"] for r in rows] == list(range(1, len(events) + 1))
    for row, sent in zip(rows, events, strict=True):
        assert {name: row[name] for name in EVENT_FIELD_NAMES} == sent
        assert row["subject"] == f"kq.shop.events.{sent['event']}"
        assert (row["message_type"], row["version"], row["decode_error"]) == ("KeyqueueEvent", 1, None)
        assert row["timestamp"] is not None

    started = (spark.read.format("keyqueue").option("url", server.url).option("queue", "shop")
               .option("subject", "kq.shop.events.started").option("startSequence", "100").load())
    expected = [i + 1 for i, e in enumerate(events) if e["event"] == "started" and i + 1 >= 100]
    assert sorted(r["seq"] for r in started.select("seq").collect()) == expected


def test_a_restarted_streaming_query_sees_each_message_once(spark: Any, server: EmbeddedServer,
                                                             tmp_path: Path) -> None:
    events = history("shop", requests=200)
    half = len(events) // 2
    run(publish_history(server.url, "shop", events[:half]))
    output, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")

    def run_query() -> None:
        stream = (spark.readStream.format("keyqueue").option("url", server.url).option("queue", "shop")
                  .option("maxMessagesPerTrigger", "150").load())
        query = (stream.select("seq", "event", "request_id").writeStream.format("parquet")
                 .option("path", output).option("checkpointLocation", checkpoint).trigger(processingTime="0 seconds")
                 .start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    run_query()
    seen = [r["seq"] for r in spark.read.parquet(output).collect()]
    assert sorted(seen) == list(range(1, half + 1))

    run(publish_history(server.url, "shop", events[half:]))
    time.sleep(0.1)
    run_query()
    seen = [r["seq"] for r in spark.read.parquet(output).collect()]
    assert sorted(seen) == list(range(1, len(events) + 1))  # nothing twice, nothing missed
