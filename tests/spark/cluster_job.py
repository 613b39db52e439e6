"""The data source on a Spark cluster, as a user's driver runs it: batch and streaming reads and writes.

``python -m tests.spark.cluster_job MASTER URL OUT [KEY=VALUE ...]`` reads the ``shop`` queue's
events in batch and as a stream (into Parquet), writes a DataFrame to the ``cluster`` queue and
the events, as a stream, to the ``audit`` queue, and runs ``keyqueue report`` on the ``rebaser``
queue's events (the command takes the driver's session, on MASTER); then prints one JSON line
of what it read and what the writes' commits and the report said. The test checks the queues.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.spark.stream_job import SOURCE_QUEUE
from tests.spark.stream_job import start as start_audit

WRITE_QUEUE = "cluster"
REPORT_QUEUE = "rebaser"
ROWS, KEYS, PARTITIONS = 2_000, 200, 4


def run(spark: Any, master: str, url: str, out: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    result: dict[str, Any] = {"app_id": spark.sparkContext.applicationId}
    batch = (spark.read.format("keyqueue").option("url", url).option("queue", SOURCE_QUEUE)
             .option("partitions", str(PARTITIONS)).load())
    result["read_partitions"] = batch.rdd.getNumPartitions()
    result["read"] = sorted(r["seq"] for r in batch.select("seq").collect())

    stream = spark.readStream.format("keyqueue").option("url", url).option("queue", SOURCE_QUEUE).load()
    query = (stream.select("seq", "event").writeStream.format("parquet").option("path", str(out / "events"))
             .option("checkpointLocation", str(out / "events-checkpoint")).start())
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    result["streamed"] = sorted(r["seq"] for r in spark.read.parquet(str(out / "events")).collect())

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

    from click.testing import CliRunner

    from keyqueue.cli import main as keyqueue

    report = CliRunner().invoke(keyqueue, ["report", REPORT_QUEUE, "--url", url, "--master", master,
                                           "--out", str(out / "report")])
    result["report"] = {"exit_code": report.exit_code, "stdout": report.stdout, "stderr": report.stderr}
    return result


def main() -> None:
    master, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    conf = dict(pair.split("=", 1) for pair in sys.argv[4:])
    from keyqueue_spark import spark_session

    spark = spark_session(master, "keyqueue-cluster-job", conf=conf)
    try:
        print(json.dumps(run(spark, master, url, out)))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
