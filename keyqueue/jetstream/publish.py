"""Enqueue: store a request in the key's inbox, then schedule the key with a token; store an
unkeyed request (key :data:`~keyqueue.jetstream.subjects.UNKEYED`) in the queue's work stream.

Publishes go through nats-py's core ``request`` (concurrent calls pipeline on one connection)
and the replies are parsed here: nats-py's ``publish_async`` logs a traceback for every
rejected ack, and most token publishes are rejected with 10077 by design.

**Outages.** A publish that could not be sent because the connection is down, or whose stream
has no leader yet (a server restarting, a cluster electing), waits for the connection and is sent
again, for up to ``outage_wait`` seconds, instead of raising: a producer rides out a short outage
(docs/decisions.md, "Outages"). One whose reply was lost with the connection is sent again only
if repeating it is safe: a request with a request id (the server stores an id once within the
duplicate window), or a token. ``enqueue_many`` sends again in order, and never sends a request
again once a later request of its key was stored: that would store them out of order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import (
    BacklogFull,
    ConnectionFailed,
    Disconnected,
    EnqueueError,
    EnqueueTimeout,
    KeyAlreadyScheduled,
    KeyqueueError,
    KeyqueueTimeout,
    ReplyLost,
    TokenPublishFailed,
)
from keyqueue.jetstream.api import STATUS, JetStreamApi, PubAck, parse_pub_ack
from keyqueue.jetstream.connect import link_of, wait_connected
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.subjects import UNKEYED, QueueNames, validate_key
from keyqueue.wire.headers import MESSAGE_TYPE, MSG_ID

PIPELINE_WINDOW: Final = 512
"""Publishes in flight at once during a bulk enqueue."""

OUTAGE_WAIT: Final = 15.0
"""Seconds a publish waits for a lost connection (or a stream's leader) to come back before it raises."""

_LEADER_PAUSE: Final = (0.05, 0.5)
"""First and longest pause, in seconds, before publishing again to a stream that has no leader yet."""


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

    def __init__(self, nc: Client, names: QueueNames, *, timeout: float = 5.0,
                 outage_wait: float = OUTAGE_WAIT) -> None:
        self.nc = nc
        self.names = names
        self.api = JetStreamApi(nc, timeout=timeout)
        self.timeout = timeout
        self.outage_wait = outage_wait
        self._mux: RequestMux | None = None

    def _mux_for_one(self) -> RequestMux:
        if self._mux is None:
            self._mux = RequestMux(self.nc)
        return self._mux

    async def _publish(self, subject: str, body: bytes, headers: Mapping[str, str] | None) -> PubAck:
        repeatable = headers is None or _deduplicated_headers(headers)
        return parse_pub_ack(await self._acknowledged(self._mux_for_one(), subject, body, headers,
                                                      repeatable=repeatable))

    def subject(self, request: OutgoingRequest) -> str:
        """Where ``request`` is stored: its key's inbox, or for an unkeyed one its task's subject of the
        work stream (``InvalidKey`` for a key that cannot be one)."""
        if request.key == UNKEYED:
            return self.names.work(request.headers.get(MESSAGE_TYPE, ""))
        return self.names.inbox(validate_key(request.key))

    async def store(self, request: OutgoingRequest) -> Enqueued:
        """Publish the request to the key's inbox (the first step of an enqueue; the token follows)."""
        try:
            ack = await self._publish(self.subject(request), request.body, request.headers)
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
        token. An unkeyed request is stored in the work stream and needs no token.
        """
        mux = self._mux_for_one()
        try:
            ack = parse_pub_ack(await self._store_once(mux, request))
        except KeyAlreadyScheduled as e:  # 10077 on the inbox: the per-key backlog cap
            raise BacklogFull(self.names.queue, request.key) from e
        if request.key == UNKEYED:
            return Enqueued(request.key, ack.seq, ack.duplicate, request.request_id)
        try:
            parse_pub_ack(await self._acknowledged(mux, self.names.token(request.key), b"", None, repeatable=True))
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
        subject = self.subject(request)
        for attempt in (1, 2):
            try:
                return await self._acknowledged(mux, subject, request.body, request.headers,
                                                repeatable=_deduplicated(request))
            except KeyqueueTimeout:
                if attempt == 2 or not _deduplicated(request):
                    raise EnqueueTimeout(self.names.queue, request.key, request.request_id, self.timeout) from None
        raise AssertionError("unreachable")

    async def _acknowledged(self, mux: RequestMux, subject: str, body: bytes,
                            headers: Mapping[str, str] | None, *, repeatable: bool) -> Msg:
        """Publish and return the reply, riding out an outage of up to ``outage_wait`` seconds (see
        the module docstring); a reply lost with the connection is sent again only if ``repeatable``."""
        outage = _Outage(self.nc, self.outage_wait)
        while True:
            try:
                future = await mux.send(subject, body, headers=headers)
            except Disconnected:
                if await outage.wait():
                    continue  # nothing was sent
                raise
            try:
                reply = (await wait(future, self.timeout, f"a publish to {subject}"))[0]
            except ReplyLost:
                if repeatable and await outage.wait():
                    continue
                raise
            if (_no_leader(reply) or _unavailable(reply)) and await outage.pause():
                continue  # nothing was stored: the stream has no leader yet, or JetStream is catching up
            return reply

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
        so each key's requests are stored in that order; one whose acknowledgement did not come
        is sent again (with its request id, so it is stored once) unless a later request of its key
        was stored meanwhile: then it is reported as :class:`~keyqueue.errors.EnqueueTimeout`
        rather than stored out of order.
        """
        items = list(requests)
        subjects = [self.subject(item) for item in items]
        mux = RequestMux(self.nc)
        outage = _Outage(self.nc, self.outage_wait)
        try:
            acks = await self._pipeline(mux, [(subjects[n], i.body, i.headers) for n, i in enumerate(items)], window,
                                        outage)
            for _ in range(3):  # again (in order) what got no acknowledgement, as long as that is safe
                again = _safe_to_send_again(items, acks)
                if not again:
                    break
                if any(isinstance(acks[n], ReplyLost) for n in again) and not await outage.wait():
                    break
                retried = await self._pipeline(
                    mux, [(subjects[n], items[n].body, items[n].headers) for n in again], window, outage)
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
                    refused = EnqueueError(f"request for key {item.key!r} not stored: {e}")
                    refused.__cause__ = e  # a caller tells a passing refusal from one about the request
                    results.append(refused)
            keys = list(dict.fromkeys(r.key for r in results if isinstance(r, Enqueued) and r.key != UNKEYED))
            tokens = await self._pipeline(mux, [(self.names.token(k), b"", None) for k in keys], window, outage)
            lost = [n for n, reply in enumerate(tokens) if isinstance(reply, ConnectionFailed | KeyqueueTimeout)]
            if lost and await outage.wait():  # tokens are safe to publish again
                again_tokens = await self._pipeline(mux, [(self.names.token(keys[n]), b"", None) for n in lost],
                                                    window, outage)
                for n, reply in zip(lost, again_tokens, strict=True):
                    tokens[n] = reply
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
                        window: int, outage: _Outage) -> list[Msg | KeyqueueError]:
        """Publish in order with at most ``window`` unacknowledged; one reply (or error) per message.

        When the connection drops, the messages whose replies it took are sent again, in order,
        before any later one (only those safe to repeat: a token, or a request with an id), and a
        message that cannot be sent because the connection is down waits for it (within the
        outage's time): so a key's requests are stored in order across the drop."""
        futures: list[asyncio.Future[list[Msg]] | KeyqueueError] = []
        link = link_of(self.nc)
        seen = link.drops if link is not None else 0
        index = 0
        while index < len(messages):
            if link is not None and link.drops != seen:
                seen = link.drops
                await self._send_lost_again(mux, messages, futures, outage)
                continue  # it may have dropped again meanwhile
            subject, body, headers = messages[index]
            if index >= window:
                oldest = futures[index - window]
                if isinstance(oldest, asyncio.Future) and not oldest.done():
                    await asyncio.wait([oldest], timeout=self.timeout)
            try:
                futures.append(await mux.send(subject, body, headers=headers))
                index += 1
            except Disconnected as e:
                if not await outage.wait():
                    futures.extend([e] * (len(messages) - index))
                    break
        pending = [f for f in futures if isinstance(f, asyncio.Future)]
        if pending:
            await asyncio.wait(pending, timeout=self.timeout)
        return [f if isinstance(f, KeyqueueError) else _outcome(f, subject, self.timeout)
                for f, (subject, _, _) in zip(futures, messages, strict=True)]

    async def _send_lost_again(self, mux: RequestMux, messages: list[tuple[str, bytes, Mapping[str, str] | None]],
                               futures: list[asyncio.Future[list[Msg]] | KeyqueueError], outage: _Outage) -> None:
        """Send again, in order, the messages whose replies a dropped connection took (those safe to repeat)."""
        for n, future in enumerate(futures):
            if not (isinstance(future, asyncio.Future) and future.done() and not future.cancelled()
                    and isinstance(future.exception(), ReplyLost)):
                continue
            subject, body, headers = messages[n]
            if headers is not None and not _deduplicated_headers(headers):
                continue
            while True:
                try:
                    futures[n] = await mux.send(subject, body, headers=headers)
                    break
                except Disconnected as e:
                    if not await outage.wait():
                        futures[n] = e
                        break


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
    return _deduplicated_headers(request.headers)


