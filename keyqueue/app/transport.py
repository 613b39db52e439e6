"""How an app's requests reach NATS: a connection per event loop, and replies.

``Transport`` is where an app's requests go: ``NatsTransport`` here, or the in-process runner of
``keyqueue.testing.eager``.

An ``App`` may be used from several event loops (pytest gives each test its own; ``delay`` runs
on a private loop in a thread, ``keyqueue.app.portal``), and a nats-py connection belongs to the loop that made it, so
``Connections`` keeps one per loop, made on first use. Each has one wildcard subscription that
routes every ``call``'s reply to its waiter, and remembers the queues whose streams it has
ensured.

A loop's connection ends with the loop: ``asyncio.run`` (a script's, or a framework's loop per
request) finalizes the loop's async generators before it closes the loop, and one of them,
started with the connection, closes it then and drops it from the map. A loop closed without
that step (``loop.close()`` alone) has its connection dropped the next time the app connects on
any loop, so the socket is freed with it rather than kept for the life of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, overload

from keyqueue.app.cancel import CancelWatch, request_cancel
from keyqueue.app.progress import read_progress
from keyqueue.app.status import request_status
from keyqueue.errors import (
    ConnectionFailed,
    EnqueueError,
    KeyqueueError,
    KeyqueueTimeout,
    PayloadTooLarge,
)
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.dlq_copy import DLQ_HEADROOM
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.schedules import ScheduleStore
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.jetstream.workflows import WorkflowStore, existing_store
from keyqueue.settings import Settings
from keyqueue.tasks.task import Receipt, TaskRequest
from keyqueue.wire import header_block_size
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from keyqueue.tasks.context import Progress

log = logging.getLogger("keyqueue.app")

__all__ = ["Connections", "LoopConnection", "NatsTransport", "ReplyRouter", "Transport", "open_connection"]


Reply = tuple[Mapping[str, str], bytes]
"""A reply's headers and body."""


class Transport(Protocol):
    """Where an app's requests go: NATS (``NatsTransport``) or the in-process runner (``keyqueue.testing``)."""

    async def enqueue(self, requests: Sequence[TaskRequest]) -> list[Receipt | EnqueueError]:
        """Store the requests in order; one receipt or error per request."""

    async def call(self, request: TaskRequest, timeout: float) -> Reply:
        """Store the request and wait for its reply: ``(headers, body)``; ``KeyqueueTimeout`` if none."""

    async def kept_result(self, queue: str, request_id: str, timeout: float) -> Reply | None:
        """The kept reply of a request (waiting up to ``timeout`` seconds for it), an expired one's
        headers without ``X-KQ-Status``, or None if none came."""

    async def cancel(self, queue: str, request_id: str, seq: int | None, wait: float,
                     key: str | None = None) -> str:
        """Ask for the request to be cancelled; its state: ``cancelled``, ``pending``, ``running``,
        ``done`` or ``unknown`` (see ``keyqueue.app.cancel``)."""

    async def status(self, queue: str, request_id: str, seq: int | None, key: str | None) -> str:
        """The request's status (``keyqueue.app.status``)."""

    async def kept_progress(self, queue: str, request_id: str) -> Progress | None:
        """The request's last kept progress (``keyqueue.app.progress``), or None."""


