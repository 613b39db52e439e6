"""``Worker``: an app's queues served from one process, with plugins, signals and drain.

::

    async with app.worker(concurrency=8) as worker:   # started: taking keys
        ...                                           # leaving the block drains and stops

    await app.worker().serve()                        # until SIGINT/SIGTERM (``keyqueue worker``)

A worker runs one core ``QueueWorker`` per queue on the app's connection, builds each key's
processor through ``keyqueue_build_processor``, and turns the sessions' lifecycle events into
hook calls. Events are delivered in order by one dispatcher task, so a failing hook never holds
up a key session and a slow one only when it falls far behind: once ``event_backlog`` events wait
for their hooks, key sessions wait before their next request (and new sessions before they open)
until the hooks catch up. No lifecycle hook is ever dropped, and the queue stays bounded (by
``event_backlog`` plus the few events each running session emits between two requests). The
dispatcher is drained before ``keyqueue_worker_stopping`` fires.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from keyqueue.core.processor import (
    BatchOutcome,
    KeyProcessor,
    ProcessorFactory,
    Reply,
    Request,
    RequestContext,
    SessionContext,
)
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import ConfigError, ConnectionFailed, KeyqueueError, LeaseLost
from keyqueue.jetstream.pull import PullOptions
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.app.application import App
    from keyqueue.tasks.task import AnyTask

__all__ = ["Worker"]

log = logging.getLogger("keyqueue.worker")

_LEDGER_SIZE: Final = 100_000
"""Most in-flight requests whose message type a worker remembers for its hooks."""

CONNECT_RETRY_FIRST: Final = 0.5
"""Seconds before a worker tries an unreachable server again at start (doubling)."""
CONNECT_RETRY_MAX: Final = 5.0
"""Longest wait, in seconds, between a starting worker's connection attempts."""

_EVENT_BACKLOG: Final = 10_000
"""Lifecycle events waiting for their hooks before key sessions wait for the hooks to catch up."""

_BACKLOG_WARN_INTERVAL: Final = 60.0
"""Seconds between two warnings that key sessions wait for slow hooks."""

_OUTCOMES: Final = {
    "released": "released",
    "handed-off": "handed-off",
    "lease_lost": "lease-lost",
    "session_failed": "failed",
    "interrupted": "interrupted",
}
"""Core session-ending events -> the ``outcome`` of ``keyqueue_key_released``."""

_HOOKED_EVENTS: Final = frozenset({"acquired", "pinned", "unpinned", "started", "failed", "retried", "succeeded",
                                   "dead_lettered", *_OUTCOMES})
"""Core events that become hook calls; the others (``contended``, ...) are not queued."""


@dataclasses.dataclass
class _Note:
    """What the worker learnt about a request while its processor had it."""

    message_type: str
    superseded_by: str | None = None


