"""The Rebaser client: enqueue updates for a change set, optionally wait for the response or the DVU.

    async with await RebaserClient.connect("nats://127.0.0.1:4222") as rebaser:
        response = await rebaser.enqueue_updates("w1", "cs1", [Update.set_value("a", 3)])
        covered = await rebaser.enqueue_updates("w1", "cs1", [Update.set_value("b", 4)], await_dvu=True)
        print(covered.dvu_run)   # the DVU run whose values include this request

The client hides the subjects and headers. Enqueueing awaits both publishes (the request, then the
change set's token) before it returns, so an accepted request is always stored *and* scheduled,
or the call raises (``TokenPublishFailed`` says the request is stored and a reconciler will
schedule it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, overload

from keyqueue import InvalidKey, KeyqueueError, KeyqueueTimeout
from keyqueue.ext import Client, Enqueued, JetStreamApi, OutgoingRequest, Publisher, Topology, connect, validate_key
from keyqueue.wire import CBOR, Message, decode, encode
from keyqueue.wire import headers as wire_headers

from .messages import (
    AWAIT_DVU,
    REGISTRY,
    STATUS_ERROR,
    EnqueueUpdatesRequest,
    EnqueueUpdatesResponse,
    Update,
)
from .plugin import queue_config
from .state import ChangeSetState
from .store import DEFAULT_BUCKET, SnapshotStore

__all__ = ["Accepted", "RebaserClient", "change_set_key"]

DVU_CHECK_INTERVAL = 2.0
"""Seconds between looks at the stored state while waiting for a DVU (in case its notice was lost)."""


def change_set_key(workspace: str, change_set: str) -> str:
    """The change set's key in the ``rebaser`` queue (and the KV bucket): ``<workspace>.<change_set>``."""
    for what, value in (("workspace", workspace), ("change set", change_set)):
        if not value or "." in value:
            raise InvalidKey(f"{what} id {value!r} must be one non-empty subject token (no '.')")
    return validate_key(f"{workspace}.{change_set}")


@dataclass(frozen=True)
class Accepted:
    """A request stored and scheduled, not waited for."""

    request_id: str
    key: str
    seq: int
    duplicate: bool