class ReplyRouter:
    """One wildcard subscription for every ``call`` on a connection; one future per reply subject."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.pending: dict[str, asyncio.Future[Reply]] = {}
        self.sub: Any = None
        self._counter = 0

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(self.prefix + ".*", cb=self._on_reply)

    def expect(self) -> tuple[str, asyncio.Future[Reply]]:
        self._counter += 1
        subject = f"{self.prefix}.{self._counter}"
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.pending[subject] = future
        return subject, future

    def forget(self, subject: str) -> None:
        self.pending.pop(subject, None)

    async def _on_reply(self, msg: Msg) -> None:
        future = self.pending.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result((dict(msg.headers or {}), msg.data))


@dataclass
class LoopConnection:
    """The app's connection in one event loop, made on first use."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    nc: Client | None = None
    router: ReplyRouter | None = None
    publishers: dict[str, Publisher] = field(default_factory=dict)
    """Queues whose topology this connection has ensured, with their publisher."""
    work_streams: set[str] = field(default_factory=set)
    """Queues whose work stream (unkeyed requests) this connection has ensured."""
    schedules: dict[str, ScheduleStore] = field(default_factory=dict)
    """Queues whose schedules stream this connection has ensured (for delayed requests)."""
    records: dict[str, RequestRecords] = field(default_factory=dict)
    """Queues whose records stream (kept results, cancels) this connection has ensured."""
    cancel_watches: dict[str, CancelWatch] = field(default_factory=dict)
    """Queues whose cancel requests a worker on this connection follows."""
    workflows: dict[str, WorkflowStore] = field(default_factory=dict)
    """Queues whose workflows stream this connection has ensured (or found)."""
    watch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loop_end: AsyncGenerator[None, None] | None = None
    """Suspended for as long as the loop runs; the loop's shutdown closes it, and the connection with it."""

    async def close(self) -> None:
        """Stop the cancel watches and result writers, then drain and close the connection."""
        for watch in self.cancel_watches.values():
            await watch.close()
        self.cancel_watches.clear()
        for records in self.records.values():
            await records.close()
        self.records.clear()
        self.publishers.clear()
        self.work_streams.clear()
        self.schedules.clear()
        self.workflows.clear()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # closing must not fail because the server went away first
                pass


class Connections:
    """An app's connection in each event loop it is used from."""

    def __init__(self, name: str, settings: Callable[[], Awaitable[Settings]],
                 reconnected: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self._settings = settings
        self._reconnected = reconnected
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopConnection] = (
            weakref.WeakKeyDictionary()
        )

    def connected(self) -> LoopConnection | None:
        """The running loop's connection if it is open (no await: a key session's first step asks), else None."""
        state = self._by_loop.get(asyncio.get_running_loop())
        return state if state is not None and state.nc is not None and not state.nc.is_closed else None

    async def current(self) -> LoopConnection:
        """The running loop's connection, connected (again, if it was closed)."""
        loop = asyncio.get_running_loop()
        state = self._by_loop.get(loop)
        if state is None:
            self._drop_closed_loops()
            state = self._by_loop[loop] = LoopConnection()
            state.loop_end = self._until_loop_ends(loop, state)
            await anext(state.loop_end)  # now one of the loop's async generators: its shutdown closes it
        if state.nc is None or state.nc.is_closed:
            async with state.lock:
                if state.nc is None or state.nc.is_closed:
                    state.publishers.clear()
                    state.work_streams.clear()
                    state.schedules.clear()
                    state.workflows.clear()
                    for records in state.records.values():
                        await records.close()
                    state.records.clear()
                    for watch in state.cancel_watches.values():
                        await watch.close()
                    state.cancel_watches.clear()
                    settings = await self._settings()
                    state.nc = await open_connection(settings, name=self.name, reconnected=self._reconnected)
                    state.router = ReplyRouter(state.nc)
                    await state.router.start()
        return state

    async def _until_loop_ends(self, loop: asyncio.AbstractEventLoop, state: LoopConnection
                               ) -> AsyncGenerator[None, None]:
        """Wait, suspended, for the loop's shutdown (``shutdown_asyncgens``), then close its connection."""
        try:
            yield
        finally:
            if self._by_loop.get(loop) is state:
                del self._by_loop[loop]
            state.loop_end = None
            await state.close()

    def _drop_closed_loops(self) -> None:
        """Forget the connections of loops closed without their shutdown: nothing can run on them any
        more, and dropping them lets their sockets be freed (the server sees them go)."""
        for loop in [loop for loop in self._by_loop if loop.is_closed()]:
            _abandon(self._by_loop.pop(loop))
            log.debug("dropped the connection of an event loop closed without shutting down its async generators")

    def forget_all(self) -> None:
        """Drop every loop's connection unclosed: in a forked child, they are the parent's."""
        states, self._by_loop = list(self._by_loop.values()), weakref.WeakKeyDictionary()
        for state in states:
            _abandon(state)

    async def close(self) -> None:
        """Drain and close the running loop's connection, if it has one."""
        state = self._by_loop.pop(asyncio.get_running_loop(), None)
        if state is None:
            return
        if state.loop_end is not None:
            await state.loop_end.aclose()  # its cleanup closes the connection
        else:
            await state.close()