class Worker:
    """Serves an app's queues: one core ``QueueWorker`` per queue, plugins, and a clean stop."""

    def __init__(self, app: App, *, queues: Sequence[str] | None = None, concurrency: int = 16,
                 linger: float = 0.05, ack_wait: float | None = None, drain_timeout: float = 10.0,
                 name: str | None = None, overflow_min_pending: int = 0, overflow_min_ack_pending: int = 0,
                 priority: int | None = None, connect_timeout: float | None = None) -> None:
        if priority is not None and not 0 <= priority <= 9:
            raise ConfigError(f"priority must be 0-9 (0 is served first), got {priority}")
        self.pull = PullOptions(min_pending=overflow_min_pending, min_ack_pending=overflow_min_ack_pending,
                                priority=priority)
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {concurrency}")
        if linger < 0 or drain_timeout < 0:
            raise ConfigError("linger and drain_timeout must be >= 0 seconds")
        self.app = app
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.concurrency = concurrency
        self.linger = linger
        self.ack_wait = ack_wait
        self.drain_timeout = drain_timeout
        self.connect_timeout = connect_timeout
        """Seconds to wait for an unreachable server at start (None: forever)."""
        self._requested = list(queues) if queues is not None else None
        self.queue_workers: dict[str, QueueWorker] = {}
        self._tasks_by_queue: dict[str, dict[str, AnyTask]] = {}
        self.executor: ThreadPoolExecutor | None = None
        """Threads for sync task functions: one per slot, so none waits for a thread."""
        self.event_backlog = _EVENT_BACKLOG
        """Lifecycle events queued for hooks at which key sessions start waiting for them."""
        self.held_back = 0
        """Times a key session waited for slow hooks to catch up."""
        # Unbounded as a container (the core's event sink is sync and cannot wait), bounded by
        # back-pressure: see wait_for_hooks.
        self._events: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()
        self._warned_at = -_BACKLOG_WARN_INTERVAL
        self._ledger: collections.OrderedDict[str, _Note] = collections.OrderedDict()
        self._runner: asyncio.Task[None] | None = None
        self._unsubscribe: Any = None
        self._started = False
        self._stopped = False

    def __repr__(self) -> str:
        return f"<Worker {self.name} app={self.app.name} queues={self.queues}>"

    @property
    def events_waiting(self) -> int:
        """Lifecycle events not yet delivered to the hooks."""
        return self._events.qsize()

    @property
    def queues(self) -> list[str]:
        """The queues this worker serves."""
        return list(self.queue_workers) or list(self._requested or [])

    def queue_tasks(self, queue: str) -> Mapping[str, AnyTask]:
        """The tasks of ``queue`` as this worker serves them."""
        return self._tasks_by_queue.get(queue, {})

    # --- start and stop ---

    def _resolve_queues(self) -> list[str]:
        known = self.app.queues
        queues = self._requested if self._requested is not None else known
        unknown = [q for q in queues if q not in known]
        if unknown:
            raise ConfigError(f"app {self.app.name} has no tasks or processors for queue(s) {', '.join(unknown)}; "
                              f"its queues: {', '.join(known) or 'none'}")
        if not queues:
            raise ConfigError(f"app {self.app.name} has no tasks or processors to serve")
        return list(dict.fromkeys(queues))

    async def start(self) -> None:
        """Set up every queue and start taking keys; ``keyqueue_worker_started`` fires last."""
        if self._started:
            raise ConfigError("a Worker starts once; create another with app.worker()")
        self._started = True
        queues = self._resolve_queues()
        for queue in queues:
            self._tasks_by_queue[queue] = self.app.queue_tasks(queue)
        nc = await self._connect()
        self.executor = ThreadPoolExecutor(max_workers=self.concurrency * len(queues),
                                           thread_name_prefix=f"keyqueue-{self.app.name}")
        for queue in queues:
            config = self.app.queue_config(queue)
            if self.ack_wait is not None:
                config = dataclasses.replace(config, ack_wait=self.ack_wait)
            settings = SessionSettings(ack_wait=config.ack_wait, linger=self.linger, drain_timeout=self.drain_timeout)
            self.queue_workers[queue] = QueueWorker(nc, config, self._factory(queue), concurrency=self.concurrency,
                                                    settings=settings, name=self.name, on_event=self._on_event,
                                                    pull=self.pull)
        self._unsubscribe = self.app.on_reconnect(self._reconnected)
        self._runner = asyncio.create_task(self._run(), name=f"keyqueue-worker:{self.name}")
        started = asyncio.ensure_future(asyncio.gather(*(w.started() for w in self.queue_workers.values())))
        first: list[asyncio.Future[Any]] = [self._runner, started]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            try:
                await self._finish()  # the runner ended before every queue started: raise why
            finally:
                await self._release()
            raise KeyqueueError(f"worker {self.name} stopped while starting")
        await self.app.plugins.notify("keyqueue_worker_started", worker=self)

    async def _connect(self) -> Client:
        """The app's connection, waiting for the server while it is unreachable (services often
        start in the wrong order): each attempt is logged, the wait bounded by ``connect_timeout``."""
        began = time.monotonic()
        delay, attempt = CONNECT_RETRY_FIRST, 0
        while True:
            attempt += 1
            try:
                return await self.app.connection()
            except ConnectionFailed as e:
                waited = time.monotonic() - began
                if self.connect_timeout is not None and waited + delay > self.connect_timeout:
                    raise ConnectionFailed(f"{e} (gave up after {attempt} attempt(s) in {waited:.0f}s; "
                                           "--connect-timeout sets how long a worker waits)") from None
                log.warning("worker %s: %s; attempt %d, retrying in %.1fs", self.name, e, attempt, delay)
                await asyncio.sleep(delay)
                delay = min(CONNECT_RETRY_MAX, delay * 2)

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._dispatch(), name="keyqueue-events")
            try:
                async with asyncio.TaskGroup() as queues:
                    for queue, worker in self.queue_workers.items():
                        queues.create_task(worker.run(), name=f"queue:{queue}")
            finally:
                self._events.put_nowait(None)  # the dispatcher delivers what is queued, then ends

    async def _finish(self) -> None:
        """Wait for the runner; a failure inside it is raised as its first keyqueue error."""
        if self._runner is None:
            return
        try:
            await self._runner
        except BaseExceptionGroup as group:
            first = _first_leaf(group)
            if isinstance(first, Exception):
                raise first from None
            raise

    def request_stop(self, *, now: bool = False) -> None:
        """Stop taking keys and drain (``now``: cut requests in hand off; they run again elsewhere)."""
        for worker in self.queue_workers.values():
            worker.stop(now=now)

    async def stop(self, *, now: bool = False) -> None:
        """Drain and stop; ``keyqueue_worker_stopping`` fires once everything has ended."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        self.request_stop(now=now)
        try:
            await self._finish()
        finally:
            await self.app.plugins.notify("keyqueue_worker_stopping", worker=self, reverse=True)
            await self._release()

    async def _release(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown, wait=True)

    async def serve(self) -> None:
        """Start, run until SIGINT or SIGTERM, then drain and stop. A second signal stops at once."""
        await self.start()
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            name = signal.Signals(signum).name
            if signals == 1:
                log.warning("%s: draining (finishing requests in hand, up to %ss); send again to stop now",
                            name, self.drain_timeout)
                self.request_stop()
            else:
                log.warning("%s again: stopping now; requests in hand will run again elsewhere", name)
                self.request_stop(now=True)

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            assert self._runner is not None
            await asyncio.wait([self._runner])
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            await self.stop()

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def _reconnected(self) -> None:
        for worker in self.queue_workers.values():
            worker.reconnected()

    # --- processors ---

    def _factory(self, queue: str) -> ProcessorFactory:
        async def build(key: str) -> KeyProcessor:
            processor = await self.app.plugins.first("keyqueue_build_processor", app=self.app, worker=self,
                                                     queue=queue, key=key)
            if processor is None:
                raise ConfigError(f"no plugin built a processor for queue {queue!r} (key {key!r})")
            return _ObservedProcessor(processor, self, queue)

        return build

    def note(self, request: Request) -> None:
        """Remember a request's message type while it is processed (for the lifecycle hooks)."""
        if request.request_id in self._ledger:
            return  # a retry
        message_type = next((v for k, v in request.headers.items() if k.lower() == H.MESSAGE_TYPE.lower()), "")
        self._ledger[request.request_id] = _Note(message_type)
        while len(self._ledger) > _LEDGER_SIZE:
            self._ledger.popitem(last=False)  # notes of requests whose outcome never came (lost keys)

    def superseded(self, request_id: str, by: str) -> None:
        note = self._ledger.get(request_id)
        if note is not None:
            note.superseded_by = by

    # --- events -> hooks ---

    def _on_event(self, event: str, fields: dict[str, Any]) -> None:
        """The core's event sink (sync): queue the event for the dispatcher, if a hook takes it."""
        if event in _HOOKED_EVENTS:
            self._queue(event, fields)

    def failed(self, queue: str, key: str, request_id: str, attempt: int, error: BaseException) -> None:
        """An attempt raised (reported by the observing processor)."""
        self._queue("failed", {"queue": queue, "key": key, "request_id": request_id, "attempt": attempt,
                               "error": error})

    def _queue(self, event: str, fields: dict[str, Any]) -> None:
        self._events.put_nowait((event, fields))
        if self._events.qsize() >= self.event_backlog:
            self._room.clear()

    async def wait_for_hooks(self) -> None:
        """Back-pressure: wait while ``event_backlog`` events wait for their hooks.

        Key sessions call it before each attempt and before they open, so a burst of events
        cannot outgrow memory and no hook call is dropped; the price is that slow hooks slow the
        worker down. (A hook must therefore never wait for a request this worker processes.)
        """
        if self._room.is_set():
            return
        self.held_back += 1
        now = time.monotonic()
        if now - self._warned_at >= _BACKLOG_WARN_INTERVAL:
            self._warned_at = now
            log.warning("worker %s: %d lifecycle events wait for their hooks; key sessions wait for the hooks "
                        "to catch up (a hook is slow)", self.name, self._events.qsize())
        await self._room.wait()

    async def _dispatch(self) -> None:
        try:
            await self._deliver_events()
        finally:
            self._room.set()  # nothing may wait for a dispatcher that has ended

    async def _deliver_events(self) -> None:
        while (item := await self._events.get()) is not None:
            if self._events.qsize() < self.event_backlog:
                self._room.set()
            event, fields = item
            call = self._hook_call(event, fields)
            if call is not None:
                hook, reverse, kwargs = call
                await self.app.plugins.notify(hook, reverse=reverse, worker=self, **kwargs)

    def _hook_call(self, event: str, fields: dict[str, Any]) -> tuple[str, bool, dict[str, Any]] | None:
        base = {"queue": fields.get("queue", ""), "key": fields.get("key", "")}
        request_id = str(fields.get("request_id", ""))
        if event == "acquired":
            fencing = fields.get("fencing") or (0, 0)
            return "keyqueue_key_acquired", False, {**base, "fencing": (int(fencing[0]), int(fencing[1]))}
        if event in _OUTCOMES:
            return "keyqueue_key_released", True, {**base, "outcome": _OUTCOMES[event]}
        if event in ("pinned", "unpinned"):
            queue = {"queue": base["queue"], "pin_id": str(fields.get("pin_id", ""))}
            return f"keyqueue_worker_{event}", event == "unpinned", queue
        if event not in ("started", "failed", "retried", "succeeded", "dead_lettered"):
            return None
        final = event in ("succeeded", "dead_lettered")
        note = self._ledger.pop(request_id, None) if final else self._ledger.get(request_id)
        request = {**base, "request_id": request_id, "message_type": note.message_type if note else ""}
        if event == "started":
            return "keyqueue_request_started", False, {**request, "attempt": int(fields.get("attempt", 1))}
        if event == "failed":
            return "keyqueue_request_failed", True, {**request, "attempt": fields["attempt"], "error": fields["error"]}
        if event == "retried":
            return "keyqueue_request_retried", True, {**request, "attempt": int(fields.get("attempt", 1)),
                                                      "delay": float(fields.get("delay", 0.0)),
                                                      "error": str(fields.get("error", ""))}
        if event == "dead_lettered":
            return "keyqueue_request_dead_lettered", True, {**request, "reason": str(fields.get("reason", "")),
                                                            "attempts": int(fields.get("attempts", 0)),
                                                            "error": str(fields.get("error", ""))}
        if note is not None and note.superseded_by is not None:
            return "keyqueue_request_superseded", True, {**request, "superseded_by": note.superseded_by}
        return "keyqueue_request_succeeded", True, {**request, "elapsed": float(fields.get("elapsed", 0.0))}


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


