"""The built-in plugin that publishes lifecycle events to the queue's events stream.

What an event is, and where it goes, is the contract in :mod:`keyqueue.events`. This plugin
publishes keyqueue's own events (:data:`keyqueue.events.EVENT_NAMES`) from its hooks, and the
events other plugins publish with :func:`keyqueue.events.publish_event` (through :func:`publish`).

Events are best-effort telemetry: they go out as plain core publishes (no ack round trip on
the hot path), so a broken connection or a full server may lose some, and the order of events
from different processes in the stream is the order they reached the server; sort by ``ts``.

A key's events are batched (the contract's ``KeyqueueEventBatch``): a worker keeps each key's
events until its session gives the key back, :data:`BATCH_MAX` of them are waiting, or
:data:`FLUSH_AFTER` seconds have passed since the first of them (one timer for all keys, armed for
the key whose first kept event is the oldest). An ``enqueue_many`` of one key sends its
``enqueued`` events as that key's batch; one that spans several keys sends them as batches across
keys, :data:`BATCH_MAX` a message, on ``kq.<queue>.events.batch`` (the contract in
:mod:`keyqueue.events` says why). A lone event goes out as a plain ``KeyqueueEvent``. So a hot
key's hundreds of events cost a few stored messages, a cold key's session one, and a bulk
enqueue's events one per :data:`BATCH_MAX` requests.

On by default. ``KEYQUEUE_EVENTS=0`` (or ``false``/``no``/``off``), read when an app first
publishes an event, turns it off for that app; ``app.plugins.unregister(name="keyqueue.builtins.events")``
does so from code. ``KEYQUEUE_EVENTS_SAMPLE=0.1`` keeps the events of one request in ten (chosen
by a hash of the request id, so a kept request's history is complete; events without a request
are sampled by key): counts in reports are then of the sample.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import operator
import os
import time
import weakref
import zlib
from collections.abc import Awaitable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import cbor2

from keyqueue.errors import KeyqueueTimeout, TaskFailure
from keyqueue.events import (
    EVENT_BATCH_HEADERS,
    EVENT_FIELD_NAMES,
    EVENT_HEADERS,
    ensure_events_stream,
    event_batch_body,
    event_batch_subject,
    events_stream,
    superseded_reason,
)
from keyqueue.jetstream.fastpub import StaticHeaders, publish_static
from keyqueue.plugins.manager import hookimpl, inline_observer
from keyqueue.tasks.canvas import step_request_id

if TYPE_CHECKING:
    import click
    from nats.aio.client import Client

    from keyqueue.app.application import App
    from keyqueue.app.worker import Worker
    from keyqueue.tasks.task import TaskRequest

__all__ = ["BATCH_MAX", "ENABLE_ENV", "FLUSH_AFTER", "SAMPLE_ENV", "enabled", "publish", "sample_rate", "sampled"]

log = logging.getLogger("keyqueue.events")

ENABLE_ENV: Final = "KEYQUEUE_EVENTS"
"""``0``, ``false``, ``no`` or ``off`` turns the events plugin off."""

SAMPLE_ENV: Final = "KEYQUEUE_EVENTS_SAMPLE"
"""Fraction (0 < f <= 1) of requests whose events are published; default 1 (all)."""

_HEADERS: Final = StaticHeaders(EVENT_HEADERS)
_BATCH_HEADERS: Final = StaticHeaders(EVENT_BATCH_HEADERS)

BATCH_MAX: Final = 64
"""Events of one key kept before they are sent together."""

FLUSH_AFTER: Final = 0.2
"""Seconds a key's first kept event waits at most before the key's events are sent."""

_RUNS_KEPT: Final = 10_000
"""Most attempt durations remembered (for the ``run`` of a ``dead_lettered`` event)."""


# --- switches --------------------------------------------------------------------------------------


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KEYQUEUE_EVENTS`` leaves the events plugin on (the default)."""
    value = (os.environ if environ is None else environ).get(ENABLE_ENV, "")
    return value.strip().lower() not in ("0", "false", "no", "off")


def sample_rate(environ: Mapping[str, str] | None = None) -> float:
    """The fraction of requests ``KEYQUEUE_EVENTS_SAMPLE`` keeps (1.0 when unset or invalid)."""
    raw = (os.environ if environ is None else environ).get(SAMPLE_ENV, "").strip()
    try:
        rate = float(raw) if raw else 1.0
    except ValueError:
        log.warning("%s=%r is not a number; publishing every event", SAMPLE_ENV, raw)
        return 1.0
    return min(1.0, rate) if rate > 0 else 1.0


