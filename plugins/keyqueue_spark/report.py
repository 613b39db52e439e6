"""``keyqueue report``: what a queue did, computed with Spark from its lifecycle events.

:func:`compute` turns an events DataFrame (read live with the ``keyqueue`` source, or from an
exported Parquet) into small aggregate tables; :func:`write_report` renders them as one
self-contained HTML file (charts are PNGs embedded as base64) plus a Parquet file per table.

Definitions (docs/spark.md repeats them):

* wait: the ``wait`` of ``started`` events of first attempts (``attempt`` null or 1): time
  from enqueue to the handler's first start. Quantiles are exact (Spark's ``percentile``,
  linear interpolation, as ``numpy.quantile``).
* run: the ``run`` of ``succeeded`` and ``dead_lettered`` events (handler time).
* requests of a key: its ``enqueued`` events, or its first-attempt ``started`` events when the
  stream has no ``enqueued`` events.
* coalescing ratio: sum of ``triggers`` over ``dvu_finished`` events / number of them, i.e.
  requests (or signals) covered per DVU run. The DVU step, table and chart are there only when
  the events hold DVU events (the Rebaser's, :data:`DVU_EVENTS`).
* tasks: events without a task (key events such as ``acquired``, a plugin's steps, a request
  with an empty ``X-MESSAGE-TYPE``) count in the summary but are not listed as a task.
* throughput: buckets with none of its events are left out of the table, and are gaps in the
  chart (not lines drawn across them).
* superseded and cancelled: a request cancelled before it started has a ``cancelled`` event and
  then a ``superseded`` event (reason :data:`keyqueue.events.SUPERSEDED_BY_CANCEL`): it counts
  once, as cancelled. A ``latest`` task's superseded requests (reason ``superseded by <id>``)
  are grouped under one reason, :data:`SUPERSEDED_BY_NEWER`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from keyqueue.events import SUPERSEDED_BY_CANCEL

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame

OUTCOMES: Final = ("enqueued", "succeeded", "retried", "dead_lettered", "superseded", "cancelled")
"""The per-task counts of the ``tasks`` table, one column per event."""

REASON_TABLES: Final = (("retries", "retried"), ("dead_letters", "dead_lettered"), ("superseded", "superseded"),
                        ("cancelled", "cancelled"))
"""The per-task-and-reason tables: (table, event)."""

QUANTILES: Final = (0.5, 0.9, 0.99)
"""The quantiles reported for wait and run times."""

BUCKETS: Final = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
"""Candidate widths, in seconds, of the throughput chart's time buckets."""

MAX_BUCKETS: Final = 120

SUPERSEDED_BY_NEWER: Final = "by a newer request (latest)"
"""The reason the report gives every ``superseded by <request id>`` event (one per newer request)."""

DVU_EVENTS: Final = ("dvu_started", "dvu_finished")
"""The Rebaser's DVU events (names it registers with ``keyqueue.events``), read here by name."""


class Progress:
    """Numbered step lines on stderr with each step's duration: ``[2/7] wait and run times ... 1.3s``."""

    def __init__(self, steps: int, *, out: Any = None, enabled: bool = True) -> None:
        self.steps, self.step, self.enabled = steps, 0, enabled
        self.out = out if out is not None else sys.stderr

    @contextmanager
    def __call__(self, what: str) -> Iterator[Callable[[str], None]]:
        self.step += 1
        started = time.monotonic()
        notes: list[str] = []
        if self.enabled:
            print(f"[{self.step}/{self.steps}] {what} ...", file=self.out, flush=True)
        yield notes.append
        if self.enabled:
            extra = f" ({'; '.join(notes)})" if notes else ""
            print(f"[{self.step}/{self.steps}] {what}: done in {time.monotonic() - started:.1f}s{extra}",
                  file=self.out, flush=True)

    def skip(self) -> None:
        """A planned step will not run (nothing to do): later lines count one step fewer."""
        self.steps -= 1


