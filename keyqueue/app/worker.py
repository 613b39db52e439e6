"""``Worker``: an app's queues served from one process, with plugins, signals and drain.

::

    async with app.worker(concurrency=8) as worker:   # started: taking keys
        ...                                           # leaving the block drains and stops

    await app.worker().serve()                        # until SIGINT/SIGTERM (``keyqueue worker``)

A worker runs one core ``QueueWorker`` per queue on the app's connection (with an unkeyed lane
beside its key sessions when the queue has unkeyed tasks: ``keyqueue.core.unkeyed``), builds each
key's processor through ``keyqueue_build_processor`` (and the lane's, for the key ``~``), and is
the observer of every key session and lane
(``keyqueue.core.observer.SessionObserver``): each step a session reports becomes one lifecycle
hook call (none when no plugin implements the hook), and each attempt runs inside the
``keyqueue_wrap_process`` wrappers. The hook's inline observers (``keyqueue.inline_observer``:
plain functions that only count or keep) are called at the step; the call of the others is
queued and made in order by one dispatcher task, so a failing hook never holds up a key session
and a slow one only when it falls far behind: once ``event_backlog`` calls wait for their hooks,
key sessions wait before their next request (and new sessions before they open) until the hooks
catch up. No lifecycle hook is ever dropped, and the queue stays bounded (by ``event_backlog``
plus the few calls each running session queues between two requests). The dispatcher is drained
before ``keyqueue_worker_stopping`` fires.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from keyqueue.app.application import shared_tasks_elsewhere
from keyqueue.app.heartbeat import INTERVAL as HEARTBEAT_INTERVAL
from keyqueue.app.heartbeat import Heartbeat, queue_role
from keyqueue.app.process_pool import POOLS, ProcessPool
from keyqueue.app.schedules import ScheduleKeeper
from keyqueue.core.observer import KeyHold, Outcome, RequestAttempt, SessionEnd, describe
from keyqueue.core.processor import KeyProcessor, ProcessorFactory, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import ConfigError, ConnectionClosed, ConnectionFailed, KeyqueueError
from keyqueue.jetstream.api import stored_seconds
from keyqueue.jetstream.connect import link_of
from keyqueue.jetstream.pull import PullOptions
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.plugins.manager import Observers

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.app.application import App
    from keyqueue.tasks.task import AnyTask

__all__ = ["Worker"]

log = logging.getLogger("keyqueue.worker")

CONNECT_RETRY_FIRST: Final = 0.5
"""Seconds before a worker tries an unreachable server again at start (doubling)."""
CONNECT_RETRY_MAX: Final = 5.0
"""Longest wait, in seconds, between a starting worker's connection attempts."""

_EVENT_BACKLOG: Final = 10_000
"""Lifecycle hook calls waiting to be made before key sessions wait for the hooks to catch up."""

_BACKLOG_WARN_INTERVAL: Final = 60.0
"""Seconds between two warnings that key sessions wait for slow hooks."""

_NOT_WRAPPED: Final = contextlib.nullcontext()
"""What an attempt is wrapped in when no plugin wraps it."""

HookCall = Callable[[], Awaitable[None]]
"""One lifecycle hook call, bound to its arguments, waiting for the dispatcher."""


class _HookCalls:
    """Lifecycle hook calls waiting for the dispatcher, in order: a deque and one waiter.

    What ``asyncio.Queue`` does here, without its fifteen or so Python calls per put and get
    (several events per request: the largest single item of a cold key's product-path CPU after
    the session itself, docs/benchmarks.md)."""

    __slots__ = ("_calls", "_waiter")

    def __init__(self) -> None:
        self._calls: collections.deque[HookCall | None] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._calls)

    def put_nowait(self, call: HookCall | None) -> None:
        self._calls.append(call)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> HookCall | None:
        """The oldest call; raises ``IndexError`` if there is none."""
        return self._calls.popleft()

    async def wait(self) -> None:
        """Return once a call is waiting (at once if one is)."""
        while not self._calls:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


