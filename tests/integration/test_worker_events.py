"""The worker's lifecycle events wait for slow hooks in a bounded queue: nothing is dropped."""

from __future__ import annotations

import asyncio
import logging

import keyqueue


class LogSignal(logging.Handler):
    """An event set when a record whose message contains ``text`` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


async def first(*events: asyncio.Event, timeout: float = 20.0) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def test_slow_hooks_hold_key_sessions_back_and_every_hook_still_runs(nats_url: str) -> None:
    total = 30
    release = asyncio.Event()
    all_handled = asyncio.Event()
    all_hooked = asyncio.Event()
    handled: list[int] = []
    hooked: list[str] = []

    class SlowHook:
        @keyqueue.hookimpl
        async def keyqueue_request_succeeded(self, request_id: str) -> None:
            await release.wait()
            hooked.append(request_id)
            if len(hooked) == total:
                all_hooked.set()

    app = keyqueue.App("slowhooks", url=nats_url, set_as_default=False, autoload_plugins=False,
                       plugins=[SlowHook()])

    @app.task(key="{k}")
    async def work(k: str, n: int) -> None:
        handled.append(n)
        if len(handled) == total:
            all_handled.set()

    receipts = [await work.enqueue(k="k", n=n) for n in range(total)]
    signal = LogSignal("wait for their hooks")
    logging.getLogger("keyqueue.worker").addHandler(signal)
    try:
        worker = app.worker(concurrency=2)
        worker.event_backlog = 5
        async with worker:
            try:
                await first(signal.seen, all_handled)
                assert signal.seen.is_set(), "key sessions never waited for the slow hook"
                assert len(handled) < total
                # One session, one request at a time: the backlog plus that session's events
                # since it last checked (the outcome of one request and the start of the next).
                assert worker.events_waiting <= worker.event_backlog + 2
                assert worker.held_back >= 1
            finally:
                release.set()
            await asyncio.wait_for(all_hooked.wait(), 20)
        assert handled == list(range(total))
        assert sorted(hooked) == sorted(r.request_id for r in receipts)
    finally:
        logging.getLogger("keyqueue.worker").removeHandler(signal)
        await app.close()
