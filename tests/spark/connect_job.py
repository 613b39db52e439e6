"""The data source through Spark Connect, as a user's client runs it: no JVM here, the server on the cluster.

``python -m tests.spark.connect_job sc://HOST:PORT URL OUT`` registers ``format("keyqueue")`` on a
remote session; reads the ``shop`` queue's events in batch, writes a DataFrame to the
``connected`` queue, and streams the events (a streaming read) to the ``audit`` queue (a
streaming write); then prints one JSON line of what it read and what the writes' commits said.
The test checks the queues themselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.spark.stream_job import SOURCE_QUEUE
from tests.spark.stream_job import start as start_audit

WRITE_QUEUE = "connected"
ROWS, KEYS, PARTITIONS = 2_000, 200, 4


def run(spark: Any, url: str, out: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    result: dict[str, Any] = {}
    batch = (spark.read.format("keyqueue").option("url", url).option("queue", SOURCE_QUEUE)
             .option("partitions", str(PARTITIONS)).load())
    result["read"] = sorted(r["seq"] for r in batch.select("seq").collect())

    frame = (spark.range(ROWS, numPartitions=PARTITIONS)
             .select(F.format_string("doc-%d", F.col("id") % KEYS).alias("doc"), F.col("id").alias("n")))
    (frame.write.format("keyqueue").mode("append").option("url", url).option("queue", WRITE_QUEUE)
     .option("task", "Reindex").option("key", "doc").option("summaryPath", str(out / "write.json")).save())
    result["write"] = json.loads((out / "write.json").read_text())

    audit = start_audit(spark, url, str(out / "audit-checkpoint"), summary=str(out / "audit.json"))
    try:
        audit.processAllAvailable()
    finally:
        audit.stop()
    result["stream_write"] = json.loads((out / "audit.json").read_text())
    return result


def main() -> None:
    remote, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from pyspark.sql import SparkSession

    from keyqueue_spark import register

    spark = SparkSession.builder.remote(remote).getOrCreate()
    try:
        register(spark)
        print(json.dumps(run(spark, url, out)))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
