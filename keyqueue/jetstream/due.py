"""``DueMover``: moves each request the server's schedules fire into its key's inbox, then gives the key a token.

When a delayed request falls due, or a periodic schedule ticks, nats-server stores the request on
``kq.Q.due.<key>`` in the queue's schedules stream (``keyqueue.jetstream.schedules``). Every worker
runs a mover on the one ``movers`` consumer of those subjects. For each due request it does what a
producer does, in the same order: store the request in ``kq.Q.in.<key>`` with its request id as
``Nats-Msg-Id``, publish the key's token (10077: the key is already held or scheduled), and only
then acknowledge the due message.

A mover that dies, or is cut off, part-way leaves the due message unacknowledged: the server
delivers it again after ``MOVERS_ACK_WAIT`` and another mover repeats the move. The inbox stores
a request id once within its duplicate window, so the repeat stores nothing new and publishes the
token the first move may not have. A due request is therefore never left in the inbox without a
token for longer than that (and the reconciler covers even that). The consumer lets one due
request be in flight for the whole fleet, so requests join their keys' inboxes in the order they
fell due, also across such a repeat.

The consumer keeps one due request in flight for the fleet, so a request that cannot be moved must
not wait there: one refused by its key's full backlog (``BacklogFull``) is scheduled again
``BACKLOG_FULL_DELAY`` later and acknowledged, so other keys' due requests go on; one that can
never be stored (an invalid key, too big) is logged and terminated. The key is then *parked*: a
record (``kq.Q.role.parked.<key>`` in the lease stream) names the request that must go first and
the latest time any of the key's due requests was scheduled again. A later due request of a
parked key is scheduled again behind that time instead of being moved, so none overtakes the
refused one; the refused one, once moved, unparks the key. A parked record whose last time is
long past (its first request was dropped) is ignored, and it expires by itself.

A periodic tick carries no request id of its own (the server fires the same definition every
time), so it gets ``<schedule name>-<sequence of the fired message>``: the same on every
delivery of one tick, different from tick to tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import nats.errors

from keyqueue.errors import BacklogFull, ConfigError, KeyqueueError, WireError
from keyqueue.jetstream.api import JetStreamApi, parse_pub_ack
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.schedules import (
    DELAYED_REQUEST_ID,
    DUE,
    MOVERS,
    PERIODIC,
    SCHEDULE_NEXT,
    SCHEDULER,
    ScheduleNames,
    ScheduleStore,
)
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire.headers import MSG_ID

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["DueMover", "due_request"]

log = logging.getLogger("keyqueue.schedules")

FETCH_WAIT: Final = 5.0
"""Seconds one pull for due requests waits on the server."""
RETRY_DELAY: Final = 1.0
"""Seconds before a due request whose move failed is delivered again."""
BACKLOG_FULL_DELAY: Final = 5.0
"""Seconds until a due request refused by a full per-key backlog is due again."""
BEHIND: Final = dt.timedelta(milliseconds=20)
"""How much later than the last one a due request of a parked key is scheduled again."""
PARKED_TTL: Final = 3600
"""Seconds a parked record is kept after its last write."""
STALE_PARKED: Final = dt.timedelta(seconds=4 * BACKLOG_FULL_DELAY)
"""A parked record whose last time is this far past is ignored (its first request was dropped)."""

_DROPPED: Final = frozenset(h.lower() for h in (SCHEDULER, SCHEDULE_NEXT, DELAYED_REQUEST_ID, DUE, MSG_ID))


def due_request(msg_subject: str, headers: dict[str, str], body: bytes, seq: int,
                names: ScheduleNames) -> OutgoingRequest:
    """The inbox request for a fired message: its key from the due subject, its request id from the
    delayed request's header, else ``<periodic name>-<seq>``; the scheduler's headers removed."""
    key = msg_subject[len(names.due_prefix):]
    lower = {k.lower(): v for k, v in headers.items()}
    request_id = lower.get(DELAYED_REQUEST_ID.lower()) or f"{lower.get(PERIODIC.lower(), 'due')}-{seq}"
    kept = {k: v for k, v in headers.items() if k.lower() not in _DROPPED}
    kept[MSG_ID] = request_id
    return OutgoingRequest(key, kept, body, request_id)


class DueMover:
    """Moves a queue's due requests into their keys' inboxes until :meth:`stop`."""

    def __init__(self, nc: Client, queue: str, *, on_moved: Callable[[OutgoingRequest], None] | None = None) -> None:
        self.nc = nc
        self.names = ScheduleNames(queue)
        self.queue_names = QueueNames(queue)
        self.api = JetStreamApi(nc)
        self.publisher = Publisher(nc, self.queue_names)
        self.store = ScheduleStore(nc, queue)
        self.on_moved = on_moved
        self.moved = 0
        """Due requests this mover stored in an inbox (a repeated move of one counts again)."""
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Finish the move in hand, then end :meth:`run`."""
        self._stopping.set()

    async def run(self) -> None:
        js = self.nc.jetstream()
        sub = await js.pull_subscribe_bind(durable=MOVERS, stream=self.names.stream)
        stopping = asyncio.ensure_future(self._stopping.wait())
        fetch: asyncio.Future[list[Msg]] | None = None
        try:
            while not self._stopping.is_set():
                fetch = asyncio.ensure_future(sub.fetch(1, timeout=FETCH_WAIT))
                await asyncio.wait([fetch, stopping], return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    # Stopping. The server skips a waiting pull whose reply subject has no interest,
                    # so once the unsubscribe below reaches it no due request goes to this pull; one
                    # delivered just before goes to another mover after MOVERS_ACK_WAIT.
                    break
                try:
                    messages = fetch.result()
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except Exception as exc:  # disconnected, server restarting: pull again shortly
                    log.debug("queue %s: pulling due requests failed: %r", self.names.queue, exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(RETRY_DELAY):
                            await self._stopping.wait()
                    continue
                for msg in messages:
                    try:
                        # Shielded: a move cut in half by a stop is harmless, but finishing it is faster.
                        await asyncio.shield(self._move(msg))
                    except Exception:  # never the worker's end: the message is delivered again
                        log.exception("queue %s: moving a due request failed", self.names.queue)
        finally:
            stopping.cancel()
            if fetch is not None and not fetch.done():  # stopped, or cancelled with the worker
                fetch.cancel()
                with contextlib.suppress(BaseException):
                    await fetch
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await self.publisher.close()

    async def _move(self, msg: Msg) -> None:
        request = due_request(msg.subject, dict(msg.headers or {}), msg.data, msg.metadata.sequence.stream,
                              self.names)
        parked = await self._parked(request.key)
        if parked is not None and parked.first != request.request_id:
            await self._delay_behind(msg, request, parked)  # an earlier due request of the key waits for room
            return
        try:
            await self.publisher.enqueue(request)
        except BacklogFull:
            await self._delay_again(msg, request, parked)
            return
        except (ConfigError, WireError) as exc:  # an invalid key, a message too big: no repeat helps
            log.error("queue %s: due request %s on %s cannot be stored (%s); it is dropped", self.names.queue,
                      request.request_id, msg.subject, exc)
            with contextlib.suppress(Exception):
                await msg.term()
            return
        except KeyqueueError as exc:  # stored or not, the token may be missing: move it again
            log.warning("queue %s: moving due request %s for key %r failed (%s); it is moved again in %gs",
                        self.names.queue, request.request_id, request.key, exc, RETRY_DELAY)
            await self._nak(msg, RETRY_DELAY)
            return
        self.moved += 1
        if parked is not None:
            await self._unpark(request.key, parked)
        if self.on_moved is not None:
            self.on_moved(request)
        try:
            # A plain ack: the consumer delivers the next due request only once the server has it, and
            # an ack that is lost means a repeat of this move after MOVERS_ACK_WAIT, which stores nothing.
            await msg.ack()
        except Exception as exc:
            log.debug("queue %s: ack of due request %s failed: %r", self.names.queue, request.request_id, exc)

    async def _delay_again(self, msg: Msg, request: OutgoingRequest, parked: _Parked | None) -> None:
        """A full per-key backlog refused the request: schedule it again a little later, park its key
        behind it, and let the next due request go (one in flight for the fleet: waiting here would
        hold up every key)."""
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=BACKLOG_FULL_DELAY)
        log.warning("queue %s: key %r's backlog is full; its due request %s is due again at %s", self.names.queue,
                    request.key, request.request_id, due.isoformat())
        try:
            await self.store.delay(request.key, request.request_id, request.headers, request.body, due,
                                   msg_id=f"{request.request_id}~again-{msg.metadata.sequence.stream}")
            last = max(due, parked.last) if parked is not None else due
            await self._park(request.key, _Parked(request.request_id, last, parked.seq if parked else 0))
        except KeyqueueError:
            await self._nak(msg, RETRY_DELAY)
            return
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _delay_behind(self, msg: Msg, request: OutgoingRequest, parked: _Parked) -> None:
        """The key is parked behind an earlier due request: schedule this one again after the last
        of the key's, so it joins the key's inbox in the order it fell due."""
        due = max(parked.last, dt.datetime.now(dt.UTC)) + BEHIND
        try:
            await self.store.delay(request.key, request.request_id, request.headers, request.body, due,
                                   msg_id=f"{request.request_id}~behind-{msg.metadata.sequence.stream}")
            await self._park(request.key, _Parked(parked.first, due, parked.seq))
        except KeyqueueError:
            await self._nak(msg, RETRY_DELAY)
            return
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _parked(self, key: str) -> _Parked | None:
        record = await self.api.get_msg(self.queue_names.lease_stream, last_by_subject=self.queue_names.parked(key),
                                        direct=False)
        if record is None:
            return None
        parked = _Parked.decode(record.data, record.seq)
        if parked is None or parked.last < dt.datetime.now(dt.UTC) - STALE_PARKED:
            return None
        return parked

    async def _park(self, key: str, parked: _Parked) -> None:
        # One due request is in flight for the fleet: nobody else writes the record meanwhile.
        parse_pub_ack(await self.api._request(self.queue_names.parked(key), parked.encode(), None,
                                              {"Nats-TTL": str(PARKED_TTL)}))

    async def _unpark(self, key: str, parked: _Parked) -> None:
        with contextlib.suppress(KeyqueueError):
            await self.api.request(f"STREAM.PURGE.{self.queue_names.lease_stream}",
                                   {"filter": self.queue_names.parked(key)})

    async def _nak(self, msg: Msg, delay: float) -> None:
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)


@dataclass(frozen=True)
class _Parked:
    """A parked key's record: the due request that must go first, and the latest time any of the
    key's due requests was scheduled again."""

    first: str
    last: dt.datetime
    seq: int = 0

    def encode(self) -> bytes:
        return json.dumps({"first": self.first, "last": self.last.isoformat()}).encode()

    @classmethod
    def decode(cls, data: bytes, seq: int) -> _Parked | None:
        try:
            body = json.loads(data)
            return cls(str(body["first"]), dt.datetime.fromisoformat(body["last"]), seq)
        except (ValueError, KeyError, TypeError):
            return None
