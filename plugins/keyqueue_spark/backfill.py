"""``keyqueue backfill``: Parquet, CSV or JSON rows written as keyed requests, with progress.

Every row of a key runs in input order: rows are numbered as read (``_kq_row``), hash-partitioned
by key (all of a key's rows in one Spark partition) and sorted by that number within each
partition before the sink publishes them. The row number is also the sink's id column, so a
request id is derived from (job id, task, version, key, row number): running the same backfill
on the same input again within the inbox's duplicate window adds nothing.

Given the app's :class:`keyqueue.Task`, the backfill enqueues what the task takes: the key column
is one of the arguments when the task's function has a parameter of that name, and every row is
checked against the task's signature (and key) on the driver first. The first row that does not
fit stops the backfill before anything is stored (:class:`RowRefused`), as ``keyqueue enqueue
--from-file`` does with a bad line.
"""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from keyqueue import Task
from keyqueue.errors import ConfigError, KeyqueueError

from .backlog import BacklogLimit
from .progress import JobProgress, new_progress_subject
from .rows import plain_converter
from .sink import read_summary

ROW_COLUMN: Final = "_kq_row"
"""The input row number the backfill adds (and uses as the request identity)."""

FORMATS: Final = ("parquet", "csv", "json")

BATCH_ROWS: Final = 50_000
"""Rows per pipelined batch of a backfill's tasks (the sink's ``batchRows``). Each batch ends with one
token publish per distinct key in it: a task with 5,000 keys sends 5,000 tokens per batch, half
its publishes at the sink's default of 10,000 rows, a tenth at this size."""


def guess_format(path: str) -> str:
    """``parquet``, ``csv`` or ``json`` from the file name (a directory is read as Parquet)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix in ("jsonl", "ndjson"):
        return "json"
    return suffix if suffix in FORMATS else "parquet"


class RowRefused(ConfigError):
    """A row does not fit the task's signature (or key): nothing of the backfill was stored."""


def takes_parameter(task: Task[Any], name: str) -> bool:
    """Whether ``task``'s function has a parameter ``name`` (by name: not ``*args`` / ``**kwargs``)."""
    parameter = inspect.signature(task.fn).parameters.get(name)
    return parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)


def argument_columns(columns: Sequence[str], key: str, *, task: Task[Any] | None = None,
                     chosen: Sequence[str] | None = None) -> tuple[str, ...]:
    """The input columns that become each request's arguments.

    ``chosen`` (``--columns``) if given; else every column but the key and the row number, with
    the key column too when ``task``'s function takes a parameter of that name.
    """
    if chosen:
        return tuple(chosen)
    keep_key = task is not None and takes_parameter(task, key)
    return tuple(c for c in columns if c != ROW_COLUMN and (c != key or keep_key))


def check_rows(frame: Any, task: Task[Any], key: str, arguments: Sequence[str], *, source: str = "the input") -> int:
    """Check every row of ``frame`` against ``task`` on the driver, in input order; the row count.

    Each row's arguments are converted as the sink converts them and given to the task's own
    ``fields_from_mapping`` (its signature and argument types), and the key the task makes of
    them must be the row's key column. Raises :class:`RowRefused` for the first row that fails,
    numbered from 1 in input order.
    """
    fields = {f.name: f for f in frame.schema.fields}
    converters = [(name, plain_converter(fields[name].dataType)) for name in arguments]
    rows = 0
    for rows, row in enumerate(frame.select(key, *arguments).toLocalIterator(), start=1):
        value = row[0]
        where = f"row {rows} of {source} ({key} {value!r})"
        try:
            made, _ = task.fields_from_mapping({name: convert(row[i]) for i, (name, convert) in
                                                enumerate(converters, start=1)})
        except (TypeError, ValueError, KeyqueueError) as e:
            raise RowRefused(f"{where} does not fit task {task.name}: {e}; nothing was enqueued") from None
        if value is not None and value != "" and made != str(value):
            raise RowRefused(f"{where}: task {task.name} keys this row {made!r}, not {str(value)!r} (--key must be "
                             "the column the task's key is made of); nothing was enqueued")
    return rows


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
    max_pending: int | None = None
    """Keep the queue's backlog at or under this many requests, waiting for workers (None: no bound)."""


def run_backfill(spark: Any, job: BackfillJob, *, task: Task[Any] | None = None,
                 show_progress: bool = True) -> dict[str, Any]:
    """Read the input, write it through the ``keyqueue`` sink, return the sink's summary.

    With ``task`` (the app's task named ``job.task``), the arguments follow its signature and
    every row is checked first (:func:`check_rows`: :class:`RowRefused`, nothing stored). The
    summary has the sink's counts, ``arguments`` (the argument columns) and ``job_id``. Raises
    the sink's error (with the summary) when more than ``max_errors`` rows were bad.
    """
    from pyspark.sql import functions as F

    fmt = job.input_format or guess_format(job.input_path)
    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", str(job.csv_header).lower()).option("inferSchema", "true")
    frame = reader.load(job.input_path)
    if job.key not in frame.columns:
        raise ValueError(f"the input has no column {job.key!r} (columns: {', '.join(frame.columns)})")
    arguments = argument_columns(frame.columns, job.key, task=task, chosen=job.columns)
    unknown = [c for c in arguments if c not in frame.columns]
    if unknown:
        raise ValueError(f"the input has no column(s) {', '.join(unknown)} (columns: {', '.join(frame.columns)})")
    source = Path(job.input_path).name
    rows = check_rows(frame, task, job.key, arguments, source=source) if task is not None else frame.count()
    job_id = job.job_id or f"backfill:{job.task}:{source}"
    parallelism = max(1, spark.sparkContext.defaultParallelism)
    parts = job.partitions or parallelism
    # The most tasks that write at once: the bound of --max-pending holds for that many.
    writers = min(parts, parallelism)
    if job.max_pending is not None:
        BacklogLimit(job.max_pending, writers, BATCH_ROWS)  # a bad bound fails before Spark runs
    ordered = (frame.withColumn(ROW_COLUMN, F.monotonically_increasing_id())
               .repartition(parts, job.key).sortWithinPartitions(ROW_COLUMN))
    with tempfile.TemporaryDirectory(prefix="keyqueue-backfill-") as tmp:
        summary_path = str(Path(tmp) / "summary.json")
        subject = new_progress_subject()
        writer = (ordered.write.format("keyqueue").mode("append")
                  .option("url", job.url).option("queue", job.queue).option("task", job.task)
                  .option("key", job.key).option("idColumn", ROW_COLUMN).option("version", str(job.version))
                  .option("jobId", job_id).option("columns", ",".join(arguments))
                  .option("maxErrors", str(job.max_errors)).option("summaryPath", summary_path)
                  .option("batchRows", str(BATCH_ROWS)))
        if job.max_pending is not None:
            writer = writer.option("maxPending", str(job.max_pending)).option("maxPendingWriters", str(writers))
        progress = None
        if show_progress:
            writer = writer.option("progressSubject", subject)
            progress = JobProgress(spark, job.url, subject, rows, max_pending=job.max_pending).start()
        try:
            writer.save()
        finally:
            if progress is not None:
                progress.stop()
        return {**read_summary(summary_path), "arguments": list(arguments), "job_id": job_id}
