"""Each queue's throughput, wait and run times kept over hours: per-minute rollups stored in NATS.

The dashboard follows every lifecycle event (``state.Monitor``). Per queue and minute (by the
event's ``ts``) it counts them (enqueued, started, succeeded, retried, dead-lettered) and keeps a
histogram of waits and of runs in the bins of :mod:`keyqueue.dashboard.latency`. Once a minute has
closed (``GRACE`` seconds after its end) it is written to the queue's stats stream ``KQ_<queue>_STATS``
on ``kq.<queue>.stats.<minute>`` as one small JSON object. Each subject is written once (with
``Nats-Expected-Last-Subject-Sequence: 0``), so two dashboards on one server do not count a minute
twice: the first to write it wins. Charts read the stream, so they survive a restart and show what
happened while the browser was closed.

**Minutes no dashboard saw.** Live counting starts with the minute after the dashboard started.
That first minute, and the minutes since the last one stored (at most ``BACKFILL`` back), are
rolled up from the queue's events stream once that minute has closed, reading at most
``BACKFILL_EVENTS`` events; minutes beyond that stay gaps in the charts. Events may be sampled or
off (docs/observability.md): the counts are then of the sample, or absent.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from keyqueue.dashboard.latency import bin_of, quantile_of
from keyqueue.errors import KeyqueueError, StreamNotFound, WireError, WrongLastSequence
from keyqueue.events import events_stream, events_subject
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.kv import EXPECTED_LAST_SUBJECT_SEQUENCE
from keyqueue.jetstream.subjects import validate_queue_name
from keyqueue.wire import CBOR, loads

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["BACKFILL", "BACKFILL_EVENTS", "COUNTED", "GRACE", "KEPT", "History", "Minute", "Point", "stats_stream",
           "stats_subject"]

log = logging.getLogger("keyqueue.dashboard")

MINUTE: Final = 60
GRACE: Final = 5.0
"""Seconds after a minute's end before it is written (events of its last moments are still on their way)."""

KEPT: Final = 7 * 24 * 3600
"""Seconds the stats stream keeps a minute."""

BACKFILL: Final = 6 * 3600
"""Seconds before the dashboard's start that it rolls up from the events stream, at most."""

BACKFILL_EVENTS: Final = 500_000
"""Events read for that, at most."""

COUNTED: Final = ("enqueued", "started", "succeeded", "retried", "dead_lettered")
"""The lifecycle events a minute counts."""


def stats_stream(queue: str) -> str:
    return f"KQ_{validate_queue_name(queue)}_STATS"


def stats_subject(queue: str, minute: int | str) -> str:
    return f"kq.{queue}.stats.{minute}"


@dataclass
class Minute:
    """One queue's minute: how many of each counted event, and its waits' and runs' histograms."""

    minute: int
    """Unix seconds // 60."""
    counts: Counter[str] = field(default_factory=Counter)
    waits: Counter[int] = field(default_factory=Counter)
    runs: Counter[int] = field(default_factory=Counter)

    def add(self, event: str, fields: dict[str, Any]) -> None:
        self.counts[event] += 1
        if event == "started" and isinstance(wait := fields.get("wait"), int | float) and math.isfinite(wait):
            self.waits[bin_of(max(0.0, float(wait)))] += 1
        elif event in ("succeeded", "dead_lettered") and isinstance(run := fields.get("run"), int | float) \
                and math.isfinite(run):
            self.runs[bin_of(max(0.0, float(run)))] += 1

    def encode(self) -> bytes:
        return json.dumps({"minute": self.minute, "counts": dict(self.counts),
                           "waits": {str(k): v for k, v in self.waits.items()},
                           "runs": {str(k): v for k, v in self.runs.items()}}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Minute | None:
        try:
            body = json.loads(data)
            return cls(int(body["minute"]), Counter({str(k): int(v) for k, v in body.get("counts", {}).items()}),
                       Counter({int(k): int(v) for k, v in body.get("waits", {}).items()}),
                       Counter({int(k): int(v) for k, v in body.get("runs", {}).items()}))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True)
