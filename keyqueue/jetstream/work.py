"""A queue's unkeyed requests on the wire: the work stream's consumer, pulled, and what a worker
sends for each request it is delivered.

A request of an unkeyed task (declared without ``key=``) is stored in the queue's work stream,
``KQ_Q_WORK``, on ``kq.Q.work.<task>`` (``Publisher``); the stream has work-queue retention, so
the ack of a request removes it. Every worker serving unkeyed tasks pulls the stream's one durable
consumer, ``workers`` (:class:`WorkPuller`: the token pull loop of :mod:`keyqueue.jetstream.pull`
on this stream), and for each request it is delivered sends (:class:`WorkIO`):

- ``+WPI`` as a request while it runs: the server answers it, so the worker knows the server got it
  in time and will not deliver the request to another worker yet (its *lease*, as for a key);
- ``+ACK`` once it is done (succeeded, or copied to the dead-letter queue), a plain publish: an ack
  lost with the connection means the request is delivered again and runs again, which
  at-least-once allows, while waiting for each ack's reply would cost a round trip per request;
- ``-NAK`` when the worker gives it back without running it to the end (a drain), so another
  worker takes it at once.

Nothing here decides what to do with a request: that is the unkeyed lane's (``keyqueue.core.unkeyed``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.connect import disconnected
from keyqueue.jetstream.dlq_copy import work_copy_id
from keyqueue.jetstream.mux import RequestMux
from keyqueue.jetstream.pull import PullOptions, TokenPuller, parse_ack_subject
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.subjects import UNKEYED, QueueNames
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.wire import headers as H

__all__ = ["WorkIO", "WorkItem", "WorkPuller"]

KEEPALIVE_EXPIRES: Final = 10.0
"""Seconds a keepalive's reply is waited for at most (a later one is sent meanwhile)."""


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One delivery of an unkeyed request."""

    subject: str
    reply: str
    """Its ack subject: where ``+ACK``, ``+WPI`` and ``-NAK`` go."""
    headers: Mapping[str, str]
    data: bytes
    seq: int
    """Its sequence in the work stream."""
    delivered: int
    """How many times the server has delivered it (more than 1: a redelivery)."""
    received_at: float
    """``time.monotonic()`` when it reached this process."""
    stored_at: float
    """Server wall-clock time (Unix seconds) it was stored."""

    @property
    def request_id(self) -> str:
        return self.headers.get(H.MSG_ID, "")

    def stored(self) -> StoredMsg:
        """The request as a stored message (what its dead-letter copy is made from)."""
        stamp = dt.datetime.fromtimestamp(self.stored_at, dt.UTC).isoformat() if self.stored_at else ""
        return StoredMsg(self.subject, self.seq, dict(self.headers), self.data, stamp)


class WorkPuller(TokenPuller):
    """Keeps a worker's unkeyed lane supplied with requests, never more than it has free slots for."""

    what = "unkeyed request"
    held = "unkeyed requests"

    def __init__(self, nc: Client, names: QueueNames, *, capacity: Callable[[], int],
                 on_request: Callable[[WorkItem], Awaitable[None]], options: PullOptions | None = None) -> None:
        super().__init__(nc, names, capacity=capacity, on_token=_no_tokens, options=options, stream=names.work_stream)
        self.on_request = on_request

    sync_delivery = False
    """Each request is handed to ``on_request`` and awaited, one at a time, in order."""

    def _throttled(self) -> bool:
        # Every free slot is asked for at once: an unkeyed request waits for no key, so there is
        # nothing to spread over the workers but the requests themselves, and a worker asks only
        # for what it can start.
        return False

    async def _deliver(self, msg: Msg, now: float) -> None:
        seq, delivered, stored_at, _ = parse_ack_subject(msg.reply)
        await self.on_request(WorkItem(msg.subject, msg.reply, msg.headers or {}, msg.data, seq, delivered, now,
                                       stored_at))


async def _no_tokens(token: object) -> None:
    raise AssertionError("a work stream delivers requests, not tokens")


class WorkIO:
    """What a worker sends for the unkeyed requests of one queue."""

    def __init__(self, nc: Client, config: QueueConfig) -> None:
        self.nc = nc
        self.names = config.names
        self.queue_io = QueueIO(nc, config)
        """Dead-letter copies, replies and progress, sent as a key session sends them."""
        self._keepalives = RequestMux(nc, expire_after=KEEPALIVE_EXPIRES)

    def _require_connection(self, what: str) -> None:
        # As a key session's: nothing waits in the client to be sent after a reconnect.
        if not self.nc.is_connected:
            raise disconnected(what)

    async def ack(self, item: WorkItem) -> None:
        """``+ACK``: the request is done and leaves the work stream (a plain publish; see the module docstring)."""
        self._require_connection(f"the ack of unkeyed request {item.seq}")
        await self.nc.publish(item.reply, b"+ACK")

    async def nak(self, item: WorkItem, delay: float = 0.0) -> None:
        """``-NAK``: deliver the request again (to any worker), after ``delay`` seconds."""
        self._require_connection(f"the nak of unkeyed request {item.seq}")
        body = b"-NAK" if delay <= 0 else b"-NAK " + json.dumps({"delay": int(delay * 1e9)}).encode()
        await self.nc.publish(item.reply, body)

    async def keepalive(self, item: WorkItem) -> asyncio.Future[list[Msg]]:
        """Send ``+WPI`` as a request; the future completes with the server's (empty) answer."""
        self._require_connection(f"a keepalive of unkeyed request {item.seq}")
        return await self._keepalives.send(item.reply, b"+WPI")

    async def dead_letter(self, item: WorkItem, why: Mapping[str, str]) -> None:
        """Store the request's copy in the queue's DLQ (``kq.Q.dlq.~``), once however often it is sent."""
        await self.queue_io.dead_letter(UNKEYED, item.stored(), why, dedupe=work_copy_id(item.seq))

    async def reply(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        await self.queue_io.reply(inbox, headers, body)

    async def progress(self, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Publish on ``kq.Q.progress.~`` (the request id is in the headers)."""
        await self.queue_io.progress(UNKEYED, body, headers)

    async def close(self) -> None:
        await self._keepalives.close()
        await self.queue_io.mux.close()
        await self.queue_io.read_mux.close()
