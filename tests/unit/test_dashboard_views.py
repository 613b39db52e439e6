"""What the dashboard derives without a server: wait/run percentiles and their charts, a key's
head-request attempts from its events, a worker's priority-group role."""

from __future__ import annotations

import math
from typing import Any

import pytest

from keyqueue.dashboard.charts import duration, latency_chart
from keyqueue.dashboard.latency import RATIO, Latencies
from keyqueue.dashboard.state import Monitor
from keyqueue.dashboard.web import role_text
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_percentiles_are_within_a_bin_of_the_exact_ones() -> None:
    clock = Clock()
    times = Latencies(clock=clock)
    values = [i / 1000 for i in range(1, 1001)]  # 1 ms .. 1 s
    for v in values:
        times.add(v)
    for q, exact in ((0.5, 0.5), (0.99, 0.99)):
        got = times.quantile(q)
        assert got is not None and abs(math.log(got / exact)) <= math.log(RATIO), (q, got)
    assert times.count() == 1000


def test_old_times_leave_the_figures_then_the_window() -> None:
    clock = Clock()
    times = Latencies(clock=clock, bucket=10, window=300)
    times.add(5.0)
    clock.now += 61
    assert times.quantile(0.5, over=60) is None, "older than the figures' minute"
    series = times.series(0.5)
    assert len(series) == 30 and series[-1] is None and sum(v is not None for v in series) == 1
    clock.now += 300
    assert all(v is None for v in times.series(0.99))
    times.add(math.nan)
    times.add(-1.0)
    assert times.count() == 0


def test_latency_chart_draws_both_lines_and_breaks_at_gaps() -> None:
    assert latency_chart([None, None], [None, None], what="wait", span="x") == ""
    svg = latency_chart([0.1, 0.2, None, 0.1, 0.1], [0.3, 0.4, None, 0.2, 0.5], what="wait", span="last 5 minutes")
    assert svg.startswith("<svg") and svg.count('class="p99"') == 2 and svg.count('class="p50"') == 2
    assert ">500 ms</text>" in svg  # the scale's top: the highest p99
    assert [duration(v) for v in (None, 0.00042, 0.0124, 1.25, 185)] == ["-", "420 µs", "12.4 ms", "1.25 s", "3m05s"]


async def _event(monitor: Monitor, name: str, **fields: Any) -> None:
    body = {"event": name, "ts": 1.0, "queue": "shop", "key": "k", "request_id": "r1", "task": "ship", **fields}

    class Msg:
        data = dumps(body, CBOR)
        headers = {H.CONTENT_TYPE: CBOR}

    await monitor._on_event(Msg())  # type: ignore[arg-type]


async def test_the_head_request_is_failing_from_its_first_retry_until_it_finishes() -> None:
    monitor = Monitor(None, queues=None)  # type: ignore[arg-type]  # fed events by hand
    assert monitor.head_attempt("shop", "k") is None
    await _event(monitor, "started", attempt=1, wait=0.25)
    head = monitor.head_attempt("shop", "k")
    assert head is not None and (head.attempt, head.failing) == (1, False)
    await _event(monitor, "retried", attempt=1, reason="ConnectionError: down")
    await _event(monitor, "started", attempt=2, wait=1.5)
    head = monitor.head_attempt("shop", "k")
    assert head is not None and (head.attempt, head.failing, head.error) == (2, True, "ConnectionError: down")
    await _event(monitor, "succeeded", run=0.5)
    assert monitor.head_attempt("shop", "k") is None
    assert monitor.waits["shop"].count() == 2 and monitor.runs["shop"].count() == 1


@pytest.mark.parametrize(("role", "text"), [
    ({}, "-"), ({"policy": "none"}, "none"), ({"policy": "pinned_client", "pinned": True}, "pinned"),
    ({"policy": "pinned_client", "pinned": False}, "standby (unpinned)"),
    ({"policy": "prioritized", "priority": 3}, "priority 3"),
    ({"policy": "overflow", "min_pending": 50, "min_ack_pending": 0}, "overflow from 50 waiting"),
    ({"policy": "overflow", "min_pending": 0, "min_ack_pending": 0}, "overflow primary"),
])
def test_role_text(role: dict[str, Any], text: str) -> None:
    assert role_text(role) == text


def test_the_keys_pages_counts_come_from_the_read_its_rows_come_from() -> None:
    """The live counts are refreshed more often than every key is read: a page that mixed them said
    "0 waiting" above 8 rows marked waiting."""
    from starlette.testclient import TestClient

    from keyqueue.admin.inspection import KeyState, QueueReport
    from keyqueue.dashboard.state import QueueView
    from keyqueue.dashboard.web import create_app

    keys = [KeyState(f"o{n}", 1, "scheduled") for n in range(8)]
    # Counts read after the keys: by then a worker took every waiting key.
    report = QueueReport("shop", keys, requests=8, keys_with_backlog=0, keys_held=8, pending_tokens=0, dlq_size=0,
                         consumer={}, workers={}, keys_total=8)
    monitor = Monitor(None, queues=["shop"])  # type: ignore[arg-type]  # fed a snapshot by hand
    monitor.snapshot.queues["shop"] = QueueView(report, [], keys_read=1000.0)
    page = TestClient(create_app(monitor), base_url="http://127.0.0.1").get("/queues/shop/keys").text
    assert 'data-testid="key-counts">8 key(s) with backlog, 0 held, 8 waiting; 8 match' in page
    assert page.count('<tr data-key="o') == page.count('" class="waiting">') == 8
