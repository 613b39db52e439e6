"""Wait times come from the stored message, whatever the request id (a caller's own, a digest).

A request's wait is measured from the server's timestamp of its inbox message, not from its id:
the ids here are a caller's own (the idempotency practice) and a Spark backfill's (sha256 digests
written as ULID-shaped strings). The events stream (what ``keyqueue report`` and the dashboard
read), the dashboard's own wait figures and the Prometheus histogram must agree, and each wait
must be what the test saw: at least the pause before the worker started, at most the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

import keyqueue
from keyqueue.dashboard.state import Monitor
from keyqueue.events import decode_events
from keyqueue.metrics.prometheus import PrometheusPlugin

PAUSE = 0.5
"""Seconds the requests wait, stored, before a worker starts (the wait the figures must show)."""


def backfill_id(n: int) -> str:
    """A request id as the Spark sink derives it (sha256 of the job, task, key and row, ULID-shaped)."""
    from keyqueue_spark.sink import derive_request_id

    return derive_request_id("job-7", "work", 1, f"b{n}", str(n).encode())


async def test_waits_agree_for_caller_chosen_and_backfilled_ids(nats_url: str, tmp_path: Path) -> None:
    prometheus = PrometheusPlugin()
    app = keyqueue.App("timings", url=nats_url, set_as_default=False, autoload_plugins=False, plugins=[prometheus])

    @app.task(key="{k}")
    async def work(k: str) -> str:
        return k

    ids = [f"order-{n}" for n in range(5)] + [backfill_id(n) for n in range(5)]
    assert all(len(i) == 26 for i in ids[5:])  # what the old ULID-based reading misread
    nc = await app.connection()
    events: list[dict[str, object]] = []

    all_started = asyncio.Event()
    dashboard_saw_all = asyncio.Event()

    async def on_event(msg: object) -> None:
        # A key's events travel together (one KeyqueueEventBatch when its session gives it back).
        events.extend(e for e in decode_events(msg.headers, msg.data)  # type: ignore[attr-defined]
                      if e["event"] == "started")
        if len(events) == len(ids):
            all_started.set()

    sub = await nc.subscribe("kq.timings.events.>", cb=on_event)
    dashboard = Monitor(nc, queues=["timings"], refresh=0.2)
    # The dashboard tells its listeners after each refresh: by then it has read the events that came.
    dashboard.listeners.append(lambda _: dashboard.waits["timings"].count() == len(ids) and dashboard_saw_all.set())
    watching = asyncio.create_task(dashboard.run())
    try:
        began = time.time()
        for n, request_id in enumerate(ids):
            await work.options(request_id=request_id).enqueue(k=f"k{n}")
        stored = time.time()
        await asyncio.sleep(PAUSE)  # the requests wait, stored, with no worker
        async with app.worker():
            async with asyncio.timeout(20):  # the events arrive as the requests start
                await all_started.wait()
                await dashboard_saw_all.wait()
        ended = time.time()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await sub.unsubscribe()
        await app.close()

    waits = {str(e["request_id"]): e["wait"] for e in events}
    assert set(waits) == set(ids)  # every request has a wait, caller-chosen and backfilled ids alike
    for request_id, wait in waits.items():
        assert isinstance(wait, float), (request_id, wait)
        assert PAUSE - 0.05 <= wait <= ended - began + 0.05, (request_id, wait)
    sample = {s.name: s.value for m in prometheus.registry.collect() for s in m.samples
              if s.name.startswith("keyqueue_request_wait_seconds") and not s.name.endswith("_bucket")}
    assert sample["keyqueue_request_wait_seconds_count"] == len(ids)
    assert sample["keyqueue_request_wait_seconds_sum"] == pytest.approx(sum(waits.values()), abs=0.05 * len(ids))
    seen = dashboard.waits["timings"]
    assert seen.count() == len(ids)
    top = seen.quantile(1.0)
    assert top is not None and PAUSE - 0.05 <= top <= ended - stored + 0.1