class Worker:
    """Serves an app's queues: one core ``QueueWorker`` per queue, plugins, and a clean stop.

    A processor built by ``keyqueue_build_processor`` finds what the worker serves in public
    members: :meth:`queue_tasks` (a queue's tasks), :meth:`unkeyed_tasks` (those its unkeyed lane
    runs) and :attr:`executor` (the threads for sync task functions); the default processor
    (``keyqueue.builtins.processor``) uses them.
    """

    def __init__(self, app: App, *, queues: Sequence[str] | None = None, concurrency: int = 16,
                 linger: float = 0.05, ack_wait: float | None = None, drain_timeout: float = 10.0,
                 name: str | None = None, overflow_min_pending: int = 0, overflow_min_ack_pending: int = 0,
                 priority: int | None = None, connect_timeout: float | None = None, watchdog: bool = False,
                 sync_pool: str = "threads", app_spec: str | None = None) -> None:
        if sync_pool not in POOLS:
            raise ConfigError(f"sync_pool must be one of {', '.join(POOLS)}, not {sync_pool!r}")
        if sync_pool == "processes" and not app_spec:
            raise ConfigError("the process pool imports the app in each child: give app_spec='MODULE:APP' "
                              "(keyqueue worker MODULE:APP --pool processes does)")
        self.sync_pool = sync_pool
        self.app_spec = app_spec
        self.process_pool: ProcessPool | None = None
        """With ``sync_pool="processes"``: the children that run serial sync tasks (``keyqueue.app.process_pool``)."""
        if priority is not None and not 0 <= priority <= 9:
            raise ConfigError(f"priority must be 0-9 (0 is served first), got {priority}")
        self.pull = PullOptions(min_pending=overflow_min_pending, min_ack_pending=overflow_min_ack_pending,
                                priority=priority)
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {concurrency}")
        if linger < 0 or drain_timeout < 0:
            raise ConfigError("linger and drain_timeout must be >= 0 seconds")
        self.app = app
        self.plugins = app.plugins
        """The app's plugin manager (read once: the sessions' steps look up their hooks in it)."""
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.concurrency = concurrency
        self.linger = linger
        self.ack_wait = ack_wait
        self.drain_timeout = drain_timeout
        self.connect_timeout = connect_timeout
        """Seconds to wait for an unreachable server at start (None: forever)."""
        self.watchdog = watchdog
        """End this process before a blocked event loop outlives a lease (``keyqueue.core.watchdog``)."""
        self._requested = list(queues) if queues is not None else None
        self.queue_workers: dict[str, QueueWorker] = {}
        self._tasks_by_queue: dict[str, dict[str, AnyTask]] = {}
        self._unkeyed_by_queue: dict[str, dict[str, AnyTask]] = {}
        self.executor: ThreadPoolExecutor | None = None
        """Threads for sync task functions: one per slot, so none waits for a thread."""
        self.event_backlog = _EVENT_BACKLOG
        """Lifecycle events queued for hooks at which key sessions start waiting for them."""
        self.held_back = 0
        """Times a key session waited for slow hooks to catch up."""
        # Unbounded as a container (a session's notifications are sync and cannot wait), bounded
        # by back-pressure: see wait_for_room.
        self._events = _HookCalls()
        self._room = asyncio.Event()
        self._room.set()
        self._full = False
        """Whether ``event_backlog`` calls wait (``_room`` is clear), kept apart from the event
        so that the path of every event reads a field, not a method."""
        self._warned_at = -_BACKLOG_WARN_INTERVAL
        self._attempt_began: dict[tuple[str, str, str], float] = {}
        """(queue, key, "") -> when the key's current attempt began, for ``keyqueue_request_failed``; an
        unkeyed request's, which run side by side, by (queue, ``~``, request id)."""
        self._runner: asyncio.Task[None] | None = None
        self._unsubscribe: Any = None
        self._started = False
        self._stopped = False
        self._stop_asked = asyncio.Event()
        """Set by the first SIGINT/SIGTERM :meth:`serve` receives."""
        self.schedules: ScheduleKeeper | None = None
        """Its queues' schedules: periodic ones kept on the server, due requests moved (once started)."""
        self.heartbeat_interval = HEARTBEAT_INTERVAL
        """Seconds between this worker's heartbeat records (``keyqueue.app.heartbeat``); 0 writes none."""
        self.heartbeat: Heartbeat | None = None
        self.connection_lost: ConnectionClosed | None = None
        """Set when the connection was closed for good under the worker (it then stopped at once, and
        :meth:`stop`, or :meth:`serve`, raises it)."""

    def __repr__(self) -> str:
        return f"<Worker {self.name} app={self.app.name} queues={self.queues}>"

    @property
    def events_waiting(self) -> int:
        """Lifecycle hook calls not yet made."""
        return len(self._events)

    @property
    def queues(self) -> list[str]:
        """The queues this worker serves."""
        return list(self.queue_workers) or list(self._requested or [])

    def queue_tasks(self, queue: str) -> Mapping[str, AnyTask]:
        """The tasks of ``queue`` as this worker serves them (its key sessions: every one, so a request
        stored under a key before its task lost the key still runs)."""
        return self._tasks_by_queue.get(queue, {})

    def unkeyed_tasks(self, queue: str) -> Mapping[str, AnyTask]:
        """The unkeyed tasks the unkeyed lane of ``queue`` runs (none: the queue has no lane)."""
        return self._unkeyed_by_queue.get(queue, {})

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

    def _warn_of_shared_tasks_elsewhere(self, queue: str) -> None:
        """Name the ``@keyqueue.task`` tasks of ``queue`` that belong to another app: this worker
        would dead-letter their requests (``UnknownMessageType``) whenever it takes their keys."""
        elsewhere = shared_tasks_elsewhere(self.app, queue)
        if elsewhere:
            names = ", ".join(f"{task.name} (on {where})" for task, where in elsewhere)
            log.warning("queue %s: @keyqueue.task tasks %s belong to another app, not to app %s, so this worker "
                        "dead-letters their requests (UnknownMessageType) whenever it takes their keys: serve the "
                        "queue with a worker of the app they belong to, or declare them on app %s with @app.task "
                        "(docs/decisions.md, \"Which app a shared task belongs to\")",
                        queue, names, self.app.name, self.app.name)

    async def start(self) -> None:
        """Set up every queue and start taking keys; ``keyqueue_worker_started`` fires last."""
        if self._started:
            raise ConfigError("a Worker starts once; create another with app.worker()")
        queues = self._resolve_queues()  # a worker that cannot serve what it was asked never started
        for queue in queues:
            self._tasks_by_queue[queue] = self.app.queue_tasks(queue)
            self._warn_of_shared_tasks_elsewhere(queue)
            if self.app.processor_factory(queue) is None and (unkeyed := self.app.unkeyed_tasks(queue)):
                self._unkeyed_by_queue[queue] = unkeyed
        self._started = True
        nc = await self._connect()
        # Delayed and periodic requests: the schedules streams, the app's periodic schedules kept on
        # the server, and the movers of due requests (keyqueue.app.schedules).
        self.schedules = ScheduleKeeper(nc, [self.app.queue_config(q) for q in queues],
                                        [p for p in self.app.periodics.values() if p.queue in queues], self.name)
        await self.schedules.start()
        # One thread (or pool child) per slot, so none waits for one: each queue's key sessions and
        # its unkeyed lane have ``concurrency`` slots each.
        slots = self.concurrency * (len(queues) + len(self._unkeyed_by_queue))
        self.executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix=f"keyqueue-{self.app.name}")
        if self.sync_pool == "processes":
            assert self.app_spec is not None
            self.process_pool = ProcessPool(self.app_spec, slots)
        for queue in queues:
            config = self.app.queue_config(queue)
            if self.ack_wait is not None:
                config = dataclasses.replace(config, ack_wait=self.ack_wait)
            settings = SessionSettings(ack_wait=config.ack_wait, linger=self.linger, drain_timeout=self.drain_timeout)
            # Without a lease of its own the worker holds keys for the queue's, as the server has it.
            self.queue_workers[queue] = QueueWorker(nc, config, self._factory(queue), concurrency=self.concurrency,
                                                    settings=settings, name=self.name, observer=self,
                                                    pull=self.pull, follow_lease=self.ack_wait is None,
                                                    watchdog=self.watchdog,
                                                    unkeyed=self._factory(queue) if queue in self._unkeyed_by_queue
                                                    else None)
        self._unsubscribe = self.app.on_reconnect(self._reconnected)
        self._runner = asyncio.create_task(self._run(nc), name=f"keyqueue-worker:{self.name}")
        started = asyncio.ensure_future(asyncio.gather(*(w.started() for w in self.queue_workers.values())))
        first: list[asyncio.Future[Any]] = [self._runner, started]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not _succeeded(started):
            started.cancel()
            try:
                await self._finish()  # the runner ended before every queue started: raise why
            finally:
                await self._release()
            raise KeyqueueError(f"worker {self.name} stopped while starting")
        if self.heartbeat_interval > 0:
            self.heartbeat = Heartbeat(nc, self.name, {q: self.concurrency for q in self.queue_workers},
                                       lambda queue: len(self.queue_workers[queue].sessions),
                                       interval=self.heartbeat_interval,
                                       role=lambda queue: queue_role(self.queue_workers[queue]))
            self.heartbeat.start()
        await self.app.plugins.lifecycle.worker_started(worker=self)

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
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._stop_asked.wait()
                if self._stop_asked.is_set():
                    raise _StoppedWhileStarting from None
                delay = min(CONNECT_RETRY_MAX, delay * 2)

    async def _run(self, nc: Client) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._dispatch(), name="keyqueue-events")
            watch = group.create_task(self._stop_if_closed(nc), name="keyqueue-connection")
            if self.schedules is not None:
                group.create_task(self.schedules.run(), name="keyqueue-schedules")
            try:
                async with asyncio.TaskGroup() as queues:
                    for queue, worker in self.queue_workers.items():
                        queues.create_task(worker.run(), name=f"queue:{queue}")
            finally:
                watch.cancel()
                self._events.put_nowait(None)  # the dispatcher delivers what is queued, then ends
                if self.schedules is not None:
                    self.schedules.stop()

    async def _finish(self) -> None:
        """Wait for the runner; a failure inside it is raised as its first keyqueue error, and a
        connection closed for good as :class:`~keyqueue.errors.ConnectionClosed`."""
        if self._runner is None:
            return
        try:
            await self._runner
        except BaseExceptionGroup as group:
            first = _first_leaf(group)
            if isinstance(first, Exception):
                raise first from None
            raise
        if self.connection_lost is not None:
            raise self.connection_lost

    async def _stop_if_closed(self, nc: Client) -> None:
        """A connection closed for good under the worker (the server refused it: a protocol error,
        revoked credentials) never comes back, so nothing can be done on it: log why at ERROR and
        stop at once (requests in hand run again elsewhere once their leases end). :meth:`serve`
        then raises it, and ``keyqueue worker`` exits with status 1 for its supervisor to restart it."""
        link = link_of(nc)
        if link is None:
            return
        await link.until_closed()
        if link.closed_by_owner:
            return
        cause = f"{type(link.cause).__name__}: {link.cause}" if link.cause is not None else "no error reported"
        self.connection_lost = ConnectionClosed(
            f"worker {self.name}: the connection to NATS was closed for good ({cause}); the worker stopped. "
            "Check the server's log and this worker's credentials, then start it again (a supervisor "
            "restarts it)", link.cause)
        log.error("%s", self.connection_lost)
        self.request_stop(now=True)

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
            if self.heartbeat is not None:
                await self.heartbeat.stop()
            await self.app.plugins.lifecycle.worker_stopping(worker=self)
            await self._release()

    async def _release(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown, wait=True)
        if self.process_pool is not None:
            await asyncio.to_thread(self.process_pool.close)

    async def serve(self) -> None:
        """Start, run until SIGINT or SIGTERM, then drain and stop. A second signal stops at once.

        The signals are handled from the first moment: one that arrives while the worker waits for
        its server ends the wait, one that arrives while its queues start drains them once started.
        """
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            name = signal.Signals(signum).name
            self._stop_asked.set()
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
            try:
                await self.start()
            except _StoppedWhileStarting:
                log.warning("worker %s: stopped while waiting for the server", self.name)
                return
            if self._stop_asked.is_set():
                self.request_stop(now=signals > 1)  # asked while the queues were starting
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
            processor: KeyProcessor | None = await self.app.plugins.first(
                "keyqueue_build_processor", app=self.app, worker=self, queue=queue, key=key)
            if processor is None:
                raise ConfigError(f"no plugin built a processor for queue {queue!r} (key {key!r})")
            return processor

        return build

    # --- the sessions' steps -> hook calls (keyqueue.core.observer.SessionObserver) ---

    # Each step is told only if some plugin implements its hook: a step nobody observes costs a
    # lookup (PluginManager.observers is cached until plugins change). Inline observers
    # (keyqueue.inline_observer: the built-in events, the OpenTelemetry and Prometheus metrics) are
    # called at once; the others are queued for the dispatcher.

    def _tell(self, observers: Observers, /, **kwargs: Any) -> None:
        """Tell a step to its hook's observers: the inline ones now (an awaitable one returns is
        queued for the dispatcher), the others queued, in their order, as one call."""
        for impl in observers.inline:
            try:
                result = impl.function(*map(kwargs.__getitem__, impl.argnames))
            except Exception:
                log.exception("plugin %s failed in %s; carrying on", impl.plugin_name, observers.hook_name)
                continue
            if result is not None and inspect.isawaitable(result):
                self._queue(functools.partial(_awaited, result, impl.plugin_name, observers.hook_name))
        if observers.queued:
            self._queue(functools.partial(self.plugins.notify_each, observers.hook_name, observers.queued, kwargs))

    def token_received(self, queue: str, key: str, delivered: int) -> None:
        return None  # no hook: a token is a hint; key_acquired says who works on the key

    def key_acquired(self, hold: KeyHold) -> None:
        observers = self.plugins.observers("keyqueue_key_acquired")
        if observers is not None:
            self._tell(observers, worker=self, queue=hold.queue, key=hold.key, fencing=hold.fencing)

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        self._attempt_began.pop((hold.queue, hold.key, ""), None)
        if end.outcome is Outcome.CONTENDED:
            return  # never acquired: no keyqueue_key_acquired to close
        observers = self.plugins.observers("keyqueue_key_released", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=hold.queue, key=hold.key, outcome=end.outcome.value)

    def request_started(self, attempt: RequestAttempt) -> None:
        # When the attempt began, for keyqueue_request_failed's elapsed (a session runs one attempt at a time).
        self._attempt_began[_began(attempt)] = time.monotonic()
        observers = self.plugins.observers("keyqueue_request_started")
        if observers is not None:
            self._tell(observers, worker=self, queue=attempt.queue, key=attempt.key, request_id=attempt.request_id,
                       message_type=attempt.message_type, attempt=attempt.attempt,
                       enqueued_at=stored_seconds(attempt.stored_at))

    def attempt_failed(self, attempt: RequestAttempt, error: BaseException) -> None:
        began = self._attempt_began.get(_began(attempt))
        elapsed = max(0.0, time.monotonic() - began) if began is not None else 0.0
        observers = self.plugins.observers("keyqueue_request_failed", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=attempt.queue, key=attempt.key, request_id=attempt.request_id,
                       message_type=attempt.message_type, attempt=attempt.attempt, error=error, elapsed=elapsed)

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        observers = self.plugins.observers("keyqueue_request_retried", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=attempt.queue, key=attempt.key, request_id=attempt.request_id,
                       message_type=attempt.message_type, attempt=attempt.attempt, delay=delay,
                       error=describe(error))

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        if request.key == UNKEYED:
            self._attempt_began.pop(_began(request), None)
        if superseded_by is not None:
            observers = self.plugins.observers("keyqueue_request_superseded", reverse=True)
            if observers is not None:
                self._tell(observers, worker=self, queue=request.queue, key=request.key,
                           request_id=request.request_id, message_type=request.message_type,
                           superseded_by=superseded_by)
            return
        observers = self.plugins.observers("keyqueue_request_succeeded", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=request.queue, key=request.key, request_id=request.request_id,
                       message_type=request.message_type, elapsed=elapsed)

    def request_dead_lettered(self, request: RequestAttempt, reason: str, error: BaseException) -> None:
        if request.key == UNKEYED:
            self._attempt_began.pop(_began(request), None)
        observers = self.plugins.observers("keyqueue_request_dead_lettered", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=request.queue, key=request.key, request_id=request.request_id,
                       message_type=request.message_type, reason=reason, attempts=request.attempt,
                       error=describe(error))

    def worker_pinned(self, queue: str, pin_id: str) -> None:
        observers = self.plugins.observers("keyqueue_worker_pinned")
        if observers is not None:
            self._tell(observers, worker=self, queue=queue, pin_id=pin_id)

    def worker_unpinned(self, queue: str, pin_id: str) -> None:
        observers = self.plugins.observers("keyqueue_worker_unpinned", reverse=True)
        if observers is not None:
            self._tell(observers, worker=self, queue=queue, pin_id=pin_id)

    def around_attempt(self, attempt: RequestAttempt, context: RequestContext,
                       requests: Sequence[Request]) -> AbstractAsyncContextManager[object]:
        """The ``keyqueue_wrap_process`` wrappers, entered in call order and exited in reverse."""
        plugins = self.plugins
        if not plugins.implementations("keyqueue_wrap_process"):
            return _NOT_WRAPPED
        wrappers = plugins.wrappers("keyqueue_wrap_process", queue=attempt.queue, key=attempt.key,
                                    requests=requests, context=context)
        return self._wrapped(wrappers) if wrappers else _NOT_WRAPPED

    @contextlib.asynccontextmanager
    async def _wrapped(self, wrappers: list[Any]) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            await self.app.plugins.enter_each(stack, "keyqueue_wrap_process", wrappers)
            yield

    def _queue(self, call: HookCall) -> None:
        events = self._events
        events.put_nowait(call)
        if not self._full and len(events) >= self.event_backlog:
            self._full = True
            self._room.clear()

    async def wait_for_room(self) -> None:
        """Back-pressure: wait while ``event_backlog`` hook calls wait to be made.

        Key sessions call it before each attempt and before they open, so a burst of steps
        cannot outgrow memory and no hook call is dropped; the price is that slow hooks slow the
        worker down. (A hook must therefore never wait for a request this worker processes.)
        """
        if not self._full:
            return
        self.held_back += 1
        now = time.monotonic()
        if now - self._warned_at >= _BACKLOG_WARN_INTERVAL:
            self._warned_at = now
            log.warning("worker %s: %d lifecycle events wait for their hooks; key sessions wait for the hooks "
                        "to catch up (a hook is slow)", self.name, len(self._events))
        await self._room.wait()

    async def _dispatch(self) -> None:
        events = self._events
        try:
            while True:
                if not events:
                    await events.wait()
                call = events.get_nowait()
                if call is None:
                    return
                if self._full and len(events) < self.event_backlog:
                    self._full = False
                    self._room.set()
                await call()
        finally:
            self._full = False
            self._room.set()  # nothing may wait for a dispatcher that has ended


async def _awaited(result: Awaitable[Any], plugin_name: str, hook_name: str) -> None:
    """Await what an inline observer returned (the dispatcher does, in order); never raises."""
    try:
        await result
    except Exception:
        log.exception("plugin %s failed in %s; carrying on", plugin_name, hook_name)


def _began(attempt: RequestAttempt) -> tuple[str, str, str]:
    """Where :attr:`Worker._attempt_began` keeps when ``attempt`` began."""
    return attempt.queue, attempt.key, attempt.request_id if attempt.key == UNKEYED else ""


def _succeeded(future: asyncio.Future[Any]) -> bool:
    """Whether ``future`` is done without an error. Its error is retrieved (so asyncio never logs
    it as unretrieved): a queue that could not start also ends the runner, which raises it."""
    return future.done() and not future.cancelled() and future.exception() is None


class _StoppedWhileStarting(Exception):
    """A signal asked the worker to stop before it reached its server."""


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