class NatsTransport:
    """Requests through NATS, on the connection of the running loop."""

    def __init__(self, connections: Connections, queue_config: Callable[[str], QueueConfig],
                 keeps_result: Callable[[TaskRequest], bool] = lambda request: False) -> None:
        """``keeps_result(request)``: whether the request's task keeps results (then a pending
        record is written once it is stored, so it is found by its id alone)."""
        self.connections = connections
        self.queue_config = queue_config
        self.keeps_result = keeps_result

    async def _publisher(self, queue: str) -> tuple[LoopConnection, Publisher]:
        state = await self.connections.current()
        publisher = state.publishers.get(queue)
        if publisher is None:
            assert state.nc is not None
            config = self.queue_config(queue)
            # Creates what is missing and checks the streams' layout; never the consumer's settings,
            # which producers do not use (docs/decisions.md, "Who owns each setting").
            await Topology(JetStreamApi(state.nc), config).ensure()
            publisher = state.publishers[queue] = Publisher(state.nc, config.names)
        return state, publisher

    async def enqueue(self, requests: Sequence[TaskRequest]) -> list[Receipt | EnqueueError]:
        queue = requests[0].queue
        state, publisher = await self._publisher(queue)
        assert state.nc is not None
        if queue not in state.work_streams and any(request.key == UNKEYED for request in requests):
            # Made when the queue's first unkeyed request is sent (a delayed one falls due into it).
            await Topology(JetStreamApi(state.nc), self.queue_config(queue)).ensure_unkeyed()
            state.work_streams.add(queue)
        if any(request.delay is not None for request in requests):
            return await self._enqueue_delayed(state, publisher, requests)
        outgoing = []
        for request in requests:
            size = header_block_size(request.headers) + len(request.body)
            if size > state.nc.max_payload - DLQ_HEADROOM:  # its dead-letter copy must fit whole
                raise PayloadTooLarge(size, state.nc.max_payload, DLQ_HEADROOM)
            outgoing.append(OutgoingRequest(request.key, dict(request.headers), request.body, request.request_id))
        if len(outgoing) == 1:
            try:
                results: list[Enqueued | EnqueueError] = [await publisher.enqueue(outgoing[0])]
            except EnqueueError as exc:
                results = [exc]
        else:
            results = await publisher.enqueue_many(outgoing)
        await self._mark_pending(queue, [request.request_id for request, result in zip(requests, results, strict=True)
                                         if not isinstance(result, EnqueueError) and not result.duplicate
                                         and self.keeps_result(request)])
        return [r if isinstance(r, EnqueueError) else _receipt(r, requests[0]) for r in results]

    async def _mark_pending(self, queue: str, request_ids: Sequence[str]) -> None:
        """Write the pending records of stored requests whose tasks keep results (``keyqueue.app.status``).
        A record that cannot be written leaves the request stored: it is then found by its receipt only."""
        if not request_ids:
            return
        try:
            records = await self.records(queue)
            await asyncio.gather(*(records.put_pending(request_id) for request_id in request_ids))
        except KeyqueueError as exc:
            log.warning("queue %s: %d request(s) stored, but their pending records were not written (%s); "
                        "find them by their receipts", queue, len(request_ids), exc)

    async def _enqueue_delayed(self, state: LoopConnection, publisher: Publisher,
                               requests: Sequence[TaskRequest]) -> list[Receipt | EnqueueError]:
        """Requests of which some are delayed, one by one in order: a delayed one goes to the queue's
        schedules stream (``keyqueue.jetstream.schedules``), the others to their keys' inboxes."""
        assert state.nc is not None
        queue = requests[0].queue
        store = state.schedules.get(queue)
        if store is None:
            config = self.queue_config(queue)
            store = ScheduleStore(state.nc, queue, replicas=config.replicas, duplicate_window=config.duplicate_window)
            await store.ensure()
            state.schedules[queue] = store
        now = datetime.datetime.now(datetime.UTC)
        dues = [r.delay.due(now) if r.delay is not None else None for r in requests]
        for due in dues:
            if due is not None:
                store.check_due(due, now)  # before anything is stored
        results: list[Receipt | EnqueueError] = []
        for request, due in zip(requests, dues, strict=True):
            size = header_block_size(request.headers) + len(request.body) + 256  # + the schedule's headers
            if size > state.nc.max_payload - DLQ_HEADROOM:
                raise PayloadTooLarge(size, state.nc.max_payload, DLQ_HEADROOM)
            try:
                if due is None:
                    stored = await publisher.enqueue(
                        OutgoingRequest(request.key, dict(request.headers), request.body, request.request_id))
                    results.append(_receipt(stored, request))
                else:
                    ack = await store.delay(request.key, request.request_id, request.headers, request.body, due)
                    results.append(Receipt(request.request_id, request.key, ack.seq, ack.duplicate, request.queue,
                                           request.message_type, due=due))
            except EnqueueError as exc:
                results.append(exc)
            except KeyqueueError as exc:
                results.append(EnqueueError(f"delayed request for key {request.key!r} not stored: {exc}"))
        await self._mark_pending(queue, [request.request_id for request, result in zip(requests, results, strict=True)
                                         if isinstance(result, Receipt) and not result.duplicate
                                         and result.due is None and self.keeps_result(request)])
        return results

    async def call(self, request: TaskRequest, timeout: float) -> Reply:
        state = await self.connections.current()
        assert state.router is not None
        subject, future = state.router.expect()
        request.headers[H.REPLY_INBOX] = subject
        try:
            [result] = await self.enqueue([request])
            if isinstance(result, EnqueueError):
                raise result
            request.receipt = result
            if result.duplicate:
                if not self.keeps_result(request):
                    raise EnqueueError(
                        f"request {request.request_id} was already accepted (a duplicate id) and its task keeps no "
                        "results, so only the first caller gets its result: declare the task with result_ttl= to "
                        "have a repeated call return it, or use a new request id to run it again"
                    )
                # The same call made again (a retry of a caller that timed out, say): the result is the kept one.
                kept = await self.kept_result(request.queue, request.request_id, timeout)
                if kept is not None:
                    return kept
            else:
                try:
                    return await asyncio.wait_for(future, timeout)
                except TimeoutError:
                    pass
            raise KeyqueueTimeout(
                f"no result for {request.message_type} request {request.request_id} (key {request.key!r}) within "
                f"{timeout}s; the request is stored and will still run"
            )
        finally:
            state.router.forget(subject)

    async def records(self, queue: str) -> RequestRecords:
        """The queue's records stream on this loop's connection, ensured once per connection."""
        state = await self.connections.current()
        records = state.records.get(queue)
        if records is None:
            assert state.nc is not None
            records = RequestRecords(state.nc, queue, replicas=self.queue_config(queue).replicas)
            await records.ensure()
            state.records[queue] = records
        return records

    @overload
    async def workflows(self, queue: str) -> WorkflowStore: ...
    @overload
    async def workflows(self, queue: str, *, create: bool) -> WorkflowStore | None: ...

    async def workflows(self, queue: str, *, create: bool = True) -> WorkflowStore | None:
        """The queue's workflows stream on this loop's connection, ensured once per connection;
        ``create=False``: None if the stream does not exist (a reader never creates it)."""
        state = await self.connections.current()
        store = state.workflows.get(queue)
        if store is None:
            assert state.nc is not None
            if create:
                store = WorkflowStore(state.nc, queue, replicas=self.queue_config(queue).replicas)
                await store.ensure()
            else:
                store = await existing_store(state.nc, queue)
                if store is None:
                    return None
            state.workflows[queue] = store
        return store

    def current_cancel_watch(self, queue: str) -> CancelWatch | None:
        """The queue's cancel watch when it is started on this loop's open connection and its records
        are current (nothing to await: what each key session's processor asks first), else None."""
        state = self.connections.connected()
        watch = state.cancel_watches.get(queue) if state is not None else None
        return watch if watch is not None and not watch.stale() else None

    async def cancel_watch(self, queue: str) -> CancelWatch:
        """The queue's cancel requests as this loop's connection sees them (started on first use)."""
        state = await self.connections.current()
        watch = state.cancel_watches.get(queue)
        if watch is None:
            async with state.watch_lock:  # a worker's key sessions start together: one watch for them all
                watch = state.cancel_watches.get(queue)
                if watch is None:
                    watch = CancelWatch(await self.records(queue))
                    await watch.start()
                    state.cancel_watches[queue] = watch
        return watch

    async def kept_result(self, queue: str, request_id: str, timeout: float) -> Reply | None:
        return await (await self.records(queue)).wait_result(request_id, timeout)

    async def cancel(self, queue: str, request_id: str, seq: int | None, wait: float,
                     key: str | None = None) -> str:
        state = await self.connections.current()
        assert state.nc is not None
        return await request_cancel(await self.records(queue), JetStreamApi(state.nc), request_id, seq, wait, key=key)

    async def status(self, queue: str, request_id: str, seq: int | None, key: str | None) -> str:
        state = await self.connections.current()
        assert state.nc is not None
        return await request_status(await self.records(queue), JetStreamApi(state.nc), request_id, seq=seq, key=key)

    async def kept_progress(self, queue: str, request_id: str) -> Progress | None:
        return await read_progress(await self.records(queue), request_id)


