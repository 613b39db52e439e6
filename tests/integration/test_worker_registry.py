"""The live worker registry (heartbeat records) and a worker's Prometheus ``/metrics``, against a
real nats-server: what ``keyqueue inspect`` and the dashboard read."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from command_output import Command

import keyqueue
from keyqueue.admin.workers import queue_workers
from keyqueue.jetstream.api import JetStreamApi

ROOT = Path(__file__).resolve().parents[2]
KEYQUEUE = Path(sys.executable).with_name("keyqueue")


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{k}")
    async def touch(k: str) -> None:
        pass

    try:
        yield app
    finally:
        await app.close()


async def test_a_worker_is_live_while_it_runs_and_says_when_it_stopped(app: keyqueue.App) -> None:
    api = JetStreamApi(await app.connection())
    worker = app.worker(name="w-reg", concurrency=3)
    worker.heartbeat_interval = 0.2
    async with worker:
        [state] = await queue_workers(api, "shop")
        assert (state.name, state.live, state.record.slots, state.record.queues) == ("w-reg", True, 3, ["shop"])
        assert state.record.pid == os.getpid() and state.record.host == socket.gethostname()
        assert worker.heartbeat is not None
        worker.heartbeat.wrote.clear()
        await asyncio.wait_for(worker.heartbeat.wrote.wait(), 10)  # the next record, on the worker's own schedule
        [again] = await queue_workers(api, "shop")
        assert again.received > state.received
    [state] = await queue_workers(api, "shop")
    assert (state.live, state.gone_because, state.record.state) == (False, "stopped", "stopped")


async def test_a_silent_worker_is_gone_after_three_intervals(app: keyqueue.App) -> None:
    api = JetStreamApi(await app.connection())
    worker = app.worker(name="w-silent")
    worker.heartbeat_interval = 1.0
    async with worker:
        [state] = await queue_workers(api, "shop")
        # Seen from a moment past three intervals after its last record, as if it had died then.
        [later] = await queue_workers(api, "shop", now=state.received + 3.5)
    assert state.live and not later.live and later.gone_because == "silent"


async def test_a_record_says_the_workers_part_in_the_priority_group(nats_url: str) -> None:
    app = keyqueue.App("standby", url=nats_url, set_as_default=False, autoload_plugins=False)
    app.configure_queue(keyqueue.QueueConfig("pinq", priority_policy="pinned_client"))

    @app.task(queue="pinq", key="{k}")
    async def touch(k: str) -> None:
        pass

    api = JetStreamApi(await app.connection())
    first, second = app.worker(name="w-first"), app.worker(name="w-second")
    for worker in (first, second):
        worker.heartbeat_interval = 0.2
    try:
        async with first:
            await touch.call(k="k1", timeout=30)  # served by w-first, the only worker: it is pinned
            async with second:
                async def roles() -> dict[str, dict[str, object]]:
                    return {w.name: w.record.role for w in await queue_workers(api, "pinq") if w.live}

                expected = {"w-first": {"policy": "pinned_client", "group": "workers", "pinned": True},
                            "w-second": {"policy": "pinned_client", "group": "workers", "pinned": False}}
                async with asyncio.timeout(20):
                    while await roles() != expected:  # as of the next records
                        beats = [w.heartbeat for w in (first, second) if w.heartbeat is not None]
                        for beat in beats:
                            beat.wrote.clear()
                        await asyncio.gather(*(beat.wrote.wait() for beat in beats))
    finally:
        await app.close()


async def test_a_queue_without_a_priority_policy_records_none(app: keyqueue.App) -> None:
    api = JetStreamApi(await app.connection())
    worker = app.worker(name="w-none")
    worker.heartbeat_interval = 0.2
    async with worker:
        [state] = await queue_workers(api, "shop")
    assert state.record.role == {"policy": "none"}


async def test_a_worker_without_heartbeats_writes_none(app: keyqueue.App) -> None:
    api = JetStreamApi(await app.connection())
    worker = app.worker(name="w-quiet")
    worker.heartbeat_interval = 0
    async with worker:
        assert await queue_workers(api, "shop") == []


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (checked once; tests only)."""
    for first in range(20000 + os.getpid() % 20000, 60000, 7):
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


async def test_worker_metrics_port_serves_prometheus_text_with_the_otel_names(nats_url: str) -> None:
    port = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")} | {"KEYQUEUE_URL": nats_url}
    worker = await Command.start(str(KEYQUEUE), "worker", "tests.browser.dashboard_app:app", "--metrics-port",
                                 str(port), env=env, cwd=ROOT)
    app = keyqueue.App("dash", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(queue="shop", key="{order_id}")
    async def touch(order_id: str) -> None:
        pass

    try:
        await worker.wait_for(rf"metrics on http://127.0.0.1:{port}/metrics")
        await touch.call(order_id="o1", timeout=30)
        text = await asyncio.to_thread(scrape, port)
        assert 'keyqueue_requests_succeeded_total{keyqueue_queue="shop",keyqueue_task="touch"} 1.0' in text
        assert "# TYPE keyqueue_request_wait_seconds histogram" in text
    finally:
        await app.close()
        await worker.stop()


async def test_each_worker_process_serves_metrics_on_its_own_port(nats_url: str) -> None:
    port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")} | {"KEYQUEUE_URL": nats_url}
    parent = await Command.start(str(KEYQUEUE), "worker", "tests.browser.dashboard_app:app", "--processes", "2",
                                 "--metrics-port", str(port), "--name", "pm", env=env, cwd=ROOT)
    try:
        await parent.wait_for(r"metrics on http://127\.0\.0\.1:\d+/metrics", count=2)
        assert sorted(int(m.group(1)) for m in parent.matches(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")) == [
            port, port + 1]
        for p in (port, port + 1):
            assert "keyqueue_keys_held" in await asyncio.to_thread(scrape, p)
    finally:
        await parent.stop()
