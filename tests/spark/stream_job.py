"""A streaming query for the tests: a queue's events written as requests of another queue.

``python -m tests.spark.stream_job URL CHECKPOINT [--master M] [--max-pending N]`` runs it in a
driver of its own (a test kills that process mid-batch); :func:`start` runs it on a session the
caller has.
"""

from __future__ import annotations

import argparse
from typing import Any

SOURCE_QUEUE = "shop"
"""The queue whose events are read."""

TARGET_QUEUE = "audit"
"""The queue the events are written to, one ``Audit`` request per event of a key."""


def start(spark: Any, url: str, checkpoint: str, *, max_pending: int | None = None, summary: str | None = None,
          duplicate_window: float | None = None) -> Any:
    """Start the query: each keyed event of SOURCE_QUEUE becomes an ``Audit(seq, event)`` request for its key."""
    from pyspark.sql import functions as F

    events = (spark.readStream.format("keyqueue").option("url", url).option("queue", SOURCE_QUEUE).load()
              .filter(F.col("key").isNotNull()).select("key", "seq", "event"))
    writer = (events.writeStream.format("keyqueue").option("url", url).option("queue", TARGET_QUEUE)
              .option("task", "Audit").option("key", "key").option("checkpointLocation", checkpoint)
              .trigger(processingTime="0 seconds"))
    if max_pending is not None:
        writer = writer.option("maxPending", str(max_pending)).option("maxPendingWriters", "1")
    if summary is not None:
        writer = writer.option("summaryPath", summary)
    if duplicate_window is not None:
        writer = writer.option("duplicateWindow", str(duplicate_window))
    return writer.start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("checkpoint")
    parser.add_argument("--master", default="local[1]")
    parser.add_argument("--max-pending", type=int, default=None)
    args = parser.parse_args()
    from keyqueue_spark import spark_session

    spark = spark_session(args.master, "keyqueue-stream-job", conf={"spark.ui.enabled": "false"})
    start(spark, args.url, args.checkpoint, max_pending=args.max_pending).awaitTermination()


if __name__ == "__main__":
    main()