@dataclass
class ReportData:
    """The aggregates of one report: small pandas tables and a summary."""

    queue: str
    summary: dict[str, Any]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


def pick_bucket(span: float) -> int:
    """The narrowest bucket width in :data:`BUCKETS` giving at most :data:`MAX_BUCKETS` buckets."""
    for width in BUCKETS:
        if span / width <= MAX_BUCKETS:
            return width
    return BUCKETS[-1]


def _quantile_columns(column: str, prefix: str) -> list[Column]:
    from pyspark.sql import functions as F

    values = ", ".join(str(q) for q in QUANTILES)
    exact = F.expr(f"percentile({column}, array({values}))")
    columns = [exact[i].alias(f"{prefix}_p{round(q * 100)}") for i, q in enumerate(QUANTILES)]
    return [*columns, F.max(column).alias(f"{prefix}_max"), F.avg(column).alias(f"{prefix}_mean")]


def compute(events: DataFrame, *, queue: str = "", top: int = 20, bucket: float | None = None,
            progress: Progress | None = None) -> ReportData:
    """The report's aggregates from an events DataFrame (columns of keyqueue.events.EVENT_FIELDS)."""
    from pyspark.sql import functions as F

    step = progress or Progress(7, enabled=False)
    ev = events.select("event", "ts", "queue", "key", "task", "attempt", "wait", "run", "reason", "triggers",
                       "run_id")
    # An empty X-MESSAGE-TYPE is no task either: neither is listed as one.
    ev = ev.withColumn("task", F.when(F.col("task") != "", F.col("task")))
    of_cancel = F.coalesce((F.col("event") == "superseded") & (F.col("reason") == SUPERSEDED_BY_CANCEL), F.lit(False))
    with step("reading events") as note:
        ev = ev.cache()
        counted = ev.groupBy("event", of_cancel.alias("of_cancel")).count().collect()
        counts: dict[str, int] = {}
        for r in counted:
            counts[r["event"]] = counts.get(r["event"], 0) + int(r["count"])
        cancels_superseded = sum(int(r["count"]) for r in counted if r["of_cancel"])
        total = sum(counts.values())
        note(f"{total:,} events")
    # A cancelled request's superseded event repeats its cancelled event: count it once, as a cancel.
    outcome_events = ev.filter(~of_cancel).withColumn(
        "reason", F.when((F.col("event") == "superseded") & F.col("reason").startswith("superseded by "),
                         F.lit(SUPERSEDED_BY_NEWER)).otherwise(F.col("reason")))
    has_dvu = any(counts.get(name, 0) for name in DVU_EVENTS)
    first_attempt = (F.col("event") == "started") & (F.col("attempt").isNull() | (F.col("attempt") <= 1))
    tasked = outcome_events.filter(F.col("task").isNotNull())
    data = ReportData(queue=queue, summary={})

    with step("wait and run times per task"):
        waits = (tasked.filter(first_attempt & F.col("wait").isNotNull()).groupBy("task")
                 .agg(F.count("*").alias("started"), *_quantile_columns("wait", "wait")))
        runs = (tasked.filter(F.col("event").isin("succeeded", "dead_lettered") & F.col("run").isNotNull())
                .groupBy("task").agg(F.count("*").alias("finished"), *_quantile_columns("run", "run")))
        outcomes = (tasked.groupBy("task").pivot(
            "event", list(OUTCOMES)).count().na.fill(0))
        tasks = outcomes.join(waits, "task", "full").join(runs, "task", "full").orderBy("task")
        data.tables["tasks"] = _local(tasks)

    with step("per key: requests, wait and run times, hottest keys") as note:
        has_enqueued = counts.get("enqueued", 0) > 0
        request_event = F.col("event") == "enqueued" if has_enqueued else first_attempt
        keyed = tasked.filter(F.col("key").isNotNull())
        per_key = keyed.groupBy("task", "key").agg(
            F.sum(request_event.cast("int")).alias("requests"),
            F.sum((F.col("event") == "retried").cast("int")).alias("retried"),
            F.sum((F.col("event") == "dead_lettered").cast("int")).alias("dead_lettered"),
            F.sum(F.when(F.col("event").isin("succeeded", "dead_lettered"), F.col("run"))).alias("run_total"),
        )
        key_waits = (keyed.filter(first_attempt & F.col("wait").isNotNull()).groupBy("task", "key")
                     .agg(*_quantile_columns("wait", "wait")))
        key_runs = (keyed.filter(F.col("event").isin("succeeded", "dead_lettered") & F.col("run").isNotNull())
                    .groupBy("task", "key").agg(*_quantile_columns("run", "run")))
        keys = per_key.join(key_waits, ["task", "key"], "left").join(key_runs, ["task", "key"], "left")
        keys = keys.orderBy(F.desc("requests"), "task", "key").cache()
        data.tables["keys"] = _local(keys)
        hot = (keyed.filter(request_event).groupBy("key").count().withColumnRenamed("count", "requests")
               .orderBy(F.desc("requests"), "key").limit(top))
        data.tables["hot_keys"] = _local(hot)
        note(f"{len(data.tables['keys']):,} task/key pairs")

    with step("throughput over time") as note:
        span_row = ev.agg(F.min("ts").alias("lo"), F.max("ts").alias("hi")).collect()[0]
        lo, hi = span_row["lo"], span_row["hi"]
        width = bucket or pick_bucket((hi - lo) if lo is not None else 0.0)
        series = (ev.filter(F.col("event").isin("enqueued", "succeeded", "dead_lettered"))
                  .withColumn("bucket", F.floor(F.col("ts") / width) * width)
                  .groupBy("bucket").pivot("event", ["enqueued", "succeeded", "dead_lettered"]).count()
                  .na.fill(0).orderBy("bucket"))
        data.tables["throughput"] = _local(series)
        note(f"{width}s buckets")

    with step("retries, dead letters, superseded, cancelled"):
        for name, event in REASON_TABLES:
            table = (tasked.filter(F.col("event") == event).groupBy("task", "reason").count()
                     .orderBy(F.desc("count"), "task", "reason"))
            data.tables[name] = _local(table)

    dvu_runs = triggers = 0
    if has_dvu:
        with step("DVU coalescing"):
            finished = ev.filter(F.col("event") == "dvu_finished")
            dvu = finished.agg(F.count("*").alias("runs"), F.sum("triggers").alias("triggers"),
                               *_quantile_columns("run", "run"))
            data.tables["dvu"] = _local(dvu)
            histogram = finished.groupBy("triggers").count().withColumnRenamed("count", "runs").orderBy("triggers")
            data.tables["dvu_triggers"] = _local(histogram)
        dvu_row = data.tables["dvu"].iloc[0]
        dvu_runs = int(dvu_row["runs"])
        triggers = int(dvu_row["triggers"]) if dvu_runs and not _missing(dvu_row["triggers"]) else 0
    else:
        step.skip()
    if any(name.startswith("workflow_") for name in counts):
        with step("workflows"):
            flows = ev.filter(F.col("event").startswith("workflow_") & F.col("run_id").isNotNull())
            began = (flows.filter(F.col("event") == "workflow_started").groupBy("run_id")
                     .agg(F.min("ts").alias("began")))
            ended = flows.filter(F.col("event") == "workflow_done").groupBy("run_id").agg(F.max("ts").alias("ended"))
            took = began.join(ended, "run_id").select((F.col("ended") - F.col("began")).alias("took"))
            data.tables["workflows"] = _local(took.agg(F.count("*").alias("done"), *_quantile_columns("took", "took")))
            failures = (flows.filter(F.col("event") == "workflow_failed").groupBy("task", "reason").count()
                        .orderBy(F.desc("count"), "task", "reason"))
            data.tables["workflow_failures"] = _local(failures)
    else:
        step.skip()
    data.summary = {
        "queue": queue,
        "events": total,
        "event_counts": dict(sorted(counts.items())),
        "superseded": counts.get("superseded", 0) - cancels_superseded,
        "cancelled": counts.get("cancelled", 0),
        "first_ts": lo,
        "last_ts": hi,
        "span_seconds": (hi - lo) if lo is not None else 0.0,
        "keys": int(ev.filter(F.col("key").isNotNull()).select("key").distinct().count()),
        "tasks": sorted(data.tables["tasks"]["task"].tolist()),
        "dvu": has_dvu,
        "dvu_runs": dvu_runs,
        "dvu_triggers": triggers,
        "coalescing_ratio": (triggers / dvu_runs) if dvu_runs else None,
        "bucket_seconds": width,
        "workflows": {change: counts.get(f"workflow_{change}", 0)
                      for change in ("started", "done", "failed", "resumed", "cancelled")},
    }
    ev.unpersist()
    keys.unpersist()
    return data


