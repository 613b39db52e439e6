"""The ``keyqueue report`` and ``keyqueue backfill`` commands (click).

Registered into the ``keyqueue`` command line by :mod:`keyqueue_spark.plugin` through the
``keyqueue_add_commands`` hook; also runnable as ``python -m keyqueue_spark``. pyspark is
imported only when a command runs, so listing commands stays fast.

The NATS URL is found as every keyqueue command finds it: ``--url``, else ``$KEYQUEUE_URL``
(``keyqueue.Settings.from_env``), else, for ``backfill --app``, the app's own (its embedded
server when it has none), else a one-line error. ``--app MODULE:APP`` is loaded as ``keyqueue
worker`` loads it (``keyqueue.ext.load_app``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from keyqueue import App, BatchTask, Settings, Task
from keyqueue.errors import ConfigError, KeyqueueError
from keyqueue.ext import load_app

_URL_HELP = "NATS server(s), comma-separated (default: $KEYQUEUE_URL)."
_MASTER_HELP = ("Spark master: local[*] (this machine, default), spark://host:7077, yarn, k8s://...; "
                "report also takes a Spark Connect server, sc://host:15002")
_CONF_HELP = ("A Spark setting, KEY=VALUE (repeatable): spark.executor.memory=2g, spark.pyspark.python=PATH "
              "(the Python with keyqueue-spark on the executors' hosts) ...")
_NO_SERVER = "no NATS server: pass --url or set KEYQUEUE_URL (`keyqueue dev-server` runs one)"


def nats_url(url: str | None, app: App | None = None) -> str:
    """``url``, else ``$KEYQUEUE_URL``, else ``app``'s URL (its embedded server, started or found),
    else ``ConfigError``. With an app, ``url`` is already in its settings (:func:`load_app`)."""
    if app is not None:
        return asyncio.run(app.url())
    found = url or Settings.from_env().url
    if not found:
        raise ConfigError(_NO_SERVER)
    return found


def spark_conf(pairs: tuple[str, ...]) -> dict[str, str]:
    """``--conf KEY=VALUE`` options as a mapping; a pair without ``=`` is a usage error."""
    conf: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE (e.g. spark.executor.memory=2g)", param_hint="--conf")
        conf[name.strip()] = value
    return conf


@contextmanager
def _session(master: str, app: str, conf: dict[str, str] | None = None) -> Iterator[Any]:
    """A Spark session for one command; stopped afterwards unless it was already running."""
    try:
        from pyspark.sql import SparkSession

        from .session import register, spark_session
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise click.ClickException(f"{e}; install keyqueue-spark with its dependencies (pyspark, pyarrow)") from e
    if master.startswith("sc://"):  # a Spark Connect server: a remote session, no JVM here
        click.echo(f"connecting to Spark Connect ({master}) ...", err=True)
        builder = SparkSession.builder.remote(master)
        for name, value in (conf or {}).items():
            builder = builder.config(name, value)
        remote = builder.getOrCreate()
        register(remote)
        try:
            yield remote
        finally:
            remote.stop()
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        register(active)
        yield active
        return
    click.echo(f"starting Spark ({master}) ...", err=True)
    spark = spark_session(master, app, conf={"spark.ui.showConsoleProgress": "false", **(conf or {})})
    try:
        yield spark
    finally:
        spark.stop()


@click.command("report")
@click.argument("queue")
@click.option("--url", metavar="URL", default=None, help=_URL_HELP)
@click.option("--master", default="local[*]", show_default=True, help=_MASTER_HELP)
@click.option("--conf", "conf_pairs", metavar="KEY=VALUE", multiple=True, help=_CONF_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: keyqueue-report-QUEUE]")
@click.option("--events-from", type=click.Path(exists=True), default=None,
              help="Read events from this exported Parquet instead of the live stream.")
@click.option("--save-events", type=click.Path(), default=None,
              help="Also export the events read to this Parquet directory.")
@click.option("--top", default=20, show_default=True, help="How many hottest keys to show.")
@click.option("--bucket", type=float, default=None, help="Throughput bucket in seconds [default: automatic].")
def report(queue: str, url: str | None, master: str, conf_pairs: tuple[str, ...], out_dir: Path | None,
           events_from: str | None, save_events: str | None, top: int, bucket: float | None) -> None:
    """Report what QUEUE did, from its lifecycle events: an HTML page with charts and Parquet aggregates.

    Reads the events the events plugin stored for QUEUE (stream KQ_<QUEUE>_EVENTS) from the
    server at --url or $KEYQUEUE_URL, or from an export (--events-from, no server needed), with
    Spark (--master; local[*] by default). Writes report.html (charts embedded), summary.json and
    aggregates/*.parquet into --out. docs/spark.md defines every number.

    \b
    Examples:
      $ export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ keyqueue report shop                         # ./keyqueue-report-shop/report.html
      $ keyqueue report shop --out reports/shop --save-events shop-events.parquet
      $ keyqueue report shop --events-from shop-events.parquet --bucket 60
      $ keyqueue report shop --master spark://head:7077 --conf spark.executor.memory=2g
      $ keyqueue report shop --master sc://spark-connect:15002

    On a cluster (--master spark://..., yarn, k8s://...) the executors' Python must have
    keyqueue-spark installed: by default it is this Python's path, on every host; --conf
    spark.pyspark.python=PATH names another.
    """
    from .report import run_report

    started = time.monotonic()
    target = out_dir or Path(f"keyqueue-report-{queue}")
    conf = spark_conf(conf_pairs)
    try:
        source_url = None if events_from else nats_url(url)
        with _session(master, f"keyqueue report {queue}", conf) as spark:
            page, data = run_report(spark, queue, target, url=source_url,
                                    events_from=events_from, save_events=save_events, top=top, bucket=bucket)
    except KeyqueueError as e:
        raise click.ClickException(str(e)) from e
    s = data.summary
    ratio = s["coalescing_ratio"]
    line = f"{s['events']:,} events, {s['keys']:,} keys, tasks: {', '.join(s['tasks']) or '-'}"
    if s["dvu"]:
        line += f"; DVU: {s['dvu_runs']:,} runs" + (f", {ratio:.2f} triggers per run" if ratio else "")
    click.echo(line)
    click.echo(f"report: {page} (aggregates in {page.parent / 'aggregates'}) in {time.monotonic() - started:.0f}s")


@click.command("backfill")
@click.argument("input_path", type=click.Path(exists=True))
@click.option("--app", "app_spec", metavar="MODULE:APP", default=None,
              help="The app whose TASK this is: its signature and queue are followed and checked, "
                   "and its server is the default.")
@click.option("--queue", default=None, help="Queue to enqueue into [default with --app: the task's].")
@click.option("--task", required=True, help="Task name (X-MESSAGE-TYPE of each request).")
@click.option("--key", "key_column", required=True, help="Column holding each row's key.")
@click.option("--format", "input_format", type=click.Choice(["parquet", "csv", "json"]), default=None,
              help="Input format [default: from the file name; directories are Parquet]")
@click.option("--columns", default=None,
              help="Comma-separated argument columns [default: all but the key; with --app, the key too "
                   "when the task takes a parameter of that name].")
@click.option("--version", "task_version", type=int, default=None,
              help="Task version (X-MESSAGE-VERSION) [default: the task's with --app, else 1].")
@click.option("--job-id", default=None,
              help="Names the job in request ids: the same job id and input enqueue nothing twice "
                   "within the duplicate window [default: backfill:TASK:FILE]")
@click.option("--partitions", type=int, default=None, help="Spark partitions [default: the master's parallelism].")
@click.option("--max-errors", default=0, show_default=True, help="Bad rows tolerated before the job fails (-1: any).")
@click.option("--max-pending", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep the queue's backlog at or under N requests: wait for workers meanwhile "
                   "[default: no bound, write as fast as the server takes it].")
@click.option("--url", metavar="URL", default=None,
              help="NATS server(s), comma-separated (default: $KEYQUEUE_URL, else the --app's server).")
@click.option("--master", default="local[*]", show_default=True, help=_MASTER_HELP)
@click.option("--conf", "conf_pairs", metavar="KEY=VALUE", multiple=True, help=_CONF_HELP)
def backfill(input_path: str, app_spec: str | None, queue: str | None, task: str, key_column: str,
             input_format: str | None, columns: str | None, task_version: int | None, job_id: str | None,
             partitions: int | None, max_errors: int, max_pending: int | None, url: str | None, master: str,
             conf_pairs: tuple[str, ...]) -> None:
    """Enqueue every row of INPUT_PATH (Parquet, CSV or JSON) as a request of TASK for the row's key.

    With --app MODULE:APP (shop:app for `app` in shop.py; the current directory is importable),
    TASK is the app's task: the key column is one of its arguments when the task's function has
    a parameter of that name, and every row is checked against the task's signature before
    anything is stored: the first row that does not fit stops the backfill, with its number and
    the reason. Without --app, --queue is needed, the arguments are the columns but the key (or
    --columns), and rows are not checked (for processors' message types, say).

    Each key's rows are enqueued in input order. Request ids come from the job id and the row
    number, so the same input again within the queue's duplicate window enqueues nothing: the
    summary counts those rows as duplicates; another --job-id enqueues them again.

    With --max-pending N the backfill waits for workers whenever the queue's backlog (every
    request its inbox holds) would go over N; the progress line says so. The progress line
    counts this backfill's rows only.

    \b
    Examples:
      $ keyqueue backfill payments.csv --app shop:app --task post --key account
      10 rows: 10 enqueued in 9s
      $ keyqueue backfill payments.csv --app shop:app --task post --key account --job-id payments-2
      $ keyqueue backfill changes.parquet --queue rebaser --task EnqueueUpdatesRequest --key change_set
      $ keyqueue backfill big.parquet --app shop:app --task post --key account --max-pending 25000
      $ keyqueue backfill changes/ --format parquet --queue rebaser --task EnqueueUpdatesRequest \\
          --key change_set --master spark://head:7077 --url nats://nats.internal:4222 \\
          --conf spark.pyspark.python=/opt/keyqueue/.venv/bin/python
    """
    from .backfill import BackfillJob, run_backfill

    started = time.monotonic()
    conf = spark_conf(conf_pairs)
    app = None
    try:
        app = load_app(app_spec, url) if app_spec else None
        found = _app_task(app, task, queue) if app is not None else None
        if found is None and queue is None:
            raise click.UsageError("--queue is needed without --app (with --app it is the task's queue)")
        target = found.queue if found is not None else queue
        assert target is not None
        if master.startswith("sc://"):
            raise click.UsageError("backfill needs a Spark driver of its own (--master local[*], spark://..., yarn, "
                                   "k8s://...): through Spark Connect (sc://) it has no SparkContext to size its "
                                   "writes and show progress with")
        version = task_version if task_version is not None else found.spec.version if found is not None else 1
        job = BackfillJob(input_path=input_path, queue=target, task=task, key=key_column, url=nats_url(url, app),
                          input_format=input_format, version=version,
                          columns=tuple(c.strip() for c in columns.split(",")) if columns else None,
                          job_id=job_id, partitions=partitions, max_errors=max_errors, max_pending=max_pending)
        with _session(master, f"keyqueue backfill {target}", conf) as spark:
            summary = run_backfill(spark, job, task=found)
    except (KeyqueueError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    except click.ClickException:
        raise
    except Exception as e:  # Spark wraps the sink's error; show its message, not a JVM trace
        if "KeyqueueWriteError" in str(e):
            message = str(e).split("KeyqueueWriteError:", 1)[-1].split("SQLSTATE")[0].strip()
            raise click.ClickException(message) from None
        raise
    finally:
        if app is not None:
            asyncio.run(app.close())  # stops the app's embedded server if this command started it
    if app is None and not columns:
        left_out = "" if key_column in summary["arguments"] else f"; not the key column {key_column}"
        click.echo(f"arguments: {', '.join(summary['arguments']) or 'none'}{left_out} (--app MODULE:APP follows "
                   "and checks the task's signature; --columns chooses)", err=True)
    click.echo(f"{summary['rows']:,} rows: {outcome(summary)} in {time.monotonic() - started:.0f}s")
    for sample in summary["error_samples"]:
        click.echo(f"  error: {sample}", err=True)
    if summary["errors"]:
        sys.exit(0 if max_errors < 0 or summary["errors"] <= max_errors else 1)


def _app_task(app: App, name: str, queue: str | None) -> Task[Any]:
    """The app's task ``name``, checked for a backfill into ``queue`` (None: the task's queue)."""
    task = app.find_task(name)
    if isinstance(task, BatchTask):
        raise ConfigError(f"task {name} is a batch task, which takes one item per request: backfill enqueues "
                          "tasks whose arguments are the row's columns")
    if queue is not None and queue != task.queue:
        raise ConfigError(f"task {name} of app {app.name} is in queue {task.queue!r}, not {queue!r} "
                          "(leave --queue out to use the task's)")
    return task


def outcome(summary: dict[str, Any]) -> str:
    """What a backfill did, from its summary: ``9 enqueued, 1 duplicate (...)``."""
    duplicates = summary["duplicates"]
    parts = [f"{summary['accepted'] - duplicates:,} enqueued"]
    if summary["unscheduled"]:
        parts[0] += f" ({summary['unscheduled']:,} stored but not yet scheduled: the reconciler will)"
    if duplicates:
        parts.append(f"{duplicates:,} duplicate{'s' if duplicates != 1 else ''} (already enqueued under job id "
                     f"{summary['job_id']!r}: pass another --job-id to enqueue them again)")
    if summary["errors"]:
        parts.append(f"{summary['errors']:,} bad row{'s' if summary['errors'] != 1 else ''} not enqueued")
    if summary.get("waited"):
        parts.append(f"waited {summary['waited']:.1f}s for workers (--max-pending)")
    return ", ".join(parts)


def commands() -> list[click.Command]:
    """The commands this plugin adds to ``keyqueue``."""
    return [report, backfill]


@click.group()
def main() -> None:
    """keyqueue's Spark commands (also available as ``keyqueue report`` / ``keyqueue backfill``)."""


for _command in commands():
    main.add_command(_command)
