"""Only the user's code is charged an attempt: a transient NATS failure of keyqueue's own I/O around
a run (loading the cancel records, taking a rate-limit slot) is tried again within the lease.

Before, such a failure raised out of the processor's ``handle`` and counted as a failed attempt:
a ``max_attempts=1`` request was dead-lettered without ever running. Each test makes one of those
reads fail once with the error a NATS request with no answer raises, against a real nats-server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client

import keyqueue
from keyqueue.admin.dead_letters import dead_letters
from keyqueue.chaos.proxy import FaultProxy
from keyqueue.errors import KeyqueueTimeout
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords


def fail_once(monkeypatch: pytest.MonkeyPatch, method: str) -> list[str]:
    """Make ``RequestRecords.<method>`` raise ``KeyqueueTimeout`` on its next call (then work again);
    returns the list the failure is noted in."""
    real = getattr(RequestRecords, method)
    failed: list[str] = []

    async def flaky(self: RequestRecords, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(method)
            raise KeyqueueTimeout(f"{method}: no answer (injected)")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(RequestRecords, method, flaky)
    return failed


async def test_a_rate_limit_slot_that_times_out_costs_no_attempt(nats_url: str, nc: Client,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []
    app = keyqueue.App("own", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{account}", max_attempts=1, rate_limit="100/s", result_ttl=60)
    async def limited(ctx: keyqueue.Context, account: str) -> str:
        attempts.append(ctx.attempt)
        return account

    try:
        async with app.worker(concurrency=2):
            failed = fail_once(monkeypatch, "get_runs")
            assert await limited.call(account="a", timeout=20) == "a"
            assert failed == ["get_runs"]  # the slot's read did fail once
            assert attempts == [1]
            assert await dead_letters(JetStreamApi(nc), "own") == []
    finally:
        await app.close()


async def test_a_cancel_reload_that_times_out_after_a_reconnect_costs_no_attempt(
        nats_url: str, nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = FaultProxy.for_url(nats_url)
    await proxy.start()
    attempts: list[int] = []
    app = keyqueue.App("own", url=proxy.url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{account}", max_attempts=1, result_ttl=60)
    async def work(ctx: keyqueue.Context, account: str) -> str:
        attempts.append(ctx.attempt)
        return account

    reconnected = asyncio.Event()
    app.on_reconnect(reconnected.set)
    try:
        async with app.worker(concurrency=2, linger=30.0):  # the key stays held across the cut
            assert await work.call(account="a", timeout=20) == "a"
            failed = fail_once(monkeypatch, "pending_cancels")
            proxy.reset()  # the worker reconnects: its next request reloads the cancel records first
            await reconnected.wait()
            assert await work.call(account="a", timeout=20) == "a"
            assert failed == ["pending_cancels"]  # the reload did fail once
            assert attempts == [1, 1]
            assert await dead_letters(JetStreamApi(nc), "own") == []
    finally:
        await app.close()
        await proxy.close()


async def test_an_outage_of_its_own_io_past_the_lease_ends_the_session_as_a_lost_lease(
        nats_url: str, nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot's read fails, then the worker is cut off past its lease: the session ends ``lease-lost``
    and the request runs once the worker is back, on its first attempt (before: dead-lettered on the
    first failure)."""
    proxy = FaultProxy.for_url(nats_url)
    await proxy.start()
    attempts: list[int] = []
    outcomes: list[str] = []
    failing, lost = asyncio.Event(), asyncio.Event()

    class Sessions:
        @keyqueue.hookimpl
        def keyqueue_key_released(self, key: str, outcome: str) -> None:
            outcomes.append(outcome)
            if outcome == "lease-lost":
                lost.set()
                proxy.refuse(False)  # the worker comes back

    def declare(app: keyqueue.App) -> keyqueue.Task:  # type: ignore[type-arg]
        @app.task(key="{account}", max_attempts=1, rate_limit="100/s", result_ttl=60)
        async def limited(ctx: keyqueue.Context, account: str) -> str:
            attempts.append(ctx.attempt)
            return account
        return limited

    producer = keyqueue.App("own", url=nats_url, set_as_default=False, autoload_plugins=False)
    worker_app = keyqueue.App("own", url=proxy.url, set_as_default=False, autoload_plugins=False,
                              plugins=[Sessions()])
    limited, _ = declare(producer), declare(worker_app)
    real = RequestRecords.get_runs

    async def down(self: RequestRecords, *args: Any, **kwargs: Any) -> Any:
        if not lost.is_set():
            failing.set()
            raise KeyqueueTimeout("get_runs: no answer (injected)")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(RequestRecords, "get_runs", down)
    try:
        async with worker_app.worker(concurrency=2, ack_wait=2.0):
            receipt = await limited.enqueue(account="a")
            await failing.wait()
            proxy.refuse(True)
            proxy.reset()  # cut off while its slot's read is being retried, until its lease is gone
            assert await receipt.result(timeout=30) == "a"
            assert outcomes[0] == "lease-lost"
            assert attempts == [1]
            assert await dead_letters(JetStreamApi(nc), "own") == []
    finally:
        await worker_app.close()
        await producer.close()
        await proxy.close()