def _local(frame: DataFrame) -> pd.DataFrame:
    """A small aggregate as pandas, without the ``attrs`` Spark Connect attaches (its plan metrics,
    which pandas cannot write to Parquet)."""
    import pandas as pd

    table = frame.toPandas()
    assert isinstance(table, pd.DataFrame)
    table.attrs = {}
    return table


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


# --- rendering ---------------------------------------------------------------------------------------


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def with_gaps(series: pd.DataFrame, width: float) -> pd.DataFrame:
    """``series`` (a ``bucket`` column, ascending) with a row of NaN after each bucket whose next
    bucket is missing, so that a line chart breaks there instead of drawing across the gap."""
    buckets = series["bucket"].astype(float).tolist()
    present = set(buckets)
    ends = [b + width for b in buckets[:-1] if b + width not in present]
    if not ends:
        return series
    timeline = series.astype({"bucket": float}).set_index("bucket")
    return timeline.reindex(sorted(present | set(ends))).reset_index()


REASON_LABELS: Final = {"retries": "retry", "dead_letters": "DLQ", "superseded": "superseded", "cancelled": "cancelled"}
"""How the reasons chart labels each table's reasons: ``DLQ: rejected``, ``cancelled: ...``."""


def reason_bars(data: ReportData, top: int = 15) -> list[tuple[str, int]]:
    """The reasons chart's bars, most events first: (``<what>: <reason>``, events), summed over tasks."""
    bars: dict[str, int] = {}
    for table, what in REASON_LABELS.items():
        for row in data.tables[table].itertuples():
            label = f"{what}: {row.reason}"
            bars[label] = bars.get(label, 0) + int(row.count)
    return sorted(bars.items(), key=lambda bar: (-bar[1], bar[0]))[:top]


