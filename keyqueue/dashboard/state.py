"""What the dashboard shows: a snapshot of every queue, refreshed once a second, and what it follows live.

``Monitor`` polls the server and keeps, per queue, a few minutes of the inbox's and the DLQ's
counters, from which it derives requests per second without any help from the workers:
*enqueued/s* from the growth of the inbox's last sequence, *done/s* from requests that left the
inbox (processed or dead-lettered); ``/health`` reads the backlog's and the DLQ's growth there.

**Every key, at any size.** The counts (backlog, keys held, waiting, DLQ) are read at each
refresh, in a few reads whatever the number of keys. Every key's state (``inspect_queue`` with
every key) costs a read of the token and inbox subjects, which on 100,000 keys takes around a
second, so it is read again only once its last reading is ``KEYS_COST_FACTOR`` times its own cost
old (every refresh on small queues); pages say when it was read.

It also follows, live: the queues' lifecycle events (``kq.*.events.>``), keeping the last few per
key (a key's attempts and whether it is failing), a count per event and queue since it started
(the ``/metrics`` counters), the wait and run times of the last minutes (``latency``) and the
per-minute rollups it stores (``history``); every key's last progress time
(``kq.*.progress.>``: a held key that reports progress is not stuck); and, for the keys whose page
is open, their progress messages (``progress``). The search index (``search``) is brought up to
date in a task of its own. Events may be sampled or turned off (docs/observability.md): the rates
do not depend on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from keyqueue.admin.inspection import KeyState, QueueReport, inspect_queue, list_queues
from keyqueue.admin.workers import WorkerState, queue_workers
from keyqueue.dashboard.history import History
from keyqueue.dashboard.latency import Latencies
from keyqueue.dashboard.progress import ProgressFeed
from keyqueue.dashboard.schedules import Delays
from keyqueue.dashboard.search import SearchIndex
from keyqueue.errors import KeyqueueError, StreamNotFound
from keyqueue.events import decode_events
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["KEYS_COST_FACTOR", "KEY_EVENTS", "SAMPLES_KEPT", "HeadAttempt", "KeyEvent", "Monitor", "QueueView",
           "Snapshot"]

log = logging.getLogger("keyqueue.dashboard")

SAMPLES_KEPT: Final = 360.0
"""Seconds of each queue's counters kept (one sample per refresh)."""

KEYS_COST_FACTOR: Final = 4.0
"""Every key's state is read again once its last reading is this many times its cost old."""

KEY_EVENTS: Final = 50
"""Recent events kept per key."""

TRACKED_KEYS: Final = 10_000
"""Keys whose recent events are kept (the least recently active are forgotten first)."""

PROGRESS_KEYS: Final = 100_000
"""Keys whose last progress time is kept (the least recently active are forgotten first)."""


@dataclass(frozen=True)
class Sample:
    at: float
    last_seq: int
    messages: int
    dlq: int = 0
    unkeyed: int = 0
    """Unkeyed requests stored in the work stream (``messages`` counts the keyed inbox)."""


@dataclass
class QueueView:
    """One queue as the pages show it."""

    report: QueueReport
    """Its counts as of this snapshot; its keys as of ``keys_read``."""
    workers: list[WorkerState]
    history: deque[Sample] = field(default_factory=deque)
    keys_read: float = 0.0
    """When its keys were last read (Unix seconds)."""
    keys_cost: float = 0.0
    """Seconds that reading took."""

    def sample_ago(self, seconds: float) -> Sample | None:
        """The oldest sample at most ``seconds`` old, if one is at least ``seconds`` / 2 old."""
        if not self.history:
            return None
        last = self.history[-1]
        found = next((s for s in self.history if last.at - s.at <= seconds), None)
        return found if found is not None and last.at - found.at >= seconds / 2 else None

    def rate(self, kind: str, window: float = 5.0) -> float:
        """``enqueued`` or ``done`` per second over the last ``window`` seconds."""
        return _rate(list(self.history), kind, window)

    def series(self, kind: str, span: float = 120.0) -> list[float]:
        """Per-sample rates over the last ``span`` seconds, oldest first (the sparklines)."""
        last = self.history[-1].at if self.history else 0.0
        samples = [s for s in self.history if last - s.at <= span]
        return [_rate(samples[: i + 1], kind, 0.0) for i in range(1, len(samples))]

    @property
    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers if w.live]


def _rate(samples: list[Sample], kind: str, window: float) -> float:
    if len(samples) < 2:
        return 0.0
    last = samples[-1]
    first = next((s for s in samples if last.at - s.at <= window), samples[-2]) if window else samples[-2]
    if first is last:
        first = samples[-2]
    elapsed = last.at - first.at
    if elapsed <= 0:
        return 0.0
    enqueued = last.last_seq - first.last_seq
    done = enqueued - (last.messages - first.messages)
    return max(0, enqueued if kind == "enqueued" else done) / elapsed