def sampled(identity: str | None, rate: float) -> bool:
    """Whether the events of a request (or, without one, of a key) are kept at ``rate``.

    Decided by a hash of the id, so every process keeps or drops all of one request's events
    alike and the kept requests have complete histories.
    """
    return rate >= 1.0 or zlib.crc32((identity or "").encode()) % 10_000 < rate * 10_000


# --- the publisher ---------------------------------------------------------------------------------


class _AppEvents:
    """One app's event publisher: whether it is on, and which queues' streams exist."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.on = enabled()
        self.rate = sample_rate()
        self.ensured: set[str] = set()
        self._nc: tuple[asyncio.AbstractEventLoop, Client] | None = None
        self._kept: dict[tuple[str, str], list[dict[str, Any]]] = {}
        """(queue, key) -> its events not sent yet, in order; keys in the order of their first such event."""
        self._since: dict[tuple[str, str], float] = {}
        """(queue, key) -> when its first kept event was kept (monotonic seconds)."""
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Future[None] | None = None
        """The timer's send of every key's kept events, while it runs."""

    async def _connection(self) -> Client:
        loop = asyncio.get_running_loop()
        cached = self._nc
        if cached is not None and cached[0] is loop and cached[1].is_connected:
            return cached[1]
        nc = await self.app.connection()
        self._nc = (loop, nc)
        return nc

    async def ensure(self, nc: Client, queue: str) -> None:
        """Create the queue's events stream once; a failure is logged once, not retried per event."""
        self.ensured.add(queue)
        try:
            await ensure_events_stream(nc, queue)
        except Exception as exc:
            log.warning("events of queue %s may be lost: cannot check or create stream %s: %s: %s",
                        queue, events_stream(queue), type(exc).__name__, exc)

    async def publish(self, body: dict[str, Any]) -> None:
        await self.publish_many(body["queue"], [body])

    def publish_one(self, queue: str, body: dict[str, Any]) -> Awaitable[None] | None:
        """Keep an event already sampled with its key's others (:meth:`add`), on the path every request
        takes; returns the send to await when one is due (None: kept, nothing to await)."""
        if self._nc is None or queue not in self.ensured or self.app._eager is not None:
            return self.publish_many(queue, [body])
        return self.add(queue, body)

    def add(self, queue: str, body: dict[str, Any]) -> Awaitable[None] | None:
        """Keep ``body`` with the other events of its key; send them when the key is given back, when
        :data:`BATCH_MAX` wait, or :data:`FLUSH_AFTER` after the first (a queue-wide event: now).
        Returns the send to await when one is due: most events are only kept, with no coroutine."""
        key = body["key"]
        if key is None:
            return self._send(queue, None, [body])
        kept = self._kept.get((queue, key))
        if kept is None:
            kept = self._kept[queue, key] = []
            self._since[queue, key] = time.monotonic()
            if self._timer is None and self._flushing is None:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_AFTER, self._flush_soon)
        kept.append(body)
        if len(kept) >= BATCH_MAX or body["event"] == "released":
            del self._kept[queue, key], self._since[queue, key]
            return self._send(queue, key, kept)
        return None

    def _flush_soon(self) -> None:
        self._timer = None
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush_due())

    async def _flush_due(self) -> None:
        """Send the events of the keys whose first kept event is :data:`FLUSH_AFTER` old (the timer's
        task), then arm the timer for the next such key. Keys are kept in the order of their first
        event, so those are at the front; a key in the middle of a short session waits for its end."""
        try:
            now = time.monotonic()
            while self._kept:
                which = next(iter(self._kept))
                if now - self._since[which] < FLUSH_AFTER:
                    break
                bodies = self._kept.pop(which)
                del self._since[which]
                await self._send(which[0], which[1], bodies)
        finally:
            self._flushing = None
        if self._kept and self._timer is None:
            due = self._since[next(iter(self._kept))] + FLUSH_AFTER - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, due), self._flush_soon)

    async def close(self) -> None:
        """Send what is kept and stop the timer (the worker stops; nothing is kept after this)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flushing is not None:
            await asyncio.shield(self._flushing)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        kept, self._kept = self._kept, {}
        self._since.clear()
        for (queue, key), bodies in kept.items():
            await self._send(queue, key, bodies)

    async def _send(self, queue: str, key: str | None, bodies: list[dict[str, Any]]) -> None:
        """One message: a lone event as itself, several events of ``key`` as its batch, several
        events of several keys (``key`` None) as a batch across keys."""
        try:
            nc = await self._connection()
            if len(bodies) == 1:
                body = bodies[0]
                subject = f"kq.{queue}.events.{body['event']}" + ("" if key is None else f".{key}")
                # Plain by construction: cbor2 directly (keyqueue.wire.dumps would check it again).
                await publish_static(nc, subject, cbor2.dumps(body), _HEADERS)
            else:
                rows = _rows(bodies)
                await publish_static(nc, event_batch_subject(queue, key), cbor2.dumps(event_batch_body(rows)),
                                     _BATCH_HEADERS)
        except Exception as exc:  # telemetry must never fail the work
            log.debug("events of queue %s not published: %r", queue, exc)

    async def publish_many(self, queue: str, bodies: Sequence[dict[str, Any]]) -> None:
        """Publish events of one queue, in order (core publishes: no ack awaited): queue-wide ones
        each alone, those of one key as its batches, those of several keys as batches across keys."""
        if not self.on or self.app._eager is not None or not bodies:
            return
        try:
            nc = await self._connection()
            if queue not in self.ensured:
                await self.ensure(nc, queue)
        except Exception as exc:  # telemetry must never fail the work
            log.debug("events of queue %s not published: %r", queue, exc)
            return
        keyed: list[dict[str, Any]] = []
        for body in bodies:
            if self.rate < 1.0 and not sampled(body.get("request_id") or body.get("key"), self.rate):
                continue
            if body.get("key") is None:
                await self._send(queue, None, [body])
            else:
                keyed.append(body)
        keys = {body["key"] for body in keyed}
        for start in range(0, len(keyed), BATCH_MAX):
            events = keyed[start:start + BATCH_MAX]
            # Several keys (a bulk enqueue): batches across keys; one key's events (or a lone one) on its own subjects.
            await self._send(queue, None if len(keys) > 1 and len(events) > 1 else events[0]["key"], events)


_FIELDS_OF: Final = operator.itemgetter(*EVENT_FIELD_NAMES)


def _rows(bodies: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """Event bodies as rows of :data:`EVENT_FIELD_NAMES` values (a field a body lacks: None). A body
    made by this plugin has every field, and is read in one step."""
    try:
        return [list(_FIELDS_OF(body)) for body in bodies]
    except KeyError:
        return [[body.get(name) for name in EVENT_FIELD_NAMES] for body in bodies]


_APPS: weakref.WeakKeyDictionary[App, _AppEvents] = weakref.WeakKeyDictionary()
_RUNS: collections.OrderedDict[str, float] = collections.OrderedDict()
"""request id -> seconds its last attempt ran (read by the ``dead_lettered`` event)."""


def _of(app: App) -> _AppEvents:
    state = _APPS.get(app)
    if state is None:
        state = _APPS[app] = _AppEvents(app)
    return state


def _emit(worker: Worker, name: str, queue: str, key: str | None, request_id: str | None = None,
          task: str | None = None, attempt: int | None = None, wait: float | None = None,
          run: float | None = None, reason: str | None = None, fence: int | None = None,
          delay: float | None = None) -> Awaitable[None] | None:
    """Keep (or send) one event of a worker; returns the send to await when one is due. Not a
    coroutine: this runs several times per request, and most events are only kept."""
    state = _APPS.get(worker.app) or _of(worker.app)
    if state.on and (state.rate >= 1.0 or sampled(request_id or key, state.rate)):
        # event() with its checks, spelt out.
        return state.publish_one(queue, {"event": name, "ts": time.time(), "queue": queue, "key": key,
                                 "request_id": request_id, "task": task, "worker": worker.name, "attempt": attempt,
                                 "wait": wait, "run": run, "reason": reason, "triggers": None, "run_id": None,
                                 "fence": fence, "delay": delay})
    return None


async def publish(app: App, body: dict[str, Any]) -> None:
    """Publish one event body through ``app``'s publisher (what :func:`keyqueue.events.publish_event` calls)."""
    await _of(app).publish(body)