def charts(data: ReportData) -> dict[str, str]:
    """Each chart's title and its PNG, base64-encoded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    t = data.tables

    series = t["throughput"]
    if len(series):
        fig, ax = plt.subplots(figsize=(9, 3.2))
        width = float(data.summary["bucket_seconds"])
        points = with_gaps(series, width)
        times = [datetime.fromtimestamp(b, UTC) for b in points["bucket"]]
        for column, label in (("enqueued", "enqueued"), ("succeeded", "succeeded"), ("dead_lettered", "dead-lettered")):
            if column in series and series[column].sum() > 0:
                rate = points[column] / width
                # Markers: a bucket between two gaps is a point, not a line.
                ax.plot(times, rate, label=label, marker=".", markersize=6 if len(series) < 30 else 2)  # type: ignore[arg-type]
        ax.set_ylabel("requests / s")
        ax.set_title(f"Throughput ({width:g}s buckets, UTC)")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
        fig.autofmt_xdate()
        out["Throughput over time"] = _png(fig)

    tasks = t["tasks"]
    if len(tasks):
        fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 + 0.6 * max(2, len(tasks))))
        names = [str(n) for n in tasks["task"]]
        for ax, prefix, title in ((axes[0], "wait", "Wait (enqueue to start)"), (axes[1], "run", "Run time")):
            height = 0.8 / len(QUANTILES)
            for i, q in enumerate(QUANTILES):
                column = f"{prefix}_p{round(q * 100)}"
                values = tasks[column].fillna(0).astype(float) if column in tasks else [0.0] * len(names)
                positions = [j + i * height for j in range(len(names))]
                ax.barh(positions, values, height=height, label=f"p{round(q * 100)}")
            ax.set_yticks([j + height for j in range(len(names))], names)
            ax.set_xlabel("seconds")
            ax.set_title(title)
            ax.grid(axis="x", alpha=0.3)
        axes[1].legend(loc="lower right")
        out["Wait and run time per task"] = _png(fig)

    hot = t["hot_keys"]
    if len(hot):
        fig, ax = plt.subplots(figsize=(9, 0.6 + 0.28 * len(hot)))
        ax.barh([str(k) for k in hot["key"]][::-1], list(hot["requests"])[::-1], color="#c0504d")
        ax.set_xlabel("requests")
        ax.set_title(f"Hottest {len(hot)} keys")
        ax.grid(axis="x", alpha=0.3)
        out["Hottest keys"] = _png(fig)

    failures = reason_bars(data)
    if failures:
        fig, ax = plt.subplots(figsize=(9, 0.6 + 0.32 * len(failures)))
        ax.barh([label[:60] for label, _ in failures][::-1], [int(c) for _, c in failures][::-1], color="#8064a2")
        ax.set_xlabel("events")
        ax.set_title("Retries, dead letters, superseded and cancelled requests by reason")
        ax.grid(axis="x", alpha=0.3)
        out["Retries, DLQ, superseded and cancelled"] = _png(fig)

    histogram = t.get("dvu_triggers")
    if histogram is not None and len(histogram):
        fig, ax = plt.subplots(figsize=(9, 3))
        ax.bar([int(x) if not _missing(x) else 0 for x in histogram["triggers"]], histogram["runs"], color="#4f81bd")
        ratio = data.summary.get("coalescing_ratio")
        ax.set_xlabel("triggers covered by one DVU run")
        ax.set_ylabel("DVU runs")
        ax.set_title(f"DVU coalescing: {ratio:.2f} triggers per run" if ratio else "DVU coalescing")
        ax.grid(axis="y", alpha=0.3)
        out["DVU coalescing"] = _png(fig)
    return out


_STYLE: Final = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:.2em} .sub{color:#666;margin-top:0}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:1em 0}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 16px;min-width:140px}
.card b{display:block;font-size:1.5em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0 1.5em}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
"""


