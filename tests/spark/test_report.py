"""The report: on a known history, every number equals the one computed here; the page embeds its charts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from click.testing import CliRunner

from keyqueue.events import SUPERSEDED_BY_CANCEL
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_spark.cli import report as report_command
from keyqueue_spark.report import QUANTILES, SUPERSEDED_BY_NEWER, reason_bars, run_report
from tests.spark.fixtures import history, publish_history
from tests.spark.helpers import run


def test_report_numbers_equal_direct_computation_and_page_embeds_charts(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    events = history("rebaser", requests=600)
    run(publish_history(server.url, "rebaser", events))
    exported = str(tmp_path / "events.parquet")

    page, data = run_report(spark, "rebaser", tmp_path / "report", url=server.url, save_events=exported,
                            show_progress=False)
    ev = pd.DataFrame(events)

    tasks = data.tables["tasks"].set_index("task")
    for task, group in ev.groupby("task"):
        first = group[(group.event == "started") & (group.attempt <= 1)]
        runs = group[group.event.isin(["succeeded", "dead_lettered"])]
        for q in QUANTILES:
            assert np.isclose(tasks.loc[task, f"wait_p{round(q * 100)}"], np.quantile(first.wait, q))
            assert np.isclose(tasks.loc[task, f"run_p{round(q * 100)}"], np.quantile(runs.run, q))
        assert tasks.loc[task, "wait_max"] == first.wait.max()
        for name in ("enqueued", "succeeded", "retried", "dead_lettered", "cancelled"):
            assert tasks.loc[task, name] == (group.event == name).sum(), name
        latest_superseded = (group.event == "superseded") & (group.reason != SUPERSEDED_BY_CANCEL)
        assert tasks.loc[task, "superseded"] == latest_superseded.sum()

    keys = data.tables["keys"].set_index(["task", "key"])
    hot = ev[(ev.task == "Reindex") & (ev.key == "key-3")]
    hot_first = hot[(hot.event == "started") & (hot.attempt <= 1)]
    assert keys.loc[("Reindex", "key-3"), "requests"] == (hot.event == "enqueued").sum()
    assert np.isclose(keys.loc[("Reindex", "key-3"), "wait_p90"], np.quantile(hot_first.wait, 0.9))
    top = ev[ev.event == "enqueued"].key.value_counts()
    assert data.tables["hot_keys"].iloc[0]["key"] == "key-3" == top.index[0]
    assert data.tables["hot_keys"].iloc[0]["requests"] == top.iloc[0]

    retried = ev[ev.event == "retried"].groupby(["task", "reason"]).size()
    assert {(r.task, r.reason): r.count for r in data.tables["retries"].itertuples()} == retried.to_dict()
    dead = ev[ev.event == "dead_lettered"].groupby(["task", "reason"]).size()
    assert {(r.task, r.reason): r.count for r in data.tables["dead_letters"].itertuples()} == dead.to_dict()
    # Cancels count once, as cancels; a latest task's superseded requests under one reason, not one per newer id.
    cancelled = ev[ev.event == "cancelled"].groupby(["task", "reason"]).size()
    assert {(r.task, r.reason): r.count for r in data.tables["cancelled"].itertuples()} == cancelled.to_dict()
    latest = ev[(ev.event == "superseded") & (ev.reason != SUPERSEDED_BY_CANCEL)].groupby("task").size()
    assert {(r.task, r.reason): r.count for r in data.tables["superseded"].itertuples()} == {
        (task, SUPERSEDED_BY_NEWER): n for task, n in latest.items()}
    assert data.summary["cancelled"] == len(ev[ev.event == "cancelled"]) == 24
    assert data.summary["superseded"] == latest.sum() == 24
    bars = dict(reason_bars(data))
    assert bars["cancelled: cancelled before it started"] == 24
    assert bars[f"superseded: {SUPERSEDED_BY_NEWER}"] == 24
    assert not [label for label in bars if label.startswith("superseded: superseded by")]

    flows = ev[ev.event.str.startswith("workflow_")]
    began = flows[flows.event == "workflow_started"].groupby("run_id").ts.min()
    ended = flows[flows.event == "workflow_done"].groupby("run_id").ts.max()
    took = (ended - began.loc[ended.index]).to_numpy()
    assert data.tables["workflows"].iloc[0]["done"] == len(took) == 17
    assert np.isclose(data.tables["workflows"].iloc[0]["took_p90"], np.quantile(took, 0.9))
    assert {(r.task, r.reason): r.count for r in data.tables["workflow_failures"].itertuples()} == {
        ("Rebase", "max-attempts: ValueError: boom"): 3}
    assert data.summary["workflows"] == {"started": 20, "done": 17, "failed": 3, "resumed": 1, "cancelled": 1}

    dvu = ev[ev.event == "dvu_finished"]
    assert data.summary["dvu_runs"] == len(dvu) == 30
    assert data.summary["coalescing_ratio"] == dvu.triggers.sum() / len(dvu) == 3.0
    assert np.isclose(data.tables["dvu"].iloc[0]["run_p50"], np.quantile(dvu.run, 0.5))
    assert data.summary["events"] == len(ev)
    assert data.summary["keys"] == ev.key.nunique()
    assert int(data.tables["throughput"]["succeeded"].sum()) == (ev.event == "succeeded").sum()

    text = page.read_text()
    charts = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(charts) == 5 and all(len(png) > 5000 for _, png in charts)
    assert "src='http" not in text and "<script" not in text  # self-contained
    assert "superseded: superseded by" not in text and "(cancelled)" not in text
    for table in ("tasks", "keys", "hot_keys", "throughput", "retries", "dead_letters", "superseded", "cancelled",
                  "dvu"):
        assert (tmp_path / "report" / "aggregates" / f"{table}.parquet").is_file()

    # The CLI over the exported Parquet (no server) reaches the same numbers.
    out = tmp_path / "from-parquet"
    result = CliRunner().invoke(report_command, ["rebaser", "--events-from", exported, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "30 runs, 3.00 triggers per run" in result.output
    again = pd.read_parquet(out / "aggregates" / "tasks.parquet").set_index("task")
    pd.testing.assert_frame_equal(again.sort_index(), tasks.sort_index(), check_dtype=False)
