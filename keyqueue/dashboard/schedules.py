"""What the Schedules page and a key's page show of a queue's schedules stream.

Periodic schedules come from ``keyqueue.admin.schedules.list_schedules`` (what ``keyqueue
schedules list`` prints). Delayed requests not yet due are the ``kq.<queue>.at.<id>`` messages
of the queue's schedules stream (``keyqueue.jetstream.schedules``): each carries its key in
its schedule's target, its due time in ``X-KQ-Due`` and its request id in
``X-KQ-Delayed-Request-Id``. Reading them costs one message read each, so ``Delays`` reads at
most ``DELAYED_LIMIT`` per queue, and again only once its last reading is ``max_age`` seconds
old, however many pages show them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from keyqueue.admin.schedules import ScheduleRow, list_schedules
from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.schedules import DELAYED_REQUEST_ID, DUE, SCHEDULE_TARGET, ScheduleNames, parse_time
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["DELAYED_LIMIT", "DelayedRequest", "Delays", "QueueSchedules", "queue_schedules"]

DELAYED_LIMIT: Final = 500
"""Delayed requests read per queue."""


@dataclass(frozen=True)
class DelayedRequest:
    """A request waiting in the schedules stream for its due time."""

    key: str
    request_id: str
    task: str
    due: float | None
    """When it falls due (Unix seconds); None if its header is missing or unreadable."""


@dataclass(frozen=True)
class DelayedList:
    """A queue's delayed requests as last read: the first ``DELAYED_LIMIT``, soonest due first."""

    requests: list[DelayedRequest]
    total: int
    """How many are stored (may exceed ``len(requests)``)."""
    read: float
    """When they were read (monotonic seconds)."""


class Delays:
    """Reads each queue's delayed requests, at most once per ``max_age`` seconds."""

    def __init__(self, nc: Client, *, max_age: float = 2.0, limit: int = DELAYED_LIMIT) -> None:
        self.api = JetStreamApi(nc)
        self.max_age = max_age
        self.limit = limit
        self._read: dict[str, DelayedList] = {}

    async def of(self, queue: str) -> DelayedList:
        found = self._read.get(queue)
        if found is None or time.monotonic() - found.read >= self.max_age:
            found = self._read[queue] = await self._load(queue)
        return found

    async def of_key(self, queue: str, key: str) -> list[DelayedRequest]:
        return [r for r in (await self.of(queue)).requests if r.key == key]

    async def _load(self, queue: str) -> DelayedList:
        names = ScheduleNames(queue)
        try:
            subjects = await self.api.subjects(names.stream, names.at_prefix + ">")
        except StreamNotFound:
            return DelayedList([], 0, time.monotonic())
        chosen = sorted(subjects)[: self.limit]
        messages = await asyncio.gather(*(self.api.get_msg(names.stream, last_by_subject=s, direct=False)
                                          for s in chosen))
        requests = []
        for msg in messages:
            if msg is None:  # fell due meanwhile
                continue
            lower = {k.lower(): v for k, v in msg.headers.items()}
            target = lower.get(SCHEDULE_TARGET.lower(), "")
            requests.append(DelayedRequest(
                target[len(names.due_prefix):] if target.startswith(names.due_prefix) else "?",
                lower.get(DELAYED_REQUEST_ID.lower(), ""), lower.get(H.MESSAGE_TYPE.lower(), ""),
                _due(lower.get(DUE.lower()))))
        requests.sort(key=lambda r: (r.due is None, r.due or 0.0, r.key))
        return DelayedList(requests, sum(subjects.values()), time.monotonic())


def _due(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return parse_time(text).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class QueueSchedules:
    """A queue's periodic schedules and delayed requests, as the Schedules page lists them."""

    queue: str
    periodic: list[ScheduleRow]
    delayed: DelayedList | None
    """None: the queue has no schedules stream (nothing was ever delayed or scheduled)."""


async def queue_schedules(nc: Client, delays: Delays, queue: str, *, now: dt.datetime | None = None) -> QueueSchedules:
    try:
        periodic, _ = await list_schedules(nc, queue, now=now)
    except StreamNotFound:
        return QueueSchedules(queue, [], None)
    return QueueSchedules(queue, sorted(periodic, key=lambda r: r.name), await delays.of(queue))