def _table(frame: pd.DataFrame, limit: int = 25) -> str:
    if frame is None or not len(frame):
        return "<p><i>none</i></p>"
    shown = frame.head(limit)
    return str(shown.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}", border=0))


def render_html(data: ReportData, images: dict[str, str]) -> str:
    """The report page: summary cards, charts, and the top rows of each table."""
    s = data.summary
    fmt_time = (lambda ts: datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")) if s["first_ts"] else str
    ratio = s.get("coalescing_ratio")
    cards = [
        ("events", f"{s['events']:,}"),
        ("keys", f"{s['keys']:,}"),
        ("succeeded", f"{s['event_counts'].get('succeeded', 0):,}"),
        ("retried", f"{s['event_counts'].get('retried', 0):,}"),
        ("dead-lettered", f"{s['event_counts'].get('dead_lettered', 0):,}"),
        ("superseded", f"{s['superseded']:,}"),
        ("cancelled", f"{s['cancelled']:,}"),
    ]
    if s["dvu"]:
        cards += [("DVU runs", f"{s['dvu_runs']:,}"), ("triggers per DVU run", f"{ratio:.2f}" if ratio else "-")]
    flows = s.get("workflows") or {}
    if flows.get("started"):
        cards += [("workflows done", f"{flows['done']:,} of {flows['started']:,}"),
                  ("workflow steps failed", f"{flows['failed']:,}")]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>keyqueue report: {html.escape(data.queue)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>keyqueue report: {html.escape(data.queue)}</h1>",
        f"<p class='sub'>{s['events']:,} events from {fmt_time(s['first_ts'])} to {fmt_time(s['last_ts'])} "
        f"({s['span_seconds']:.1f}s); generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>",
        "<div class='cards'>" + "".join(f"<div class='card'><b>{v}</b>{html.escape(k)}</div>" for k, v in cards)
        + "</div>",
    ]
    for title, png in images.items():
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
    sections = (("Per task", "tasks"), ("Hottest keys: requests, wait and run times", "keys"),
                ("Retries by reason", "retries"), ("Dead letters by reason", "dead_letters"),
                ("Superseded", "superseded"), ("Cancelled", "cancelled"), ("DVU runs", "dvu"),
                ("Workflows: seconds from start to result", "workflows"),
                ("Workflows stopped: the failed step's task and why", "workflow_failures"))
    for title, name in sections:
        if name not in data.tables:
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>{_table(data.tables[name])}")
    parts.append("<p class='sub'>Wait: first attempts' enqueue-to-start time. Run: handler time of succeeded and "
                 "dead-lettered requests. Quantiles are exact. Aggregates are also in the Parquet files next to "
                 "this page.</p></body></html>")
    return "\n".join(parts)


def write_report(data: ReportData, out_dir: Path, progress: Progress | None = None) -> Path:
    """Write ``report.html``, ``summary.json`` and ``aggregates/<table>.parquet`` into ``out_dir``."""
    step = progress or Progress(2, enabled=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    with step("charts and HTML") as note:
        images = charts(data)
        page = out_dir / "report.html"
        page.write_text(render_html(data, images))
        note(f"{len(images)} charts, {page}")
    with step("Parquet copy of the aggregates") as note:
        tables = out_dir / "aggregates"
        tables.mkdir(exist_ok=True)
        for name, frame in data.tables.items():
            frame.to_parquet(tables / f"{name}.parquet", index=False)
        (out_dir / "summary.json").write_text(json.dumps(data.summary, indent=2, default=str))
        note(f"{len(data.tables)} tables in {tables}")
    return page


def load_events(spark: Any, queue: str, *, url: str | None = None, events_from: str | None = None) -> DataFrame:
    """The events to report on: the live stream of ``queue``, or an exported Parquet."""
    if events_from:
        exported: DataFrame = spark.read.parquet(events_from)
        return exported
    reader = spark.read.format("keyqueue").option("queue", queue).option("stream", "events")
    if url:
        reader = reader.option("url", url)
    live: DataFrame = reader.load()
    return live


def run_report(spark: Any, queue: str, out_dir: Path, *, url: str | None = None, events_from: str | None = None,
               save_events: str | None = None, top: int = 20, bucket: float | None = None,
               show_progress: bool = True) -> tuple[Path, ReportData]:
    """The whole job: read, aggregate, render. Returns the HTML page's path and the aggregates."""
    progress = Progress(9 + bool(save_events), enabled=show_progress)
    events = load_events(spark, queue, url=url, events_from=events_from)
    if save_events:
        with progress("exporting the events to Parquet") as note:
            events.write.mode("overwrite").parquet(save_events)
            note(save_events)
        events = spark.read.parquet(save_events)
    data = compute(events, queue=queue, top=top, bucket=bucket, progress=progress)
    return write_report(data, out_dir, progress), data
