"""Progress by request id: each request's last ``ctx.progress(value)``, kept, and read by its id.

``ctx.progress`` publishes live on ``kq.Q.progress.<key>`` (core NATS: nothing stores it), and the
worker running the request also keeps the value in the queue's records stream, on
``kq.Q.result.<id>.progress`` (``keyqueue.jetstream.records``), one message per request: a newer
progress replaces the older. Any process reads it by the request id alone (``App.progress``,
``App.status(..., progress=True)``, ``keyqueue status --progress``, the dashboard's key page).

A task may report progress thousands of times a second; a write each would make its run pay a
JetStream publish per call. So a run's progress is *coalesced* (:class:`ProgressKeeper`): the first
value is written at once, then at most one write per :data:`PROGRESS_INTERVAL` carries the latest
value of that interval (values in between are never written), and when the run ends, whatever it
reported last is written before its result is kept. A run that reports nothing writes nothing.

What is kept: the value's CBOR body as published, with the task, the attempt, the key and the
request id in headers; for :data:`PROGRESS_TTL` (or the task's ``result_ttl`` when that is
longer). A task declared with ``result_ttl=0`` keeps nothing in the records stream, progress
included. Writes are made only while the worker holds the key; a run whose lease is lost stops
writing, though a write already on its way may still land (a former holder's late progress can
show until the next holder reports its own: progress is for people, not a fencing source).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Final

from keyqueue.errors import KeyqueueError, LeaseLost, WireError
from keyqueue.jetstream.api import stored_seconds
from keyqueue.tasks.context import Progress
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.jetstream.api import StoredMsg
    from keyqueue.jetstream.records import RequestRecords

__all__ = ["PROGRESS_INTERVAL", "PROGRESS_TTL", "ProgressKeeper", "kept_progress", "read_progress"]

log = logging.getLogger("keyqueue.task")

PROGRESS_INTERVAL: Final = 1.0
"""Seconds between two writes of one run's progress (the latest value of each interval is written)."""

PROGRESS_TTL: Final = 24 * 3600
"""Seconds a request's last progress is kept after it was written (or its task's longer ``result_ttl``)."""

Write = Callable[[bytes, Mapping[str, str]], Awaitable[None]]
"""Stores one progress value (its body and headers) under each of the run's request ids."""


class ProgressKeeper:
    """One run's progress on its way to the records stream: the first value at once, then at most
    one write per ``interval``, always the latest; :meth:`close` writes the last one and ends.

    It owns one task, alive only while values are waiting to be written: :meth:`close` awaits it
    (or, with ``flush=False``, cancels it). A write that fails is logged and the next value tries
    again; a lost lease (the write raises ``LeaseLost``) ends the writing for good.
    """

    __slots__ = ("_closing", "_latest", "_task", "_wake", "_write", "describe", "interval", "written")

    def __init__(self, write: Write, *, interval: float = PROGRESS_INTERVAL, describe: str = "") -> None:
        self._write = write
        self.interval = interval
        self.describe = describe
        """What the run is, for a log line (``request X (key K)``)."""
        self._latest: tuple[bytes, Mapping[str, str]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self.written = 0
        """Values written so far."""

    def offer(self, body: bytes, headers: Mapping[str, str]) -> None:
        """Take the run's newest progress (called on the event loop, by ``ctx.progress``); it replaces
        any value not yet written. Ignored once the keeper is closing."""
        if self._closing:
            return
        self._latest = (body, headers)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"keyqueue-progress {self.describe}")

    async def close(self, *, flush: bool = True) -> None:
        """End the run's writing: with ``flush``, once the last value offered is written; without, at
        once (a run cut off, whose lease may be gone)."""
        self._closing = True
        task = self._task
        if task is None:
            return
        if not flush:
            task.cancel()
        elif self._wake is not None:
            self._wake.set()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the closer itself is being cancelled

    async def _run(self) -> None:
        try:
            while self._latest is not None:
                body, headers = self._latest
                self._latest = None
                try:
                    await self._write(body, headers)
                    self.written += 1
                except LeaseLost:
                    self._closing = True  # the key is another worker's now: this run reports no more
                    return
                except (KeyqueueError, OSError) as exc:
                    log.warning("the progress of %s was not kept (the next one tries again): %s", self.describe, exc)
                if self._closing:
                    continue  # the last value, if one came meanwhile, at once
                self._wake = asyncio.Event()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            self._task = None
            self._wake = None


def kept_progress(stored: StoredMsg | None, request_id: str) -> Progress | None:
    """The progress a record holds (None for no record, the marker of an expired one, or a body
    that does not decode)."""
    if stored is None or not stored.headers.get(H.MESSAGE_TYPE):
        return None
    headers = stored.headers
    try:
        value = loads(stored.data, headers.get(H.CONTENT_TYPE, CBOR)) if stored.data else None
    except WireError as exc:
        log.debug("kept progress of request %s does not decode: %s", request_id, exc)
        return None
    try:
        attempt = int(headers.get(H.ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    stamp = stored_seconds(stored.timestamp)
    return Progress(value=value, request_id=headers.get(H.REQUEST_ID, request_id), key=headers.get(H.KEY, ""),
                    task=headers.get(H.TASK, ""), attempt=attempt,
                    reported_at=None if stamp is None else datetime.datetime.fromtimestamp(stamp, datetime.UTC))


async def read_progress(records: RequestRecords, request_id: str) -> Progress | None:
    """The last progress kept for ``request_id`` in ``records.queue``, or None."""
    return kept_progress(await records.get_progress(request_id), request_id)