# --- enqueue ---------------------------------------------------------------------------------------


class _Enqueue:
    """Around one request's publish: an ``enqueued`` event once it is stored (not for duplicates).

    ``enqueue_many`` enters every request's wrapper before the publish and exits them in reverse;
    the events of one such batch are published together, in request order, when the last exits.
    """

    _open: weakref.WeakKeyDictionary[asyncio.Task[Any], list[tuple[TaskRequest, float, list[bool]]]] = (
        weakref.WeakKeyDictionary())

    def __init__(self, state: _AppEvents, request: TaskRequest) -> None:
        self.state = state
        self.request = request
        self.stored = [False]

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._open.setdefault(task, []).append((self.request, time.time(), self.stored))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        receipt = self.request.receipt
        if receipt is not None:
            self.stored[0] = not receipt.duplicate
        else:  # call(): no receipt, but a reply or a remote error means it was stored
            self.stored[0] = exc is None or isinstance(exc, TaskFailure | KeyqueueTimeout)
        task = asyncio.current_task()
        pending = self._open.get(task) if task is not None else None
        if not pending or pending[0][0] is not self.request:
            return  # an inner wrapper of a batch: the first request's wrapper publishes them all
        del self._open[task]  # type: ignore[arg-type]
        await self.state.publish_many(self.request.queue, [
            {"event": "enqueued", "ts": ts, "queue": request.queue, "key": request.key,
             "request_id": request.request_id, "task": request.message_type, "worker": None, "attempt": None,
             "wait": None, "run": None, "reason": None, "triggers": None, "run_id": None, "fence": None,
             "delay": None}
            for request, ts, stored in pending if stored[0]])


