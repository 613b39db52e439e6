"""Several app workers in this test process (each its own ``App``, so its own connection), and a
record of every run, for the tests of delayed and periodic requests."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import keyqueue

QUEUE = "timed"


@dataclass(frozen=True)
class Run:
    key: str
    tag: str
    request_id: str
    worker: str
    started: dt.datetime
    ended: dt.datetime


@dataclass
class Runs:
    """Every run of the ``work`` task, across the workers of a fleet."""

    done: list[Run] = field(default_factory=list)
    running: dict[str, str] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    """A run whose tag starts with ``wait`` waits for it."""

    def tags(self, key: str | None = None) -> list[str]:
        return [r.tag for r in self.done if key is None or r.key == key]

    async def wait(self, ready: Callable[[list[Run]], bool], timeout: float = 30, what: str = "runs") -> list[Run]:
        try:
            async with asyncio.timeout(timeout), self.changed:
                await self.changed.wait_for(lambda: ready(self.done))
        except TimeoutError:
            raise AssertionError(f"{what}: not there after {timeout}s; ran {self.tags()}") from None
        return list(self.done)

    async def count(self, n: int, timeout: float = 30) -> list[Run]:
        return await self.wait(lambda done: len(done) >= n, timeout, f"{n} runs")


def declare(app: keyqueue.App, runs: Runs, worker: str) -> None:
    @app.task(key="{key}", queue=QUEUE)
    async def work(ctx: keyqueue.Context, key: str, tag: str) -> str:
        started = dt.datetime.now(dt.UTC)
        if key in runs.running:
            runs.overlaps.append(f"{tag} ran beside {runs.running[key]}")
        runs.running[key] = tag
        await (runs.gate.wait() if tag.startswith("wait") else asyncio.sleep(0))
        del runs.running[key]
        async with runs.changed:
            runs.done.append(Run(key, tag, ctx.request_id, worker, started, dt.datetime.now(dt.UTC)))
            runs.changed.notify_all()
        return tag


def make_app(url: str, runs: Runs, worker: str = "producer",
             extra: Callable[[keyqueue.App], None] | None = None) -> keyqueue.App:
    app = keyqueue.App("timed-app", url=url, set_as_default=False, autoload_plugins=False)
    declare(app, runs, worker)
    if extra is not None:
        extra(app)
    return app


@contextlib.asynccontextmanager
async def worker(url: str, runs: Runs, name: str, *, linger: float = 0.05, ack_wait: float | None = None,
                 extra: Callable[[keyqueue.App], None] | None = None) -> AsyncIterator[keyqueue.App]:
    """One worker (its own app and connection) until the block ends, then drained."""
    app = make_app(url, runs, name, extra)
    try:
        async with app.worker(name=name, linger=linger, concurrency=8, ack_wait=ack_wait):
            yield app
    finally:
        await app.close()


@contextlib.asynccontextmanager
async def fleet(url: str, runs: Runs, count: int, *, linger: float = 0.05, ack_wait: float | None = None,
                extra: Callable[[keyqueue.App], None] | None = None) -> AsyncIterator[list[keyqueue.App]]:
    """``count`` workers started together (as a fleet's processes would), drained at the end."""
    async with contextlib.AsyncExitStack() as stack:
        apps = await asyncio.gather(*(stack.enter_async_context(worker(url, runs, f"w{i}", linger=linger,
                                                                       ack_wait=ack_wait, extra=extra))
                                      for i in range(count)))
        yield list(apps)