def _abandon(state: LoopConnection) -> None:
    """Forget a loop's connection without closing it (its loop cannot run the close: closed, or the
    parent's after a fork), and end its loop-end generator here, so that collecting it later does
    not ask that loop to finalize it (its cleanup then has nothing to await)."""
    state.nc, state.router = None, None
    state.publishers.clear()
    state.work_streams.clear()
    state.schedules.clear()
    state.records.clear()
    state.cancel_watches.clear()
    state.workflows.clear()
    if state.loop_end is not None:
        with contextlib.suppress(StopIteration):
            state.loop_end.aclose().send(None)


async def open_connection(settings: Settings, *, name: str = "keyqueue",
                          reconnected: Callable[[], Awaitable[None]] | None = None) -> Client:
    """Connect with ``settings`` (which must have a URL); ``ConnectionFailed`` if it is unreachable.

    The connection reconnects forever once made, but the first connect fails fast.
    """
    # connect() probes once without retries before the real connection (nats-py would retry an
    # unreachable server forever, even on the first connect); the timeout bounds both.
    limit = 2 * settings.connect_timeout + 1
    try:
        async with asyncio.timeout(limit):
            return await connect(settings, name=name, reconnected=reconnected)
    except TimeoutError:
        raise ConnectionFailed(
            f"cannot reach NATS at {settings.url} within {limit:.0f}s; start one with `keyqueue dev-server` "
            "or set KEYQUEUE_URL"
        ) from None
    except KeyqueueError:
        raise
    except Exception as exc:  # e.g. an authorization violation, raised by nats-py as is
        raise ConnectionFailed(f"cannot connect to NATS at {settings.url}: {type(exc).__name__}: {exc}") from exc


def _receipt(stored: Enqueued, request: TaskRequest) -> Receipt:
    return Receipt(stored.request_id, stored.key, stored.seq, stored.duplicate, request.queue, request.message_type)
