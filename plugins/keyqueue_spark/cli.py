"""The ``keyqueue report`` and ``keyqueue backfill`` commands (click).

Registered into the ``keyqueue`` command line by :mod:`keyqueue_spark.plugin` through the
``keyqueue_add_commands`` hook; also runnable as ``python -m keyqueue_spark``. pyspark is
imported only when a command runs, so listing commands stays fast.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from keyqueue.errors import KeyqueueError

from .streams import DEFAULT_URL

_URL_HELP = "NATS URL(s) [env KEYQUEUE_URL; default nats://127.0.0.1:4222]"
_MASTER_HELP = "Spark master: local[*] (this machine, default), spark://host:7077, yarn, k8s://..."


def _url(url: str | None) -> str:
    return url or os.environ.get("KEYQUEUE_URL") or DEFAULT_URL


@contextmanager
def _session(master: str, app: str) -> Iterator[Any]:
    """A Spark session for one command; stopped afterwards unless it was already running."""
    try:
        from pyspark.sql import SparkSession

        from .session import register, spark_session
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise click.ClickException(f"{e}; install keyqueue-spark with its dependencies (pyspark, pyarrow)") from e
    active = SparkSession.getActiveSession()
    if active is not None:
        register(active)
        yield active
        return
    click.echo(f"starting Spark ({master}) ...", err=True)
    spark = spark_session(master, app, conf={"spark.ui.showConsoleProgress": "false"})
    try:
        yield spark
    finally:
        spark.stop()


@click.command("report")
@click.argument("queue")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--master", default="local[*]", show_default=True, help=_MASTER_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: keyqueue-report-QUEUE]")
@click.option("--events-from", type=click.Path(exists=True), default=None,
              help="Read events from this exported Parquet instead of the live stream.")
@click.option("--save-events", type=click.Path(), default=None,
              help="Also export the events read to this Parquet directory.")
@click.option("--top", default=20, show_default=True, help="How many hottest keys to show.")
@click.option("--bucket", type=float, default=None, help="Throughput bucket in seconds [default: automatic].")
def report(queue: str, url: str | None, master: str, out_dir: Path | None, events_from: str | None,
           save_events: str | None, top: int, bucket: float | None) -> None:
    """Report what QUEUE did, from its lifecycle events: an HTML page with charts and Parquet aggregates."""
    from .report import run_report

    started = time.monotonic()
    target = out_dir or Path(f"keyqueue-report-{queue}")
    try:
        with _session(master, f"keyqueue report {queue}") as spark:
            page, data = run_report(spark, queue, target, url=None if events_from else _url(url),
                                    events_from=events_from, save_events=save_events, top=top, bucket=bucket)
    except KeyqueueError as e:
        raise click.ClickException(str(e)) from e
    s = data.summary
    ratio = s["coalescing_ratio"]
    click.echo(f"{s['events']:,} events, {s['keys']:,} keys, tasks: {', '.join(s['tasks']) or '-'}; "
               f"DVU: {s['dvu_runs']:,} runs, {ratio:.2f} triggers per run" if ratio else
               f"{s['events']:,} events, {s['keys']:,} keys, tasks: {', '.join(s['tasks']) or '-'}")
    click.echo(f"report: {page} (aggregates in {page.parent / 'aggregates'}) in {time.monotonic() - started:.0f}s")


@click.command("backfill")
@click.argument("input_path", type=click.Path(exists=True))
@click.option("--queue", required=True, help="Queue to enqueue into.")
@click.option("--task", required=True, help="Task name (X-MESSAGE-TYPE of each request).")
@click.option("--key", "key_column", required=True, help="Column holding each row's key.")
@click.option("--format", "input_format", type=click.Choice(["parquet", "csv", "json"]), default=None,
              help="Input format [default: from the file name; directories are Parquet]")
@click.option("--columns", default=None, help="Comma-separated argument columns [default: all but the key].")
@click.option("--version", "task_version", default=1, show_default=True, help="Task version (X-MESSAGE-VERSION).")
@click.option("--job-id", default=None,
              help="Names the job in request ids: the same job id and input enqueue nothing twice "
                   "within the duplicate window [default: backfill:TASK:FILE]")
@click.option("--partitions", type=int, default=None, help="Spark partitions [default: the master's parallelism].")
@click.option("--max-errors", default=0, show_default=True, help="Bad rows tolerated before the job fails (-1: any).")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--master", default="local[*]", show_default=True, help=_MASTER_HELP)
def backfill(input_path: str, queue: str, task: str, key_column: str, input_format: str | None, columns: str | None,
             task_version: int, job_id: str | None, partitions: int | None, max_errors: int, url: str | None,
             master: str) -> None:
    """Enqueue every row of INPUT_PATH (Parquet, CSV or JSON) as a request of TASK for the row's key."""
    from .backfill import BackfillJob, run_backfill

    started = time.monotonic()
    job = BackfillJob(input_path=input_path, queue=queue, task=task, key=key_column, url=_url(url),
                      input_format=input_format, version=task_version,
                      columns=tuple(c.strip() for c in columns.split(",")) if columns else None,
                      job_id=job_id, partitions=partitions, max_errors=max_errors)
    try:
        with _session(master, f"keyqueue backfill {queue}") as spark:
            summary = run_backfill(spark, job)
    except (KeyqueueError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    except Exception as e:  # Spark wraps the sink's error; show its message, not a JVM trace
        if "KeyqueueWriteError" in str(e):
            message = str(e).split("KeyqueueWriteError:", 1)[-1].split("SQLSTATE")[0].strip()
            raise click.ClickException(message) from None
        raise
    new = summary["accepted"] - summary["duplicates"]
    click.echo(f"{summary['rows']:,} rows: {new:,} enqueued, {summary['duplicates']:,} duplicates, "
               f"{summary['errors']:,} errors in {time.monotonic() - started:.0f}s")
    for sample in summary["error_samples"]:
        click.echo(f"  error: {sample}", err=True)
    if summary["errors"]:
        sys.exit(0 if max_errors < 0 or summary["errors"] <= max_errors else 1)


def commands() -> list[click.Command]:
    """The commands this plugin adds to ``keyqueue``."""
    return [report, backfill]


@click.group()
def main() -> None:
    """keyqueue's Spark commands (also available as ``keyqueue report`` / ``keyqueue backfill``)."""


for _command in commands():
    main.add_command(_command)
