"""A queue's periodic schedules as the server keeps them, with their next run (``keyqueue schedules``)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.cron import every_seconds, next_cron, next_every, zone
from keyqueue.jetstream.schedules import ScheduleStore
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["ScheduleRow", "list_schedules", "remove_schedule"]


@dataclass(frozen=True)
class ScheduleRow:
    """One periodic schedule of a queue."""

    name: str
    task: str
    key: str
    schedule: str
    """``every 30s``, or the cron expression as the server has it (six fields, seconds first)."""
    timezone: str
    next_run: dt.datetime | None
    """When it fires next (UTC), computed as the server does; None if it could not be computed."""
    kwargs: object


async def list_schedules(nc: Client, queue: str, *, now: dt.datetime | None = None) -> tuple[list[ScheduleRow], int]:
    """The queue's periodic schedules by name, and how many delayed requests wait for their due time.

    ``StreamNotFound`` if the queue has no schedules stream (nothing was ever delayed or scheduled).
    """
    store = ScheduleStore(nc, queue)
    await store.api.stream_info(store.names.stream)  # StreamNotFound for a queue without schedules
    now = now or dt.datetime.now(dt.UTC)
    rows = []
    for definition in (await store.periodic()).values():
        every = every_seconds(definition.pattern)
        tz = definition.timezone or "UTC"
        next_run: dt.datetime | None
        try:
            if every is not None:
                next_run = next_every(every, definition.stored or now, now)
            else:
                fire = next_cron(definition.pattern, zone(tz), now)
                next_run = fire.astimezone(dt.UTC) if fire is not None else None
        except Exception:  # a schedule keyqueue did not write: show it without a next run
            next_run = None
        try:
            kwargs: object = loads(definition.body, definition.headers.get(H.CONTENT_TYPE, CBOR))
        except Exception:
            kwargs = None
        rows.append(ScheduleRow(definition.name, definition.headers.get(H.MESSAGE_TYPE, "?"), definition.key,
                                f"every {every:g}s" if every is not None else definition.pattern, tz, next_run,
                                kwargs))
    return rows, await store.pending_delays()


async def remove_schedule(nc: Client, queue: str, name: str) -> bool:
    """Remove periodic schedule ``name`` of ``queue``; False if it has none of that name.

    A worker of an app that still declares it stores it again when it starts.
    """
    store = ScheduleStore(nc, queue)
    try:
        return await store.remove_periodic(name)
    except StreamNotFound:
        return False
