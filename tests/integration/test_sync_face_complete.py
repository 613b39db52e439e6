"""The sync face, complete: ``enqueue_many_sync`` and ``purge_sync``; and ``status`` / ``cancel`` of a
request no worker runs answer as soon as every live worker has said so, not after a fixed wait.

The waits' bounds are set to an hour here: an answer that comes back at all came from the
workers' answers (or the server's no-responders status), never from a timer running out. Code
that waits its bound out instead hits the sync portal's own bound and raises ``SyncTimeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import keyqueue
from keyqueue.app import application
from keyqueue.app.status import request_status

HOUR = 3600.0


@pytest.fixture
def answers_never_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound the status question and the cancel's wait by an hour (they are bounds, not waits)."""
    assert request_status.__kwdefaults__ is not None
    monkeypatch.setitem(request_status.__kwdefaults__, "ask_wait", HOUR)
    monkeypatch.setattr(application, "CANCEL_ANSWER_WAIT", HOUR)


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("desk", nats_url, autoload_plugins=False, set_as_default=False)  # keeps no results
    try:
        yield app
    finally:
        await app.close()


async def test_status_and_cancel_answer_when_the_workers_do(app: keyqueue.App,
                                                           answers_never_time_out: None) -> None:
    started, gate = asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    @app.task(key="{order}")
    async def hold(order: str) -> str:
        started.set()
        await gate.wait()
        return "released"

    @app.task(key="{order}")
    async def plain(order: str, n: int) -> int:
        ran.append(f"{order}/{n}")
        return n

    # No worker at all: the server says no one listens, at once.
    early = await plain.enqueue(order="o0", n=0)
    assert await asyncio.to_thread(early.status_sync) == "pending"

    async with app.worker() as worker:
        assert worker.heartbeat is not None
        await worker.heartbeat.wrote.wait()  # the worker is counted among the live ones
        held = await hold.enqueue(order="o1")
        await started.wait()
        behind = await plain.enqueue(order="o1", n=1)
        later = await plain.enqueue(order="o1", n=2)

        def view() -> list[Any]:
            return [behind.status_sync(), held.status_sync(), app.status_sync("never-seen"),
                    later.cancel_sync(), held.cancel_sync(), app.status_sync(later.request_id, key="o1")]

        assert await asyncio.to_thread(view) == ["pending", "running", "unknown", "pending", "running", "cancelled"]
        gate.set()
        assert await plain.call(order="o1", n=3, timeout=20) == 3  # after every earlier request of the key
    assert ran == ["o0/0", "o1/1", "o1/3"]  # the cancelled request never ran


async def test_enqueue_many_sync_and_purge_sync(app: keyqueue.App) -> None:
    @app.task(key="{order}")
    def plain(order: str, n: int) -> int:
        return n

    @app.task(key="{order}", policy="batch", queue="tallies")
    def tally(items: list[dict[str, Any]]) -> None:
        return None

    def view() -> tuple[list[keyqueue.Receipt], list[keyqueue.Receipt], list[int]]:
        receipts = plain.enqueue_many_sync([{"order": "a", "n": 1}, {"order": "a", "n": 2}, {"order": "b", "n": 3}])
        delayed = plain.options(countdown=600).enqueue_many_sync([{"order": "c", "n": 4}])
        batch = tally.enqueue_many_sync([{"order": "a"}, {"order": "b"}])
        return receipts + batch, delayed, [app.purge_sync(key="a"), app.purge_sync(), app.purge_sync("tallies")]

    stored, delayed, purged = await asyncio.to_thread(view)
    assert [(r.queue, r.key) for r in stored] == [("desk", "a"), ("desk", "a"), ("desk", "b"), ("tallies", "a"),
                                                  ("tallies", "b")]
    assert purged == [2, 1, 2]
    assert await app.status(delayed[0].request_id) == "scheduled"