@hookimpl(trylast=True)
def keyqueue_wrap_enqueue(app: App, request: TaskRequest) -> _Enqueue | None:
    state = _of(app)
    if not state.on or app._eager is not None:
        return None
    return _Enqueue(state, request)


# --- processing ------------------------------------------------------------------------------------


@hookimpl(trylast=True)
def keyqueue_worker_started(worker: Worker) -> Any:
    state = _of(worker.app)
    if not state.on:
        return None

    async def ensure() -> None:
        for queue in worker.queues:
            if queue not in state.ensured:
                await state.ensure(await worker.app.connection(), queue)

    return ensure()


@hookimpl(trylast=True)
def keyqueue_worker_stopping(worker: Worker) -> Any:
    # Fires once the worker's hook calls are all made: send the events still kept, stop the timer.
    state = _APPS.get(worker.app)
    return None if state is None or not state.on else state.close()


@hookimpl(trylast=True)
@inline_observer
def keyqueue_key_acquired(worker: Worker, queue: str, key: str,
                          fencing: tuple[int, int]) -> Awaitable[None] | None:
    return _emit(worker, "acquired", queue, key, fence=fencing[0] or None)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_key_released(worker: Worker, queue: str, key: str, outcome: str) -> Awaitable[None] | None:
    return _emit(worker, "released", queue, key, reason=outcome)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_started(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                             attempt: int, enqueued_at: float | None) -> Awaitable[None] | None:
    # From the stored message's timestamp, never from the request id: a caller's own id, or a
    # backfill's hash, says nothing of when the request was stored.
    wait = max(0.0, time.time() - enqueued_at) if enqueued_at is not None else None
    return _emit(worker, "started", queue, key, request_id=request_id, task=message_type, attempt=attempt,
                 wait=wait)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_failed(request_id: str, elapsed: float) -> None:
    # Remembered for the run of a dead_lettered event, which follows the last failed attempt.
    _RUNS[request_id] = elapsed
    _RUNS.move_to_end(request_id)
    while len(_RUNS) > _RUNS_KEPT:
        _RUNS.popitem(last=False)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_retried(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                             attempt: int, delay: float, error: str) -> Awaitable[None] | None:
    return _emit(worker, "retried", queue, key, request_id=request_id, task=message_type, attempt=attempt,
                 reason=error, delay=delay)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_succeeded(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                               elapsed: float) -> Awaitable[None] | None:
    _RUNS.pop(request_id, None)
    return _emit(worker, "succeeded", queue, key, request_id=request_id, task=message_type, run=elapsed)


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_superseded(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                                superseded_by: str) -> Awaitable[None] | None:
    _RUNS.pop(request_id, None)
    return _emit(worker, "superseded", queue, key, request_id=request_id, task=message_type,
                 reason=superseded_reason(superseded_by))


@hookimpl(trylast=True)
@inline_observer
def keyqueue_request_dead_lettered(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                                   reason: str, attempts: int, error: str) -> Awaitable[None] | None:
    return _emit(worker, "dead_lettered", queue, key, request_id=request_id, task=message_type, attempt=attempts,
                 run=_RUNS.pop(request_id, None), reason=reason)


@hookimpl(trylast=True)
async def keyqueue_workflow_changed(app: App, queue: str, workflow_id: str, change: str, step: int | None,
                                    task: str | None, key: str | None, reason: str | None) -> None:
    # The workflow's id in run_id (what its steps share); its step's request id where one is concerned.
    request_id = step_request_id(workflow_id, step) if step is not None else None
    await _of(app).publish({"event": f"workflow_{change}", "ts": time.time(), "queue": queue, "key": key,
                            "request_id": request_id, "task": task, "worker": None, "attempt": None, "wait": None,
                            "run": None, "reason": reason, "triggers": None, "run_id": workflow_id, "fence": None,
                            "delay": None})


# --- keyqueue events tail --------------------------------------------------------------------------


@hookimpl(trylast=True)
def keyqueue_add_commands(cli: click.Group) -> None:
    from keyqueue.cli.events import events

    cli.add_command(events)
