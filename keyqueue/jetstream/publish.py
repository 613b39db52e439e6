"""Enqueue: store a request in the key's inbox, then schedule the key with a token.

Publishes go through nats-py's core ``request`` (concurrent calls pipeline on one connection)
and the replies are parsed here: nats-py's ``publish_async`` logs a traceback for every
rejected ack, and most token publishes are rejected with 10077 by design.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import (
    BacklogFull,
    EnqueueError,
    KeyAlreadyScheduled,
    KeyqueueError,
    KeyqueueTimeout,
    TokenPublishFailed,
)
from keyqueue.jetstream.api import JetStreamApi, PubAck, parse_pub_ack
from keyqueue.jetstream.subjects import QueueNames, validate_key

PIPELINE_WINDOW: Final = 512
"""Publishes in flight at once during a bulk enqueue."""


@dataclass(frozen=True, slots=True)
class Enqueued:
    """Where a request was stored: its inbox sequence, and whether it repeated a known request id."""

    key: str
    seq: int
    duplicate: bool
    request_id: str


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    """One encoded request ready to publish."""

    key: str
    headers: Mapping[str, str]
    body: bytes
    request_id: str


class Publisher:
    """Publishes requests and tokens for one queue."""

    def __init__(self, nc: Client, names: QueueNames, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.names = names
        self.api = JetStreamApi(nc, timeout=timeout)
        self.timeout = timeout

    async def _publish(self, subject: str, body: bytes, headers: Mapping[str, str] | None) -> PubAck:
        msg = await self.api._request(subject, body, self.timeout, dict(headers) if headers else None)
        return parse_pub_ack(msg)

    async def store(self, request: OutgoingRequest) -> Enqueued:
        """Publish the request to the key's inbox (step 2 of DESIGN.md section 3)."""
        validate_key(request.key)
        try:
            ack = await self._publish(self.names.inbox(request.key), request.body, request.headers)
        except KeyAlreadyScheduled as e:  # 10077 on the inbox: the per-key backlog cap
            raise BacklogFull(self.names.queue, request.key) from e
        return Enqueued(request.key, ack.seq, ack.duplicate, request.request_id)

    async def schedule(self, key: str) -> bool:
        """Publish the key's token. True if a new token was stored, False if one already existed."""
        try:
            await self._publish(self.names.token(key), b"", None)
        except KeyAlreadyScheduled:
            return False
        return True

    async def enqueue(self, request: OutgoingRequest) -> Enqueued:
        """Store the request, then schedule its key. A duplicate request id stores nothing new."""
        stored = await self.store(request)
        try:
            await self.schedule(request.key)
        except KeyqueueError as e:
            raise TokenPublishFailed(self.names.queue, request.key, stored.seq, e) from e
        return stored

    async def enqueue_many(self, requests: Iterable[OutgoingRequest],
                           window: int = PIPELINE_WINDOW) -> list[Enqueued | EnqueueError]:
        """Store many requests with pipelined publishes, then schedule each distinct key once.

        Returns one entry per request, in order: where it was stored, or the error that kept it
        out (a full backlog, say). Requests are published in the order given, on one connection,
        so each key's requests are stored in that order.
        """
        items = list(requests)
        for item in items:
            validate_key(item.key)
        results: list[Enqueued | EnqueueError] = []
        async with Pipeline(self.nc, window=window, timeout=self.timeout) as pipe:
            acks = [await pipe.publish(self.names.inbox(i.key), i.body, i.headers) for i in items]
            for item, fut in zip(items, acks, strict=True):
                try:
                    ack = parse_pub_ack(await fut)
                    results.append(Enqueued(item.key, ack.seq, ack.duplicate, item.request_id))
                except KeyAlreadyScheduled:
                    results.append(BacklogFull(self.names.queue, item.key))
                except KeyqueueError as e:
                    results.append(EnqueueError(f"request for key {item.key!r} not stored: {e}"))
            keys = list(dict.fromkeys(i.key for i, r in zip(items, results, strict=True)
                                      if isinstance(r, Enqueued)))
            tokens = [await pipe.publish(self.names.token(k), b"", None) for k in keys]
            failed: dict[str, KeyqueueError] = {}
            for key, fut in zip(keys, tokens, strict=True):
                try:
                    parse_pub_ack(await fut)
                except KeyAlreadyScheduled:
                    pass
                except KeyqueueError as e:
                    failed[key] = e
        for index, result in enumerate(results):
            if isinstance(result, Enqueued) and result.key in failed:
                results[index] = TokenPublishFailed(self.names.queue, result.key, result.seq, failed[result.key])
        return results


class Pipeline:
    """Ordered, windowed request pipelining on the core client, with its own reply subscription.

    ``publish`` sends at once (in call order, on one connection) and returns a future for the
    reply; at most ``window`` replies are outstanding, so a publish may wait for the oldest.
    """

    def __init__(self, nc: Client, *, window: int = PIPELINE_WINDOW, timeout: float = 5.0) -> None:
        self.nc = nc
        self.window = window
        self.timeout = timeout
        self._prefix = nc.new_inbox()
        self._futures: dict[str, asyncio.Future[Msg]] = {}
        self._order: collections.deque[asyncio.Future[Msg]] = collections.deque()
        self._counter = 0
        self._sub: Any = None

    async def __aenter__(self) -> Pipeline:
        self._sub = await self.nc.subscribe(self._prefix + ".*", cb=self._on_reply)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for fut in self._futures.values():
            fut.cancel()
        await self._sub.unsubscribe()

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._futures.pop(msg.subject, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def publish(self, subject: str, body: bytes, headers: Mapping[str, str] | None) -> Awaitable[Msg]:
        while len(self._order) >= self.window:
            await asyncio.wait([self._order[0]], timeout=self.timeout)
            self._order.popleft()
        self._counter += 1
        reply = f"{self._prefix}.{self._counter}"
        fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._futures[reply] = fut
        self._order.append(fut)
        await self.nc.publish(subject, body, reply=reply, headers=dict(headers) if headers else None)
        return self._result(subject, fut)

    async def _result(self, subject: str, fut: asyncio.Future[Msg]) -> Msg:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError as e:
            raise KeyqueueTimeout(f"no acknowledgement for a publish to {subject} within {self.timeout}s") from e