def _deduplicated_headers(headers: Mapping[str, str]) -> bool:
    return any(name.lower() == MSG_ID.lower() for name in headers)


def _unavailable(reply: Msg) -> bool:
    """A publish answered "JetStream system temporarily unavailable" (10008) or "too many requests"
    (10167: the stream's ingest queue was full): nothing was stored."""
    return b'"err_code":10008' in reply.data or b'"err_code":10167' in reply.data


def _no_leader(reply: Msg) -> bool:
    """A publish answered "no responders": no stream took it (it has no leader yet, or does not exist)."""
    return reply.headers is not None and reply.headers.get(STATUS) == "503"


def _safe_to_send_again(items: list[OutgoingRequest], acks: list[Msg | KeyqueueError]) -> list[int]:
    """The requests, in order, that got no acknowledgement (lost with the connection, or none in
    time), carry a request id, and have no later request of their key acknowledged: sending them
    again cannot store them after a later request of their key. Unkeyed requests have no order to keep."""
    acked_after: set[str] = set()
    again: list[int] = []
    for n in range(len(items) - 1, -1, -1):
        item, ack = items[n], acks[n]
        if isinstance(ack, ReplyLost | Disconnected | KeyqueueTimeout):
            if _deduplicated(item) and (item.key == UNKEYED or item.key not in acked_after):
                again.append(n)
        elif not isinstance(ack, KeyqueueError):
            acked_after.add(item.key)
    return again[::-1]


class _Outage:
    """How long a publish may still wait for the connection (or a stream's leader) to come back."""

    def __init__(self, nc: Client, seconds: float) -> None:
        self.nc = nc
        self.until = time.monotonic() + seconds
        self.pause_for, self.longest = _LEADER_PAUSE

    def left(self) -> float:
        return self.until - time.monotonic()

    async def wait(self) -> bool:
        """Wait for the connection; whether it is up in time."""
        return self.left() > 0 and await wait_connected(self.nc, self.left())

    async def pause(self) -> bool:
        """A short, growing pause (a stream electing its leader); whether there is time for another try."""
        if self.left() <= self.pause_for:
            return False
        await asyncio.sleep(self.pause_for)
        self.pause_for = min(self.longest, self.pause_for * 2)
        return True
