"""Helpers for the Rebaser's integration tests: an in-process worker and a fleet of worker processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "procs"))

import slow_functions
from event_log import SessionEvents
from harness import Fleet, WorkerProc

from keyqueue import App, RetryPolicy
from keyqueue_rebaser import RebaserPlugin, RebaserSettings, load_functions

WORKER = Path(__file__).resolve().parent / "rebaser_worker.py"

Event = tuple[str, dict[str, Any]]


class InProcessRebaser:
    """An app's worker with the Rebaser plugin, in this process; ``events`` has what it observed.

    Rebaser events keep their names (``applied``, ``dvu_started``, ...); key lifecycle hooks
    arrive as ``session:acquired``, ``session:released``, ``session:dead_lettered``.
    """

    def __init__(self, url: str, *, name: str = "inproc", linger: float = 0.05, ack_wait: float = 5.0,
                 concurrency: int = 32) -> None:
        self.events: list[Event] = []
        self._changed = asyncio.Event()
        rebaser = RebaserPlugin(settings=RebaserSettings(retry=RetryPolicy(max_attempts=3, base_delay=0.05)),
                                functions=load_functions([slow_functions], autoload=False),
                                observer=self._observe, ack_wait=ack_wait)
        self.app = App("rebaser-tests", url=url, plugins=[rebaser, SessionEvents(self._observe)],
                       autoload_plugins=False, set_as_default=False)
        self.worker = self.app.worker(concurrency=concurrency, linger=linger, name=name)

    def _observe(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append((event, fields))
        self._changed.set()

    async def __aenter__(self) -> InProcessRebaser:
        await self.worker.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await asyncio.wait_for(self.worker.stop(), 30)
        finally:
            await self.app.close()

    def named(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == event and all(f.get(k) == v for k, v in match.items())]

    async def wait_for(self, pred: Callable[[InProcessRebaser], bool], *, timeout: float = 20.0,
                       what: str = "condition") -> None:
        async def loop() -> None:
            while not pred(self):
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


class RebaserFleet(Fleet):
    """Rebaser worker processes writing to one JSON-lines log (see rebaser_worker.py)."""

    def start(self, name: str, *args: str) -> WorkerProc:
        stderr = open(self.log_path.with_suffix(f".{name}.stderr"), "wb")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen([sys.executable, str(WORKER), self.url, str(self.log_path), "--name", name, *args],
                                stdout=subprocess.DEVNULL, stderr=stderr)
        worker = WorkerProc(name, proc)
        self.workers.append(worker)
        return worker


async def dvu_events(app: App, key: str, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The key's ``dvu_finished`` events in keyqueue's events stream, once ``count`` of them are there."""
    from keyqueue import events as ev
    from keyqueue.errors import StreamNotFound
    from keyqueue.ext import JetStreamApi
    from keyqueue_rebaser import DVU_FINISHED

    api = JetStreamApi(await app.connection())
    stream = ev.events_stream("rebaser")
    async with asyncio.timeout(timeout):
        while True:
            await (await app.connection()).flush()
            found = []
            try:
                info = await api.stream_info(stream)
                for seq in range(max(1, int(info["state"]["first_seq"])), int(info["state"]["last_seq"]) + 1):
                    msg = await api.get_msg(stream, seq=seq, direct=False)
                    # One event, or a key's batch of them (KeyqueueEventBatch).
                    bodies = ev.decode_events(msg.headers, msg.data) if msg is not None else []
                    found += [b for b in bodies if b["event"] == DVU_FINISHED and b["key"] == key]
            except StreamNotFound:
                pass
            if len(found) >= count:
                return found
            await asyncio.sleep(0.05)


def rebaser_events(log: list[dict[str, Any]], event: str, **match: Any) -> list[dict[str, Any]]:
    return [r for r in log if r["kind"] == "rebaser" and r["event"] == event
            and all(r.get(k) == v for k, v in match.items())]


def session_events(log: list[dict[str, Any]], event: str, **match: Any) -> list[dict[str, Any]]:
    return [r for r in log if r["kind"] == "session" and r["event"] == event
            and all(r.get(k) == v for k, v in match.items())]
