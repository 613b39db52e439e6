"""``EagerClock``: what waits for time in ``keyqueue.testing``'s eager mode, on a clock the test moves.

A delayed request waits for its due time, a periodic schedule for its next tick; the runner asks
for whatever is due by the time it advances to, one event at a time, oldest first (a delay and a
tick due together: the delay). An ``every`` schedule ticks at the runner's start plus whole intervals,
a cron one as the server computes it; each tick's request id is ``<name>-<tick number>``.
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from keyqueue.app.schedules import Periodic
from keyqueue.tasks.task import Receipt, TaskRequest
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

__all__ = ["DueEvent", "EagerClock"]


@dataclass(frozen=True, slots=True)
class DueEvent:
    """A request whose time has come."""

    due: dt.datetime
    request: TaskRequest


class EagerClock:
    """Delayed requests and periodic ticks in time order."""

    def __init__(self, start: dt.datetime, periodic: Sequence[Periodic]) -> None:
        self.start = start
        self._order: Iterator[int] = itertools.count()
        self._delayed: list[tuple[dt.datetime, int, TaskRequest]] = []
        self._periodic = list(periodic)
        self._next = {p.name: self._after(p, start) for p in self._periodic}
        self._ticks = dict.fromkeys(self._next, 0)

    def hold(self, request: TaskRequest, due: dt.datetime) -> Receipt:
        """Keep a delayed request until its due time."""
        order = next(self._order)
        heapq.heappush(self._delayed, (due, order, request))
        return Receipt(request.request_id, request.key, order + 1, False, request.queue, request.message_type,
                       due=due)

    def drop(self, queue: str, request_id: str) -> bool:
        """Forget a delayed request not yet due (a cancel); False if there is none."""
        kept = [entry for entry in self._delayed if (entry[2].queue, entry[2].request_id) != (queue, request_id)]
        if len(kept) == len(self._delayed):
            return False
        self._delayed = kept
        heapq.heapify(self._delayed)
        return True

    @property
    def pending(self) -> list[TaskRequest]:
        """The delayed requests not yet due, soonest first."""
        return [request for _, _, request in sorted(self._delayed)]

    def next_tick(self, name: str) -> dt.datetime:
        """When periodic schedule ``name`` ticks next."""
        return self._next[name]

    def pop_due(self, until: dt.datetime) -> DueEvent | None:
        """The earliest delayed request or tick due at or before ``until``, removed; None if none."""
        tick = min(self._periodic, key=lambda p: self._next[p.name], default=None)
        delayed = self._delayed[0] if self._delayed else None
        if delayed is not None and delayed[0] <= until and (tick is None or delayed[0] <= self._next[tick.name]):
            heapq.heappop(self._delayed)
            return DueEvent(delayed[0], delayed[2])
        if tick is not None and self._next[tick.name] <= until:
            due = self._next[tick.name]
            self._ticks[tick.name] += 1
            self._next[tick.name] = self._after(tick, due)
            return DueEvent(due, self._tick_request(tick, self._ticks[tick.name]))
        return None

    def _after(self, periodic: Periodic, t: dt.datetime) -> dt.datetime:
        """The first tick after ``t``: an ``every`` schedule ticks at the start plus whole intervals
        (``advance(60)`` with ``every=60`` is one tick), a cron one as the server computes it."""
        every = periodic.every
        if every is None:
            return periodic.next_after(t, self.start)
        step = dt.timedelta(seconds=every)
        return self.start + (math.floor((t - self.start) / step) + 1) * step

    @staticmethod
    def _tick_request(periodic: Periodic, number: int) -> TaskRequest:
        definition = periodic.definition()
        request_id = f"{periodic.name}-{number}"
        headers = {**definition.headers, H.MSG_ID: request_id}
        return TaskRequest(periodic.queue, periodic.key, periodic.task.name, request_id, loads(periodic.body, CBOR),
                           headers, periodic.body, periodic.task.spec)
