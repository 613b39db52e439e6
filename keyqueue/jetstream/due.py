"""``DueMover``: moves each request the server's schedules fire into its key's inbox, then gives the key a token
(an unkeyed request, fired to ``kq.Q.due.~``, into the queue's work stream, with no token).

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

**Whose clock.** The server fires ``@at`` by its own wall clock, so every time the mover decides
with ("5 s from now", "long past") is the server's, as :class:`ServerClock` knows it from the
stamps on the due requests, and parked records, it reads; the mover never reads its own wall
clock. That clock is never ahead of the server's: a request scheduled again is due 5 s later by
the server's clock, whatever the mover's host says (not in the past, where the server would fire
it at once, again and again), and a parked record is judged stale only once it is by the
server's clock (a mover whose clock runs ahead does not let a later request overtake a parked one).

**Bursts.** One in flight at a time, each move a few round trips, held 1,000 requests due at once
for seconds. So the mover that is delivered the one due request in flight (which no other mover
can get while it is unacknowledged: it is the fleet's lock on moving) reads up to
:data:`MOVE_BATCH` due requests stored after it in one batched direct get and moves them all,
in rounds of at most one request per key, each round one pipelined ``enqueue_many`` (requests in
stream order, then their tokens), so a key's requests still join its inbox in the order they fell
due. It then removes what it moved from the schedules stream and acknowledges the one it was
delivered. When it moved the whole batch (the usual case) that is one filtered purge of the due
subjects below the batch's end: no due request is stored before the one in flight (the consumer
delivers them in order, one at a time, and each is gone before the next: moved, or left for the
consumer to deliver next), and the batch read every one stored after it up to its end, so the
purge removes exactly the batch; it also takes the one in flight off the consumer's pending, and
the consumer delivers the next at the next pull (the mover's own, made at once). Otherwise it
deletes those it moved by sequence (the consumer skips a deleted message): a request it could
not move stays where it is, with every later one of its key, for the consumer to deliver in turn.
A mover that dies part-way leaves them all to be moved again, which stores nothing twice. A
schedules stream without direct gets (replicated, or created before this) is moved one request
at a time.

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

from keyqueue.errors import BacklogFull, ConfigError, KeyqueueError, StreamNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi, parse_pub_ack, raise_for_reply
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.schedules import (
    DELAYED_REQUEST_ID,
    DUE,
    MOVERS,
    PERIODIC,
    SCHEDULE_NEXT,
    SCHEDULER,
    ScheduleNames,
    ScheduleStore,
    parse_time,
)
from keyqueue.jetstream.server_clock import ServerClock
from keyqueue.jetstream.subjects import UNKEYED, QueueNames, validate_request_key
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
"""Seconds (by the server's clock) until a due request refused by a full per-key backlog is due again."""
BEHIND: Final = dt.timedelta(milliseconds=20)
"""How much later than the last one a due request of a parked key is scheduled again."""
PARKED_TTL: Final = 3600
"""Seconds a parked record is kept after its last write."""
STALE_PARKED: Final = dt.timedelta(seconds=4 * BACKLOG_FULL_DELAY)
"""A parked record whose last time is this far past is ignored (its first request was dropped)."""
MOVE_BATCH: Final = 256
"""Due requests one mover moves at once: the one delivered to it and those stored after it."""

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

    def __init__(self, nc: Client, queue: str, *, on_moved: Callable[[OutgoingRequest], None] | None = None,
                 clock: ServerClock | None = None) -> None:
        self.nc = nc
        self.names = ScheduleNames(queue)
        self.queue_names = QueueNames(queue)
        self.api = JetStreamApi(nc)
        self.publisher = Publisher(nc, self.queue_names)
        self.store = ScheduleStore(nc, queue)
        self.on_moved = on_moved
        self.moved = 0
        """Due requests this mover stored in an inbox (a repeated move of one counts again)."""
        self.clock = clock or ServerClock()
        """The server's time, from the stamps of what this mover reads: the only clock it decides by."""
        self._stopping = asyncio.Event()
        self._batches = False
        """Whether the schedules stream allows direct gets: then due requests are moved in batches."""
        self._mux = RequestMux(nc)
        """The deletes of the due requests a batch moved, in flight together."""

    def stop(self) -> None:
        """Finish the move in hand, then end :meth:`run`."""
        self._stopping.set()

    async def run(self) -> None:
        js = self.nc.jetstream()
        sub = await js.pull_subscribe_bind(durable=MOVERS, stream=self.names.stream)
        with contextlib.suppress(KeyqueueError):
            self._batches = bool((await self.api.stream_info(self.names.stream))["config"].get("allow_direct"))
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
                        await asyncio.shield(self._move_batch(msg) if self._batches else self._move(msg))
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
            await self._mux.close()

    async def _move(self, msg: Msg) -> None:
        self.clock.saw(msg.metadata.timestamp)
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

    async def _move_batch(self, head: Msg) -> None:
        """Move ``head`` (the one due request in flight: while it is unacknowledged no other mover gets
        any) and up to ``MOVE_BATCH - 1`` stored after it; see "Bursts" in the module docstring."""
        first = head.metadata.sequence.stream
        self.clock.saw(head.metadata.timestamp)
        try:
            ahead, _ = await self.api.get_batch(self.names.stream, seq=first + 1, batch=MOVE_BATCH - 1,
                                                next_by_subject=self.names.due_prefix + ">")
            for stored in ahead:
                self.clock.saw(_stamp(stored.timestamp))
            parked = await self._parked_keys()
        except KeyqueueError as exc:
            log.debug("queue %s: no batch of due requests (%r); moving one", self.names.queue, exc)
            await self._move(head)
            return
        batch = [(first, head.subject, dict(head.headers or {}), head.data)]
        batch += [(m.seq, m.subject, dict(m.headers), m.data) for m in ahead]
        moved = await self._move_in_rounds(batch, parked)
        # Stopping, the mover makes no next pull: then the deletes and the ack let the consumer go on.
        if len(moved) == len(batch) and not self._stopping.is_set() and await self._purge_below(batch[-1][0] + 1):
            with contextlib.suppress(Exception):
                await head.ack()  # no-op: the purge took it off the consumer's pending
            return
        deletes = []
        for seq in sorted(moved - {first}):
            with contextlib.suppress(KeyqueueError):
                deletes.append(await self._mux.send(f"{self.api.prefix}.STREAM.MSG.DELETE.{self.names.stream}",
                                                    b'{"seq":%d,"no_erase":true}' % seq))
        for sent in deletes:  # a delete that failed leaves a request that is moved again: it stores nothing
            with contextlib.suppress(Exception):
                [reply] = await wait(sent, self.api.timeout, "the delete of a moved due request")
                raise_for_reply(json.loads(reply.data))
        if first in moved:
            with contextlib.suppress(Exception):
                await head.ack()
        else:
            await self._nak(head, RETRY_DELAY)

    async def _purge_below(self, end: int) -> bool:
        """Remove every due request stored before sequence ``end`` in one purge; whether it was done
        (if not, the caller deletes what it moved one by one)."""
        try:
            await self.api.request(f"STREAM.PURGE.{self.names.stream}",
                                   {"filter": self.names.due_prefix + ">", "seq": end})
        except KeyqueueError as exc:
            log.debug("queue %s: purging moved due requests failed (%r); deleting them", self.names.queue, exc)
            return False
        return True

    async def _move_in_rounds(self, batch: list[tuple[int, str, dict[str, str], bytes]],
                              parked: dict[str, _Parked]) -> set[int]:
        """Move ``batch`` (due requests in stream order) in rounds of at most one request per key;
        returns the sequences of those handled (moved, scheduled again, or dropped). A key whose
        request could not be handled keeps it and every later one where they are."""
        rounds: list[list[tuple[int, OutgoingRequest]]] = []
        depth: dict[str, int] = {}
        for seq, subject, headers, data in batch:
            request = due_request(subject, headers, data, seq, self.names)
            # Unkeyed requests keep no order: all of them go in the first round.
            n = 0 if request.key == UNKEYED else depth.setdefault(request.key, -1) + 1
            depth[request.key] = n
            if n == len(rounds):
                rounds.append([])
            rounds[n].append((seq, request))
        handled: set[int] = set()
        stuck: set[str] = set()
        for round_ in rounds:
            to_move: list[tuple[int, OutgoingRequest]] = []
            for seq, request in round_:
                if request.key in stuck:
                    continue
                try:
                    validate_request_key(request.key)
                except ConfigError as exc:
                    log.error("queue %s: due request %s cannot be stored (%s); it is dropped", self.names.queue,
                              request.request_id, exc)
                    handled.add(seq)
                    continue
                behind = parked.get(request.key)
                if behind is not None and behind.first != request.request_id:
                    # An earlier due request of the key waits for room: this one goes behind it.
                    again = await self._schedule_behind(seq, request, behind)
                    if again is None:
                        stuck.add(request.key)
                    else:
                        parked[request.key] = again
                        handled.add(seq)
                    continue
                to_move.append((seq, request))
            if not to_move:
                continue
            results = await self.publisher.enqueue_many([request for _, request in to_move])
            for (seq, request), result in zip(to_move, results, strict=True):
                if isinstance(result, Enqueued):
                    handled.add(seq)
                    self.moved += 1
                    if (behind := parked.pop(request.key, None)) is not None:
                        await self._unpark(request.key, behind)
                    if self.on_moved is not None:
                        self.on_moved(request)
                elif isinstance(result, BacklogFull):
                    again = await self._schedule_again(seq, request, parked.get(request.key))
                    if again is None:
                        stuck.add(request.key)
                    else:
                        parked[request.key] = again
                        handled.add(seq)
                else:  # not stored, or stored without a token: moved again when the consumer delivers it
                    log.warning("queue %s: moving due request %s for key %r failed (%s); it is moved again",
                                self.names.queue, request.request_id, request.key, result)
                    stuck.add(request.key)
        return handled

    async def _parked_keys(self) -> dict[str, _Parked]:
        """Every parked key's record (one batched read of the lease stream; usually there is none)."""
        prefix = self.queue_names.parked("")
        try:
            found, _ = await self.api.get_batch(self.queue_names.lease_stream, multi_last=[prefix + ">"])
        except StreamNotFound:
            return {}
        parked = {}
        for record in found:
            self.clock.saw(_stamp(record.timestamp))
        now = self.clock.now()
        for record in found:
            decoded = _Parked.decode(record.data, record.seq)
            if decoded is not None and decoded.last >= now - STALE_PARKED:
                parked[record.subject[len(prefix):]] = decoded
        return parked

    async def _schedule_again(self, seq: int, request: OutgoingRequest, parked: _Parked | None) -> _Parked | None:
        """A full per-key backlog refused the due request at ``seq``: schedule it again a little later
        and park its key behind it; the key's parked record after it, None if that failed."""
        due = self.clock.now() + dt.timedelta(seconds=BACKLOG_FULL_DELAY)
        log.warning("queue %s: key %r's backlog is full; its due request %s is due again at %s", self.names.queue,
                    request.key, request.request_id, due.isoformat())
        try:
            await self.store.delay(request.key, request.request_id, request.headers, request.body, due,
                                   msg_id=f"{request.request_id}~again-{seq}")
            last = max(due, parked.last) if parked is not None else due
            record = _Parked(request.request_id, last, parked.seq if parked else 0)
            await self._park(request.key, record)
        except KeyqueueError:
            return None
        return record

    async def _schedule_behind(self, seq: int, request: OutgoingRequest, parked: _Parked) -> _Parked | None:
        """The key is parked behind an earlier due request: schedule the one at ``seq`` again after the
        last of the key's, so it joins the key's inbox in the order it fell due; the key's parked
        record after it, None if that failed."""
        due = max(parked.last, self.clock.now()) + BEHIND
        try:
            await self.store.delay(request.key, request.request_id, request.headers, request.body, due,
                                   msg_id=f"{request.request_id}~behind-{seq}")
            record = _Parked(parked.first, due, parked.seq)
            await self._park(request.key, record)
        except KeyqueueError:
            return None
        return record

    async def _delay_again(self, msg: Msg, request: OutgoingRequest, parked: _Parked | None) -> None:
        """:meth:`_schedule_again` for the one due request in flight, then the next may go (one is in
        flight for the fleet: waiting here would hold up every key)."""
        await self._settle(msg, await self._schedule_again(msg.metadata.sequence.stream, request, parked))

    async def _delay_behind(self, msg: Msg, request: OutgoingRequest, parked: _Parked) -> None:
        """:meth:`_schedule_behind` for the one due request in flight."""
        await self._settle(msg, await self._schedule_behind(msg.metadata.sequence.stream, request, parked))

    async def _settle(self, msg: Msg, scheduled: _Parked | None) -> None:
        """Ack the due request in flight once it is scheduled again (else it comes back a little later)."""
        if scheduled is None:
            await self._nak(msg, RETRY_DELAY)
            return
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _parked(self, key: str) -> _Parked | None:
        record = await self.api.get_msg(self.queue_names.lease_stream, last_by_subject=self.queue_names.parked(key),
                                        direct=False)
        if record is None:
            return None
        self.clock.saw(_stamp(record.timestamp))
        parked = _Parked.decode(record.data, record.seq)
        if parked is None or parked.last < self.clock.now() - STALE_PARKED:
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


def _stamp(timestamp: str) -> dt.datetime | None:
    """A stored message's server timestamp (RFC 3339), None when there is none or it is unreadable."""
    try:
        return parse_time(timestamp) if timestamp else None
    except ValueError:
        return None


@dataclass(frozen=True)
class _Parked:
    """A parked key's record: the due request that must go first, and the latest time (the
    server's) any of the key's due requests was scheduled again."""

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
