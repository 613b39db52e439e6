"""Enqueue: store a request in the key's inbox, then schedule the key with a token.

Publishes go through nats-py's core ``request`` (concurrent calls pipeline on one connection)
and the replies are parsed here: nats-py's ``publish_async`` logs a traceback for every
rejected ack, and most token publishes are rejected with 10077 by design.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import (
    BacklogFull,
    EnqueueError,
    EnqueueTimeout,
    KeyAlreadyScheduled,
    KeyqueueError,
    KeyqueueTimeout,
    TokenPublishFailed,
)
from keyqueue.jetstream.api import JetStreamApi, PubAck, parse_pub_ack
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.subjects import QueueNames, validate_key
from keyqueue.wire.headers import MSG_ID

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
        self._mux: RequestMux | None = None

    async def _publish(self, subject: str, body: bytes, headers: Mapping[str, str] | None) -> PubAck:
        msg = await self.api._request(subject, body, self.timeout, dict(headers) if headers else None)
        return parse_pub_ack(msg)

    async def store(self, request: OutgoingRequest) -> Enqueued:
        """Publish the request to the key's inbox (the first step of an enqueue; the token follows)."""
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
        """Store the request, then schedule its key. A duplicate request id stores nothing new.

        The token is published only once the server has confirmed the request is stored (two
        round trips). Sent back to back, the token could be stored first: a worker could take it,
        find the inbox empty, release the key and re-check the inbox before the request landed,
        leaving the request to the reconciler. A refused request (a full backlog) publishes no
        token.
        """
        validate_key(request.key)
        if self._mux is None:
            self._mux = RequestMux(self.nc)
        try:
            ack = parse_pub_ack(await self._store_once(self._mux, request))
        except KeyAlreadyScheduled as e:  # 10077 on the inbox: the per-key backlog cap
            raise BacklogFull(self.names.queue, request.key) from e
        try:
            parse_pub_ack(await self._acknowledged(self._mux, self.names.token(request.key), b"", None))
        except KeyAlreadyScheduled:
            pass
        except KeyqueueError as e:
            raise TokenPublishFailed(self.names.queue, request.key, ack.seq, e) from e
        return Enqueued(request.key, ack.seq, ack.duplicate, request.request_id)

    async def _store_once(self, mux: RequestMux, request: OutgoingRequest) -> Msg:
        """Publish the request to its key's inbox; on a timeout, once more with the same request id.

        The retry is safe: the server stores a request id once within the duplicate window, so if
        the first try was stored the second is acknowledged as a duplicate and stores nothing.
        """
        subject = self.names.inbox(request.key)
        for attempt in (1, 2):
            try:
                return await self._acknowledged(mux, subject, request.body, request.headers)
            except KeyqueueTimeout:
                if attempt == 2 or not _deduplicated(request):
                    raise EnqueueTimeout(self.names.queue, request.key, request.request_id, self.timeout) from None
        raise AssertionError("unreachable")

    async def _acknowledged(self, mux: RequestMux, subject: str, body: bytes,
                            headers: Mapping[str, str] | None) -> Msg:
        future = await mux.send(subject, body, headers=headers)
        return (await wait(future, self.timeout, f"a publish to {subject}"))[0]

    async def close(self) -> None:
        """Drop the reply subscription single enqueues share (the connection stays open)."""
        if self._mux is not None:
            await self._mux.close()
            self._mux = None

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
        mux = RequestMux(self.nc)
        try:
            acks = await self._pipeline(mux, [(self.names.inbox(i.key), i.body, i.headers) for i in items], window)
            # Requests whose acknowledgement did not come: once more, in order, with the same ids
            # (safe: the server stores a request id once within the duplicate window).
            again = [n for n, (i, a) in enumerate(zip(items, acks, strict=True))
                     if isinstance(a, KeyqueueTimeout) and _deduplicated(i)]
            retried = await self._pipeline(mux, [(self.names.inbox(items[n].key), items[n].body, items[n].headers)
                                                 for n in again], window)
            for n, reply in zip(again, retried, strict=True):
                acks[n] = reply
            results: list[Enqueued | EnqueueError] = []
            for item, reply in zip(items, acks, strict=True):
                try:
                    ack = parse_pub_ack(_reply_or_raise(reply, item.key))
                    results.append(Enqueued(item.key, ack.seq, ack.duplicate, item.request_id))
                except KeyAlreadyScheduled:
                    results.append(BacklogFull(self.names.queue, item.key))
                except KeyqueueTimeout:
                    results.append(EnqueueTimeout(self.names.queue, item.key, item.request_id, self.timeout))
                except KeyqueueError as e:
                    results.append(EnqueueError(f"request for key {item.key!r} not stored: {e}"))
            keys = list(dict.fromkeys(r.key for r in results if isinstance(r, Enqueued)))
            tokens = await self._pipeline(mux, [(self.names.token(k), b"", None) for k in keys], window)
        finally:
            await mux.close()
        failed: dict[str, KeyqueueError] = {}
        for key, reply in zip(keys, tokens, strict=True):
            try:
                parse_pub_ack(_reply_or_raise(reply, key))
            except KeyAlreadyScheduled:
                pass
            except KeyqueueError as e:
                failed[key] = e
        for index, result in enumerate(results):
            if isinstance(result, Enqueued) and result.key in failed:
                results[index] = TokenPublishFailed(self.names.queue, result.key, result.seq, failed[result.key])
        return results

    async def _pipeline(self, mux: RequestMux, messages: list[tuple[str, bytes, Mapping[str, str] | None]],
                        window: int) -> list[Msg | KeyqueueError]:
        """Publish in order with at most ``window`` unacknowledged; one reply (or error) per message."""
        futures: list[asyncio.Future[list[Msg]]] = []
        for index, (subject, body, headers) in enumerate(messages):
            if index >= window:
                oldest = futures[index - window]
                if not oldest.done():
                    await asyncio.wait([oldest], timeout=self.timeout)
            futures.append(await mux.send(subject, body, headers=headers))
        if futures:
            await asyncio.wait(futures, timeout=self.timeout)
        return [_outcome(future, subject, self.timeout)
                for future, (subject, _, _) in zip(futures, messages, strict=True)]


def _outcome(future: asyncio.Future[list[Msg]], subject: str, timeout: float) -> Msg | KeyqueueError:
    """The acknowledgement, or the error standing for it (a future still waiting is given up)."""
    if future.done() and not future.cancelled():
        error = future.exception()
        if error is None:
            return future.result()[0]
        if isinstance(error, KeyqueueError):  # the mux gave the request up
            return error
    future.cancel()
    return KeyqueueTimeout(f"no acknowledgement for a publish to {subject} within {timeout}s")


def _reply_or_raise(reply: Msg | KeyqueueError, key: str) -> Msg:
    if isinstance(reply, KeyqueueError):
        raise reply
    return reply


def _deduplicated(request: OutgoingRequest) -> bool:
    """Whether the server deduplicates this request (it carries a request id), so a retry is safe."""
    return any(name.lower() == MSG_ID.lower() for name in request.headers)
