"""``keyqueue backfill``: Parquet, CSV or JSON rows written as keyed requests, with progress.

Every row of a key runs in input order: rows are numbered as read (``_kq_row``), hash-partitioned
by key (all of a key's rows in one Spark partition) and sorted by that number within each
partition before the sink publishes them. The row number is also the sink's id column, so a
request id is derived from (job id, task, version, key, row number): running the same backfill
on the same input again within the inbox's duplicate window adds nothing.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from keyqueue.errors import KeyqueueError
from keyqueue.ext import QueueNames

from .sink import read_summary
from .streams import connect_to, stream_bounds

ROW_COLUMN: Final = "_kq_row"
"""The input row number the backfill adds (and uses as the request identity)."""

FORMATS: Final = ("parquet", "csv", "json")


def guess_format(path: str) -> str:
    """``parquet``, ``csv`` or ``json`` from the file name (a directory is read as Parquet)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix in ("jsonl", "ndjson"):
        return "json"
    return suffix if suffix in FORMATS else "parquet"


@dataclass(frozen=True)
class BackfillJob:
    """What to write where."""

    input_path: str
    queue: str
    task: str
    key: str
    url: str
    input_format: str | None = None
    version: int = 1
    columns: tuple[str, ...] | None = None
    job_id: str | None = None
    partitions: int | None = None
    max_errors: int = 0
    csv_header: bool = True


class WriteProgress:
    """A background thread that shows tasks done and requests stored while a write runs.

    Stored requests are read off the inbox stream's last sequence (a repeated request id stores
    nothing, so a rerun shows 0 stored). The thread is owned: ``stop()`` ends and joins it.
    """

    def __init__(self, spark: Any, url: str, queue: str, total: int, *, interval: float = 1.0,
                 out: Any = None) -> None:
        self.spark, self.url, self.queue, self.total = spark, url, queue, total
        self.interval = interval
        self.out = out if out is not None else sys.stderr
        self._stop = threading.Event()
        self._start_seq = self._last_seq()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="keyqueue-backfill-progress", daemon=True)

    def _last_seq(self) -> int:
        async def last() -> int:
            nc = await connect_to(self.url)
            try:
                return (await stream_bounds(nc, QueueNames(self.queue).inbox_stream)).last_seq
            finally:
                await nc.close()
        try:
            return asyncio.run(last())
        except KeyqueueError:
            return 0

    def line(self) -> str:
        tracker = self.spark.sparkContext.statusTracker()
        done = total = 0
        for stage_id in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        stored = max(0, self._last_seq() - self._start_seq)
        elapsed = max(1e-6, time.monotonic() - self._started)
        share = f" ({100 * stored / self.total:.0f}%)" if self.total else ""
        tasks = f"tasks {done}/{total}, " if total else ""
        return f"{tasks}stored {stored:,}/{self.total:,} requests{share}, {stored / elapsed:,.0f}/s"

    def _run(self) -> None:
        tty = getattr(self.out, "isatty", lambda: False)()
        every = self.interval if tty else max(5.0, self.interval)
        while not self._stop.wait(every):
            text = self.line()
            print(f"\r{text}   " if tty else text, end="" if tty else "\n", file=self.out, flush=True)
        if tty:
            print(file=self.out)

    def start(self) -> WriteProgress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_backfill(spark: Any, job: BackfillJob, *, show_progress: bool = True) -> dict[str, Any]:
    """Read the input, write it through the ``keyqueue`` sink, return the sink's summary.

    Raises the sink's error (with the summary) when more than ``max_errors`` rows were bad.
    """
    from pyspark.sql import functions as F

    fmt = job.input_format or guess_format(job.input_path)
    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", str(job.csv_header).lower()).option("inferSchema", "true")
    frame = reader.load(job.input_path)
    if job.key not in frame.columns:
        raise ValueError(f"the input has no column {job.key!r} (columns: {', '.join(frame.columns)})")
    rows = frame.count()
    parts = job.partitions or max(1, spark.sparkContext.defaultParallelism)
    ordered = (frame.withColumn(ROW_COLUMN, F.monotonically_increasing_id())
               .repartition(parts, job.key).sortWithinPartitions(ROW_COLUMN))
    with tempfile.TemporaryDirectory(prefix="keyqueue-backfill-") as tmp:
        summary_path = str(Path(tmp) / "summary.json")
        writer = (ordered.write.format("keyqueue").mode("append")
                  .option("url", job.url).option("queue", job.queue).option("task", job.task)
                  .option("key", job.key).option("idColumn", ROW_COLUMN).option("version", str(job.version))
                  .option("jobId", job.job_id or f"backfill:{job.task}:{Path(job.input_path).name}")
                  .option("maxErrors", str(job.max_errors)).option("summaryPath", summary_path))
        if job.columns:
            writer = writer.option("columns", ",".join(job.columns))
        progress = WriteProgress(spark, job.url, job.queue, rows).start() if show_progress else None
        try:
            writer.save()
        finally:
            if progress is not None:
                progress.stop()
        return read_summary(summary_path)