class Point:
    """One point of a chart: ``step`` minutes from ``start`` (Unix seconds) merged."""

    start: float
    enqueued: int
    done: int
    """Succeeded and dead-lettered."""
    retried: int
    wait_p50: float | None
    wait_p99: float | None
    run_p50: float | None
    run_p99: float | None
    empty: bool
    """No minute of it was stored (no dashboard and no events then, or beyond the backfill)."""
    stored_done: int = 0
    """Of ``done``, what stored minutes hold (the rest is this dashboard's count of a minute still open)."""


class History:
    """Per-minute rollups of every queue the dashboard follows: counted live, written once closed."""

    def __init__(self, nc: Client, *, kept: float = KEPT, backfill: float = BACKFILL,
                 backfill_events: int = BACKFILL_EVENTS, clock: Any = time.time) -> None:
        self.api = JetStreamApi(nc)
        self.kept = kept
        self.backfill = backfill
        self.backfill_events = backfill_events
        self.clock = clock
        self.started_minute = int(clock() // MINUTE)
        self.open: dict[tuple[str, int], Minute] = {}
        """(queue, minute) -> its live counts, until written."""
        self._ensured: set[str] = set()
        self._backfilled: set[str] = set()

    def add(self, queue: str, event: str, fields: dict[str, Any]) -> None:
        """Count one live event (those of the dashboard's first minute are left to the backfill)."""
        if event not in COUNTED:
            return
        ts = fields.get("ts")
        minute = int((ts if isinstance(ts, int | float) else self.clock()) // MINUTE)
        if minute <= self.started_minute or minute < int(self.clock() // MINUTE) - 1:
            return
        found = self.open.get((queue, minute))
        if found is None:
            found = self.open[(queue, minute)] = Minute(minute)
        found.add(event, fields)

    async def flush(self, queues: list[str]) -> None:
        """Write every closed minute; then, once the dashboard's first minute closed, backfill each
        queue not yet backfilled. A failure is logged and tried again at the next flush."""
        closed = int((self.clock() - GRACE) // MINUTE)  # minutes before this one have closed
        for (queue, minute), counts in sorted(self.open.items()):
            if minute < closed:
                try:
                    await self._write(queue, counts)
                except (KeyqueueError, OSError) as exc:
                    log.warning("dashboard: minute %s of queue %s not stored: %s", minute, queue, exc)
                    continue
                del self.open[(queue, minute)]
        if closed > self.started_minute:
            for queue in queues:
                if queue not in self._backfilled:
                    try:
                        await self._backfill(queue)
                        self._backfilled.add(queue)
                    except (KeyqueueError, OSError) as exc:
                        log.warning("dashboard: the history of queue %s before it started is not rolled up: %s",
                                    queue, exc)

    async def points(self, queue: str, *, hours: float, step: int) -> list[Point]:
        """The chart points of the last ``hours``, ``step`` minutes each, oldest first."""
        now_minute = int(self.clock() // MINUTE)
        first = now_minute - int(hours * 60) + 1
        first -= first % step
        minutes: dict[int, Minute] = {}
        live: set[int] = set()
        start = datetime.fromtimestamp((first - 1) * MINUTE, UTC).isoformat()
        try:
            async for page in self.api.pages(stats_stream(queue), stats_subject(queue, ">"), start_time=start):
                for msg in page:
                    m = Minute.decode(msg.data)
                    if m is not None and m.minute >= first:
                        minutes[m.minute] = m
        except StreamNotFound:
            pass
        for (q, minute), counting in self.open.items():
            if q == queue and minute >= first and minute not in minutes:
                minutes[minute] = counting
                live.add(minute)
        points = []
        for begin in range(first, now_minute + 1, step):
            group = [minutes[m] for m in range(begin, begin + step) if m in minutes]
            counts: Counter[str] = Counter()
            for m in group:
                counts.update(m.counts)
            waits = [m.waits for m in group]
            runs = [m.runs for m in group]
            stored = [m for m in group if m.minute not in live]
            stored_done = sum(m.counts["succeeded"] + m.counts["dead_lettered"] for m in stored)
            points.append(Point(begin * MINUTE, counts["enqueued"], counts["succeeded"] + counts["dead_lettered"],
                                counts["retried"], quantile_of(waits, 0.5), quantile_of(waits, 0.99),
                                quantile_of(runs, 0.5), quantile_of(runs, 0.99), not group, stored_done))
        return points

    async def _ensure(self, queue: str) -> None:
        if queue in self._ensured:
            return
        await self.api.stream_or_create({
            "name": stats_stream(queue), "subjects": [stats_subject(queue, ">")], "retention": "limits",
            "storage": "file", "num_replicas": 1, "max_msgs_per_subject": 1, "discard": "old",
            "max_age": int(self.kept * 1e9), "allow_direct": True})
        self._ensured.add(queue)

    async def _write(self, queue: str, minute: Minute) -> bool:
        """Store ``minute`` unless one is stored for it already; whether it was written."""
        await self._ensure(queue)
        try:
            await self.api.publish(stats_subject(queue, minute.minute), minute.encode(),
                                   {EXPECTED_LAST_SUBJECT_SEQUENCE: "0"})
        except WrongLastSequence:
            return False  # another dashboard stored it first
        return True

    async def _backfill(self, queue: str) -> None:
        """Roll up, from the events stream, the minutes from the last one stored (at most
        ``backfill`` seconds back) through the dashboard's first minute."""
        await self._ensure(queue)
        earliest = int((self.started_minute * MINUTE - self.backfill) // MINUTE)
        last = await self._last_stored(queue, earliest)
        first = max(earliest, (last or 0) + 1)
        if first > self.started_minute:
            return
        rolled: dict[int, Minute] = {}
        read = 0
        complete_through = self.started_minute
        start = datetime.fromtimestamp(first * MINUTE, UTC).isoformat()
        try:
            async for page in self.api.pages(events_stream(queue), events_subject(queue, ">"), start_time=start,
                                             batch=2000, limit=self.backfill_events):
                for msg in page:
                    read += 1
                    try:
                        fields = loads(msg.data, CBOR)
                    except WireError:
                        continue
                    if not isinstance(fields, dict) or not isinstance(ts := fields.get("ts"), int | float):
                        continue
                    minute = int(ts // MINUTE)
                    if first <= minute <= self.started_minute and (event := fields.get("event")) in COUNTED:
                        rolled.setdefault(minute, Minute(minute)).add(str(event), fields)
                if read >= self.backfill_events and page:
                    # Stopped early: only the minutes before the last one read are complete.
                    last_ts = _ts_of(page[-1].data)
                    complete_through = min(complete_through, int(last_ts // MINUTE) - 1) if last_ts else first - 1
        except StreamNotFound:
            return
        for minute in range(first, complete_through + 1):
            await self._write(queue, rolled.get(minute) or Minute(minute))
        log.info("dashboard: rolled up %d minute(s) of queue %s from %d stored event(s)",
                 max(0, complete_through - first + 1), queue, read)

    async def _last_stored(self, queue: str, since: int) -> int | None:
        """The last minute stored from ``since`` up to the dashboard's first one (later ones are its own)."""
        found = None
        start = datetime.fromtimestamp(since * MINUTE, UTC).isoformat()
        async for page in self.api.pages(stats_stream(queue), stats_subject(queue, ">"), start_time=start):
            for msg in page:
                stored = Minute.decode(msg.data)
                if stored is not None and since <= stored.minute <= self.started_minute:
                    found = max(found or stored.minute, stored.minute)
        return found


def _ts_of(data: bytes) -> float | None:
    try:
        fields = loads(data, CBOR)
    except WireError:
        return None
    ts = fields.get("ts") if isinstance(fields, dict) else None
    return float(ts) if isinstance(ts, int | float) else None