@dataclass
class Snapshot:
    """Every queue, as of ``taken`` (Unix seconds); ``version`` grows with each refresh."""

    queues: dict[str, QueueView] = field(default_factory=dict)
    taken: float = 0.0
    version: int = 0
    error: str | None = None
    """Why the last refresh failed (the server away, ...), shown on every page; else None."""


@dataclass(frozen=True)
class KeyEvent:
    ts: float
    event: str
    request_id: str | None
    task: str | None
    worker: str | None
    detail: str
    attempt: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class HeadAttempt:
    """The attempts of the request a key is running or retrying, as its lifecycle events tell."""

    request_id: str | None
    attempt: int
    """Attempts so far (the one under way included)."""
    failing: bool
    """An attempt of it failed and it is being retried."""
    error: str | None
    """The last failed attempt's error, when one failed."""


_FINISHED: Final = frozenset({"succeeded", "dead_lettered", "superseded", "cancelled"})
"""Events after which a request is no longer under way."""


class Monitor:
    """Refreshes the ``Snapshot`` every ``refresh`` seconds and follows the lifecycle events.

    ``queues`` limits what is shown (``--app``: that app's queues); None shows every queue on the
    server. ``changed`` is set after each refresh and cleared by the next one's start: the
    server-sent events wait on it.
    """

    def __init__(self, nc: Client, *, queues: list[str] | None = None, refresh: float = 1.0) -> None:
        self.nc = nc
        self.api = JetStreamApi(nc)
        self.only = queues
        self.refresh = refresh
        self.snapshot = Snapshot()
        self.events: dict[tuple[str, str], deque[KeyEvent]] = {}
        self.event_counts: dict[tuple[str, str, str], int] = defaultdict(int)
        """(queue, event, task) -> events seen since the dashboard started."""
        self.waits: dict[str, Latencies] = defaultdict(Latencies)
        """Queue -> its requests' waits (enqueue to start) over the last minutes."""
        self.runs: dict[str, Latencies] = defaultdict(Latencies)
        """Queue -> its requests' run times (start to finish) over the last minutes."""
        self.progress = ProgressFeed(nc)
        self.delays = Delays(nc, max_age=max(2.0, 2 * refresh))
        """The queues' delayed requests, read when a page shows them."""
        self.history = History(nc)
        """Per-minute rollups of every queue's events, stored in NATS."""
        self.search = SearchIndex(nc)
        self.last_progress: dict[tuple[str, str], float] = {}
        """(queue, key) -> when its last progress message arrived (most recent last)."""
        self._version = asyncio.Condition()
        self._subscriptions: list[Any] = []
        self._keys_due: dict[str, float] = {}
        self.listeners: list[Callable[[Snapshot], None]] = []

    async def run(self) -> None:
        """Refresh until cancelled (the search index is followed by a task of its own)."""
        await self.start_following()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._follow_index(), name="keyqueue-dashboard-search-index")
                while True:
                    await self.poll()
                    await self.history.flush(sorted(self.snapshot.queues))
                    await asyncio.sleep(self.refresh)
        finally:
            await self.progress.close()
            for subscription in self._subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    async def start_following(self) -> None:
        """Subscribe to every queue's events and progress (``run`` does; a test may alone)."""
        if not self._subscriptions:
            self._subscriptions = [await self.nc.subscribe("kq.*.events.>", cb=self._on_event),
                                   await self.nc.subscribe("kq.*.progress.>", cb=self._on_progress)]

    async def _follow_index(self) -> None:
        while True:
            for queue in sorted(self.snapshot.queues):
                try:
                    await self.search.follow(queue)
                except (KeyqueueError, TimeoutError, OSError) as exc:
                    log.warning("dashboard: the search index of queue %s is behind: %s", queue, exc)
            for gone in set(self.search.pending) - set(self.snapshot.queues):
                self.search.forget(gone)
            await asyncio.sleep(self.refresh)

    async def poll(self) -> None:
        """One refresh of every queue."""
        previous = self.snapshot
        snapshot = Snapshot(version=previous.version + 1, taken=time.time())
        try:
            names = self.only if self.only is not None else await list_queues(self.api)
            for queue in names:
                view = await self._queue(queue, previous.queues.get(queue))
                if view is not None:
                    snapshot.queues[queue] = view
        except (KeyqueueError, TimeoutError, OSError) as exc:
            snapshot.queues = previous.queues
            snapshot.error = f"{type(exc).__name__}: {exc}"
            log.warning("dashboard: refresh failed: %s", snapshot.error)
        self.snapshot = snapshot
        await self.progress.expire()
        for listener in self.listeners:
            listener(snapshot)
        async with self._version:
            self._version.notify_all()

    async def _queue(self, queue: str, before: QueueView | None) -> QueueView | None:
        every_key = before is None or time.monotonic() >= self._keys_due.get(queue, 0.0)
        started = time.monotonic()
        try:
            report = await inspect_queue(self.api, queue, every_key=True, keys=every_key)
            info = await self.api.stream_info(QueueNames(queue).inbox_stream)
        except StreamNotFound:
            return None
        if every_key:
            cost = time.monotonic() - started
            self._keys_due[queue] = time.monotonic() + max(self.refresh, KEYS_COST_FACTOR * cost)
            view = QueueView(report, await queue_workers(self.api, queue), keys_read=time.time(), keys_cost=cost)
            self.search.trim(report)
        else:
            assert before is not None
            keys = before.report
            report = replace(report, keys=keys.keys, workers=keys.workers, keys_total=keys.keys_total,
                             inbox_last_seq=keys.inbox_last_seq)
            view = QueueView(report, await queue_workers(self.api, queue), keys_read=before.keys_read,
                             keys_cost=before.keys_cost)
        if before is not None:
            view.history.extend(before.history)
        state = info.get("state") or {}
        now = time.monotonic()
        view.history.append(Sample(now, int(state.get("last_seq", 0)), int(state.get("messages", 0)),
                                   report.dlq_size, report.unkeyed))
        while view.history and now - view.history[0].at > SAMPLES_KEPT:
            view.history.popleft()
        return view

    async def changed(self, version: int, timeout: float) -> int:
        """Wait until the snapshot's version passes ``version`` (at most ``timeout``); the version."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._version:
                await self._version.wait_for(lambda: self.snapshot.version > version)
        return self.snapshot.version

    async def _on_event(self, msg: Msg) -> None:
        for fields in decode_events(msg.headers, msg.data):  # one event, or a batch of a key's events
            self._on_fields(fields)

    def _on_fields(self, fields: dict[str, Any]) -> None:
        queue, key, name = fields.get("queue"), fields.get("key"), fields.get("event")
        if not isinstance(queue, str) or not isinstance(name, str):
            return
        self.event_counts[(queue, name, str(fields.get("task") or ""))] += 1
        if self.only is None or queue in self.only:
            self._timings(queue, name, fields)
            self.history.add(queue, name, fields)
        if not isinstance(key, str):
            return
        detail = " ".join(f"{k}={_short(fields[k])}" for k in ("attempt", "reason", "wait", "run")
                          if fields.get(k) is not None)
        recent = self.events.pop((queue, key), None) or deque(maxlen=KEY_EVENTS)
        attempt, reason = fields.get("attempt"), fields.get("reason")
        recent.append(KeyEvent(float(fields.get("ts") or time.time()), name, fields.get("request_id"),
                               fields.get("task"), fields.get("worker"), detail,
                               attempt if isinstance(attempt, int) else None,
                               reason if isinstance(reason, str) else None))
        self.events[(queue, key)] = recent  # most recently active last
        while len(self.events) > TRACKED_KEYS:
            del self.events[next(iter(self.events))]

    async def _on_progress(self, msg: Msg) -> None:
        parts = msg.subject.split(".", 3)
        if len(parts) == 4:
            which = (parts[1], parts[3])
            self.last_progress.pop(which, None)
            self.last_progress[which] = time.time()  # most recently active last
            if len(self.last_progress) > PROGRESS_KEYS:
                del self.last_progress[next(iter(self.last_progress))]

    def _timings(self, queue: str, name: str, fields: dict[str, Any]) -> None:
        if name == "started" and isinstance(wait := fields.get("wait"), int | float):
            self.waits[queue].add(float(wait))
        elif name in ("succeeded", "dead_lettered") and isinstance(run := fields.get("run"), int | float):
            self.runs[queue].add(float(run))

    def head_attempt(self, queue: str, key: str) -> HeadAttempt | None:
        """The attempts of the request the key is running or retrying; None when none is under way
        (or no event of it was seen: the dashboard follows events from its start)."""
        recent = self.events.get((queue, key), ())
        for index in range(len(recent) - 1, -1, -1):
            e = recent[index]
            if e.event in _FINISHED:
                return None
            if e.event in ("started", "retried"):
                attempt = e.attempt or 1
                failing = e.event == "retried" or attempt > 1
                error = e.reason if e.event == "retried" else next(
                    (r.reason for r in reversed(list(recent)[:index]) if r.event == "retried"
                     and r.request_id == e.request_id), None)
                return HeadAttempt(e.request_id, attempt, failing, error)
        return None

    def key_events(self, queue: str, key: str) -> list[KeyEvent]:
        """The key's recent events, newest first."""
        return list(reversed(self.events.get((queue, key), ())))

    def last_activity(self, queue: str, key: KeyState) -> float | None:
        """When the key last did something: its last event or progress message, else when its holder
        acquired it (a lease renewal is not activity: it says the holder lives, not that work moves)."""
        recent = self.events.get((queue, key.key))
        moments = [recent[-1].ts] if recent else []
        if (progress := self.last_progress.get((queue, key.key))) is not None:
            moments.append(progress)
        if not moments and key.holder is not None:
            moment = key.holder.since or key.holder.renewed
            return None if moment is None else moment.timestamp()
        return max(moments) if moments else None


def _short(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