class _ObservedProcessor:
    """Wraps every processor: ``keyqueue_wrap_process`` around each attempt, notes for the hooks."""

    def __init__(self, inner: KeyProcessor, worker: Worker, queue: str) -> None:
        self.inner = inner
        self.worker = worker
        self.queue = queue

    @property
    def batch_size(self) -> int:
        return int(getattr(self.inner, "batch_size", 0))

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.inner.batch_size = value

    async def open(self, ctx: SessionContext) -> None:
        await self.worker.wait_for_hooks()
        await self.inner.open(ctx)

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        [reply] = await self._attempt(ctx, [request], batch=False)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        return await self._attempt(ctx, requests, batch=True)

    async def _attempt(self, ctx: RequestContext, requests: list[Request], *,
                       batch: bool) -> Sequence[BatchOutcome]:
        await self.worker.wait_for_hooks()
        for request in requests:
            self.worker.note(request)
        try:
            async with AsyncExitStack() as stack:
                await self.worker.app.plugins.enter_wrappers(stack, "keyqueue_wrap_process", queue=self.queue,
                                                             key=ctx.key, requests=requests, context=ctx)
                if batch:
                    replies = await self.inner.handle_batch(ctx, requests)
                else:
                    replies = [await self.inner.handle(ctx, requests[0])]
        except LeaseLost:
            raise
        except Exception as exc:
            self.worker.failed(self.queue, ctx.key, requests[0].request_id, ctx.attempt, exc)
            raise
        for request, reply in zip(requests, replies, strict=False):
            if isinstance(reply, Reply) and reply.headers.get(H.STATUS) == H.STATUS_SUPERSEDED:
                self.worker.superseded(request.request_id, reply.headers.get(H.SUPERSEDED_BY, ""))
        return replies

    async def idle(self, ctx: SessionContext) -> None:
        await self.inner.idle(ctx)

    async def close(self, ctx: SessionContext, reason: str) -> None:
        await self.inner.close(ctx, reason)

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        return self.inner.retry_policy(request)