class _Replies:
    """One wildcard subscription for every reply this client waits for, routed by subject."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.queues: dict[str, asyncio.Queue[tuple[Mapping[str, str], bytes]]] = {}
        self.counter = 0
        self.sub: Any = None

    async def start(self) -> None:
        if self.sub is None:
            self.sub = await self.nc.subscribe(self.prefix + ".*", cb=self._on_reply)

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None

    def expect(self) -> str:
        self.counter += 1
        subject = f"{self.prefix}.{self.counter}"
        self.queues[subject] = asyncio.Queue()
        return subject

    def forget(self, subject: str) -> None:
        self.queues.pop(subject, None)

    async def _on_reply(self, msg: Any) -> None:
        queue = self.queues.get(msg.subject)
        if queue is not None:
            queue.put_nowait((dict(msg.headers or {}), msg.data))


class RebaserClient:
    """Sends ``EnqueueUpdatesRequest`` messages to the ``rebaser`` queue."""

    def __init__(self, nc: Client, *, queue: str = "rebaser", bucket: str = DEFAULT_BUCKET,
                 content_type: str = CBOR, timeout: float = 10.0, ack_wait: float = 30.0) -> None:
        """``queue``, ``bucket`` and ``ack_wait`` must be the workers' (the client creates or verifies the queue)."""
        self.nc = nc
        self.config = queue_config(queue=queue, ack_wait=ack_wait)
        self.publisher = Publisher(nc, self.config.names)
        self.bucket = bucket
        self.content_type = content_type
        self.timeout = timeout
        self._replies = _Replies(nc)
        self._store: SnapshotStore | None = None
        self._owns_connection = False

    @classmethod
    async def connect(cls, url: str, **options: Any) -> RebaserClient:
        """A client on its own connection (closed by :meth:`close`)."""
        client = cls(await connect(url, name="rebaser-client"), **options)
        client._owns_connection = True
        return client

    async def start(self) -> None:
        """Create or verify the queue's streams and the reply subscription (``async with`` does this)."""
        await Topology(JetStreamApi(self.nc), self.config).ensure()
        await self._replies.start()

    async def close(self) -> None:
        await self._replies.close()
        if self._owns_connection:
            await self.nc.close()

    async def __aenter__(self) -> RebaserClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests --------------------------------------------------------------------------------

    @staticmethod
    def request(workspace: str, change_set: str, updates: Sequence[Update], *, from_change_set_id: str | None = None,
                event_session_id: str | None = None) -> EnqueueUpdatesRequest:
        change_set_key(workspace, change_set)
        return EnqueueUpdatesRequest(workspace, change_set, list(updates), from_change_set_id, event_session_id)

    @overload
    async def enqueue_updates(self, workspace: str, change_set: str, updates: Sequence[Update], *,
                              wait: Literal[True] = ..., await_dvu: bool = ..., timeout: float | None = ...,
                              from_change_set_id: str | None = ..., event_session_id: str | None = ...,
                              request_id: str | None = ...) -> EnqueueUpdatesResponse: ...

    @overload
    async def enqueue_updates(self, workspace: str, change_set: str, updates: Sequence[Update], *,
                              wait: Literal[False], await_dvu: bool = ..., timeout: float | None = ...,
                              from_change_set_id: str | None = ..., event_session_id: str | None = ...,
                              request_id: str | None = ...) -> Accepted: ...

    async def enqueue_updates(self, workspace: str, change_set: str, updates: Sequence[Update], *,
                              wait: bool = True, await_dvu: bool = False, timeout: float | None = None,
                              from_change_set_id: str | None = None, event_session_id: str | None = None,
                              request_id: str | None = None) -> EnqueueUpdatesResponse | Accepted:
        """Enqueue ``updates`` for the change set; they apply in enqueue order, all or nothing.

        ``wait`` (the default) returns the :class:`EnqueueUpdatesResponse`; ``await_dvu`` waits
        longer, for the DVU run that covers this request, and returns its response (``dvu_run``
        names the run). Without ``wait`` the call returns once the request is stored and its
        change set scheduled. A request the worker dead-letters (an unsupported version, say)
        comes back as an ``error`` response. Raises ``KeyqueueTimeout`` (a ``TimeoutError``) if no
        answer comes in ``timeout`` seconds; the request is stored and still runs.
        """
        message = self.request(workspace, change_set, updates, from_change_set_id=from_change_set_id,
                               event_session_id=event_session_id)
        return await self.send(message, wait=wait, await_dvu=await_dvu, timeout=timeout, request_id=request_id)

    async def send(self, message: Message, *, wait: bool = True, await_dvu: bool = False,
                   timeout: float | None = None, request_id: str | None = None,
                   content_type: str | None = None) -> EnqueueUpdatesResponse | Accepted:
        """Send any version of the request message (``enqueue_updates`` sends the latest)."""
        key = change_set_key(getattr(message, "workspace_id", ""), getattr(message, "change_set_id", ""))
        inbox = self._replies.expect() if wait or await_dvu else None
        try:
            outgoing = self._outgoing(key, message, inbox, await_dvu, request_id, content_type)
            stored = await self.publisher.enqueue(outgoing)
            if inbox is None:
                return Accepted(stored.request_id, key, stored.seq, stored.duplicate)
            limit = self.timeout if timeout is None else timeout
            return await self._await_response(key, stored, inbox, await_dvu, limit)
        finally:
            if inbox is not None:
                self._replies.forget(inbox)

    async def enqueue_many(self, batch: Iterable[tuple[str, str, Sequence[Update]]], *, wait: bool = False,
                           await_dvu: bool = False, timeout: float | None = None
                           ) -> list[EnqueueUpdatesResponse | Accepted | KeyqueueError]:
        """Enqueue many requests with pipelined publishes; per change set, in the order given.

        Returns one entry per request: its response (``wait`` / ``await_dvu``), its receipt, or
        the error that kept it out.
        """
        items = [(change_set_key(w, c), self.request(w, c, updates)) for w, c, updates in batch]
        inboxes = [self._replies.expect() if wait or await_dvu else None for _ in items]
        try:
            outgoing = [self._outgoing(key, msg, inbox, await_dvu, None, None)
                        for (key, msg), inbox in zip(items, inboxes, strict=True)]
            results = await self.publisher.enqueue_many(outgoing)
            limit = self.timeout if timeout is None else timeout

            async def settle(stored: Enqueued | KeyqueueError, inbox: str | None, key: str
                             ) -> EnqueueUpdatesResponse | Accepted | KeyqueueError:
                if isinstance(stored, KeyqueueError):
                    return stored
                if inbox is None:
                    return Accepted(stored.request_id, key, stored.seq, stored.duplicate)
                try:
                    return await self._await_response(key, stored, inbox, await_dvu, limit)
                except KeyqueueError as e:
                    return e

            return list(await asyncio.gather(*(settle(r, inbox, key) for r, inbox, (key, _) in
                                               zip(results, inboxes, items, strict=True))))
        finally:
            for inbox in inboxes:
                if inbox is not None:
                    self._replies.forget(inbox)

    async def snapshot(self, workspace: str, change_set: str) -> ChangeSetState:
        """The change set's stored state (its graph, pending roots and DVU history)."""
        store = await self._snapshots()
        state, _ = await store.load(change_set_key(workspace, change_set))
        return state

    # --- internals -------------------------------------------------------------------------------

    async def _snapshots(self) -> SnapshotStore:
        if self._store is None:
            self._store = await SnapshotStore.open(self.nc, self.bucket)
        return self._store

    def _outgoing(self, key: str, message: Message, inbox: str | None, await_dvu: bool, request_id: str | None,
                  content_type: str | None) -> OutgoingRequest:
        extra = {AWAIT_DVU: "true"} if await_dvu else None
        encoded = encode(message, content_type=content_type or self.content_type, request_id=request_id,
                         reply_inbox=inbox, extra_headers=extra, max_payload=self.nc.max_payload)
        return OutgoingRequest(key, encoded.headers, encoded.body, encoded.request_id)

    async def _await_response(self, key: str, stored: Enqueued, inbox: str, await_dvu: bool,
                              timeout: float) -> EnqueueUpdatesResponse:
        queue = self._replies.queues[inbox]
        deadline = time.monotonic() + timeout
        first: EnqueueUpdatesResponse | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            wait = min(remaining, DVU_CHECK_INTERVAL) if first is not None else remaining
            try:
                headers, body = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if first is not None:
                    covered = await self._covered_in_store(key, first)
                    if covered is not None:
                        return covered
                continue
            response = self._response(headers, body)
            if not await_dvu or response.dvu_run is not None or not response.ok or not response.dvu_owed:
                return response
            first = response
        what = "a DVU covering it" if first is not None else "a response"
        raise KeyqueueTimeout(f"request {stored.request_id} for change set {key} (inbox seq {stored.seq}) got no "
                              f"{what} within {timeout}s; it is stored and will still be applied")

    async def _covered_in_store(self, key: str, first: EnqueueUpdatesResponse) -> EnqueueUpdatesResponse | None:
        """If a DVU covering the change committed but its notice was lost (its holder died), say so."""
        store = await self._snapshots()
        state, _ = await store.load(key)
        run = state.run_covering(first.change) if state.dvu_covered >= first.change else None
        if run is None:
            return None
        return replace(first, dvu_owed=False, dvu_run=run.run, dvu_errors=list(run.errors))

    @staticmethod
    def _response(headers: Mapping[str, str], body: bytes) -> EnqueueUpdatesResponse:
        status = headers.get(wire_headers.STATUS, wire_headers.STATUS_OK)
        if status != wire_headers.STATUS_OK or not body:
            # The core answered for the worker (the request was dead-lettered before it could be
            # read): the reason travels in headers.
            detail = f"{headers.get(wire_headers.ERROR_TYPE, 'error')}: {headers.get(wire_headers.ERROR_MESSAGE, '')}"
            reason = headers.get(wire_headers.DLQ_REASON)
            prefix = f"dead-lettered ({reason}): " if status == wire_headers.STATUS_DEAD_LETTERED else f"{status}: "
            return EnqueueUpdatesResponse(STATUS_ERROR, message=prefix + detail)
        response = decode(headers, body, REGISTRY)
        if not isinstance(response, EnqueueUpdatesResponse):
            return EnqueueUpdatesResponse(STATUS_ERROR, message=f"unexpected reply type {response.TYPE}")
        return response
