"""The token pull loop: ADR-37's consume() on nats-py's core client, with ADR-42 pull fields.

The worker says how many key sessions it can start (free slots); the puller keeps exactly that
many tokens requested from the ``workers`` consumer, accounting for what each pull request
delivered or gave back (the ``Nats-Pending-Messages`` header of 408/409 statuses), detects
missed idle heartbeats, and starts over after a reconnect. A lost or closed connection never
ends the loop: it waits, and pulls afresh once the connection is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import ConsumerNotFound, KeyqueueError
from keyqueue.jetstream.api import DESCRIPTION, STATUS, JetStreamApi
from keyqueue.jetstream.connect import CONNECTION_DOWN
from keyqueue.jetstream.mux import SyncDispatch
from keyqueue.jetstream.subjects import QueueNames

log = logging.getLogger("keyqueue.pull")

NS: Final = 1_000_000_000
PENDING_MESSAGES: Final = "Nats-Pending-Messages"
"""Header on 408/409 statuses: how many messages of that pull request were not delivered."""
PULLS_PER_WORKER: Final = 8
"""A worker's free slots are requested in about this many pull requests (see TokenPuller.run)."""
OUTSTANDING_CHUNKS: Final = 2
"""Chunks a worker keeps requested at once."""
PULL_CHUNK_MIN: Final = 4
"""Smallest batch of one pull request when a worker has more free slots than that."""
NO_RESPONDERS_BACKOFF_MAX: Final = 2.0
"""Longest wait, in seconds, before pulling again after the consumer answered 503 (no leader)."""
NO_RESPONDERS_LOG_INTERVAL: Final = 30.0
"""Seconds between warnings while the consumer keeps answering 503."""
PIN_ID: Final = "Nats-Pin-Id"
"""Header on messages of a pinned priority group: the pin this client must send on its pulls."""


@dataclass(frozen=True, slots=True)
class Token:
    """A delivered key token: holding it (unacked, lease alive) is owning the key."""

    key: str
    subject: str
    reply: str
    stream_seq: int
    delivered: int
    received_at: float
    """``time.monotonic()`` when the token reached this process."""
    stored_at: float = 0.0
    """Server wall-clock time (Unix seconds) the token was stored, from the ack subject."""
    pending: int = 0
    """Tokens still waiting for a worker when this one was delivered (other keys scheduled)."""

    @property
    def fencing(self) -> tuple[int, int]:
        """``(token seq, delivery count)``: strictly increases from one holder of a key to the next."""
        return (self.stream_seq, self.delivered)


def chunk_size(capacity: int) -> int:
    """The batch of one pull request for a worker with ``capacity`` free slots.

    The server fills waiting pull requests in arrival order, each up to its batch: one pull for
    every free slot would hand a burst of keys to one worker while the others sit idle. A worker
    keeps about two chunks requested at a time, so its next pull queues behind other workers'
    waiting pulls and keys spread out.
    """
    return max(PULL_CHUNK_MIN, -(-capacity // PULLS_PER_WORKER))


LEADERSHIP_CHANGE: Final = "Leadership Change"
"""Description of the 409 a replicated consumer's new leader sends to each pull request that was
waiting at the old one (nats-server replicates which requests wait, for this)."""


def no_responders_backoff(streak: int) -> float:
    """Seconds to wait before pulling again after ``streak`` refused pulls in a row (503, 409, an
    unknown status; doubling, capped)."""
    return min(NO_RESPONDERS_BACKOFF_MAX, 0.05 * 2.0 ** min(streak, 6))


def parse_ack_subject(reply: str) -> tuple[int, int, float, int]:
    """``(stream seq, delivery count, stored time, pending)`` from a JetStream ack subject (v1 or v2)."""
    parts = reply.split(".")
    if len(parts) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(parts[5]), int(parts[4]), int(parts[7]) / NS, int(parts[8])
    if len(parts) >= 12:  # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.
        return int(parts[7]), int(parts[6]), int(parts[9]) / NS, int(parts[10])
    raise ValueError(f"not a JetStream ack subject: {reply!r}")


@dataclass(slots=True)
class PullOptions:
    """What every pull request carries: expiry, heartbeats, and ADR-42 priority-group fields."""

    expires: float = 5.0
    """Seconds a pull request waits on the server. A worker stopped (SIGSTOP, a frozen VM) with one
    outstanding can be handed tokens it cannot act on until then (they come back after their ack
    wait), so this is kept short."""
    heartbeat: float = 1.0
    """Seconds between the server's idle heartbeats; two missed (a consumer leader gone) and the
    worker pulls afresh from the new leader."""
    group: str | None = None
    min_pending: int = 0
    min_ack_pending: int = 0
    priority: int | None = None

    def request(self, batch: int, pin_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"batch": batch, "expires": int(self.expires * NS),
                                "idle_heartbeat": int(self.heartbeat * NS)}
        if self.group:
            body["group"] = self.group
            if self.min_pending:
                body["min_pending"] = self.min_pending
            if self.min_ack_pending:
                body["min_ack_pending"] = self.min_ack_pending
            if self.priority is not None:
                body["priority"] = self.priority
            if pin_id:
                body["id"] = pin_id
        return body


@dataclass(slots=True)
class PullState:
    """The puller's bookkeeping, kept apart from I/O so it can be unit-tested."""

    pending: int = 0
    """Tokens requested by outstanding pull requests and not yet delivered or given back."""
    last_activity: float = field(default_factory=time.monotonic)
    pin_id: str | None = None

    def wanted(self, capacity: int) -> int:
        """How many more tokens to request so requested + held matches ``capacity``."""
        return max(0, capacity - self.pending)

    def to_request(self, capacity: int, chunk: int, *, throttled: bool) -> int:
        """How many tokens to request now: :meth:`wanted`, and when ``throttled`` no more than
        :data:`OUTSTANDING_CHUNKS` chunks outstanding in all."""
        want = self.wanted(capacity)
        if throttled:
            want = min(want, OUTSTANDING_CHUNKS * chunk - self.pending)
        return max(0, want)

    def requested(self, batch: int, now: float) -> None:
        if self.pending == 0:
            self.last_activity = now
        self.pending += batch

    def delivered(self, now: float) -> None:
        self.pending = max(0, self.pending - 1)
        self.last_activity = now

    def given_back(self, count: int | None, now: float) -> None:
        """A pull request ended (408/409) with ``count`` undelivered; unknown count resets."""
        self.pending = 0 if count is None else max(0, self.pending - count)
        self.last_activity = now

    def heartbeat_missed(self, now: float, heartbeat: float) -> bool:
        return self.pending > 0 and now - self.last_activity > 2 * heartbeat

    def reset(self) -> None:
        self.pending = 0


class TokenPuller:
    """Keeps the worker supplied with tokens, never more than it has free slots for.

    A subclass pulls another consumer of the queue's (``WorkPuller``: unkeyed requests) by naming
    its stream and what its messages are (:attr:`what`, :attr:`held`) and overriding :meth:`_deliver`.
    """

    what = "token"
    """What this puller pulls, for log lines."""
    held = "keys"
    """What a worker holds by them, for log lines."""

    def __init__(self, nc: Client, names: QueueNames, *, capacity: Callable[[], int],
                 on_token: Callable[[Token], Awaitable[None] | None], options: PullOptions | None = None,
                 on_pinned: Callable[[str | None], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic, stream: str | None = None,
                 on_answered_again: Callable[[], None] | None = None) -> None:
        self.nc = nc
        self.names = names
        self.stream = stream or names.token_stream
        """The stream whose ``workers`` consumer is pulled (the token stream unless given)."""
        self.api = JetStreamApi(nc)
        self.capacity = capacity
        self.on_token = on_token
        self.on_pinned = on_pinned
        self.on_answered_again = on_answered_again
        """Called when the consumer answers again (a delivery or a heartbeat) after refusing pulls."""
        self.options = options or PullOptions()
        self.clock = clock
        self.state = PullState(last_activity=clock())
        self._wake = asyncio.Event()
        self._stopped = False
        self._inbox = nc.new_inbox()
        self._resubscribe = False
        self._chunk = PULL_CHUNK_MIN
        self._generation = 0
        self.dropped = 0
        """Deliveries ignored because they answered abandoned pull requests."""
        self._closed_reported = False
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{names.consumer}"
        self.statuses: dict[str, int] = {}
        """Counts of status codes seen, for tests and ``inspect``."""
        self._refused = 0
        """Pulls refused in a row: 503, 409 or a status this puller does not know (reset by any delivery
        or heartbeat)."""
        self._no_responders_logged = -2 * NO_RESPONDERS_LOG_INTERVAL
        self._retry_at = 0.0
        """No pull before this time (on ``clock``): set while the consumer answers 503."""
        self._tasks: set[asyncio.Future[Any]] = set()
        """What deliveries handled from the read loop left to await, while it runs."""
        self._checking: asyncio.Task[None] | None = None
        """The consumer check begun after missed heartbeats, while it runs (pulls do not wait for it)."""

    def wake(self) -> None:
        """Call when a slot frees up (or anything else changes what should be requested)."""
        self._wake.set()

    def reconnected(self) -> None:
        """Pull requests do not survive a reconnect: forget them and pull afresh."""
        self.state.reset()
        self._wake.set()

    def abandon_pulls(self) -> None:
        """Ignore every delivery to the pull requests sent so far, and pull afresh.

        After this process stalled (paused, frozen) past the ack wait, tokens delivered to its
        old pull requests may already belong to another worker: they are dropped untouched.
        """
        self._inbox = self.nc.new_inbox()
        self._generation += 1
        self._resubscribe = True
        self.state.reset()
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        """Pull until stopped. Tokens are handed to ``on_token``."""
        sub: Any = None
        n = 0
        try:
            while not self._stopped:
                if sub is None or self._resubscribe:
                    self._resubscribe = False
                    if sub is not None:
                        await self._unsubscribe(sub)
                    sub = await self._subscribe_or_none()
                now = self.clock()
                if self.state.heartbeat_missed(now, self.options.heartbeat):
                    log.warning("queue %s: missed idle heartbeats from the server; pulling afresh",
                                self.names.queue)
                    self.state.reset()
                    # Whether the consumer is gone is only worth a log line: pulling afresh must
                    # not wait for the answer, which a consumer with no leader yet never sends
                    # (the API's 5 s timeout, in which this worker took no key).
                    if self._checking is None or self._checking.done():
                        self._checking = asyncio.create_task(self._check_consumer())
                capacity = self.capacity()
                chunk = self._chunk = chunk_size(capacity)
                # With priorities the server must see every free slot of a better tier waiting,
                # or a worse tier gets keys first: no throttle there.
                want = self.state.to_request(capacity, chunk, throttled=self._throttled())
                if now < self._retry_at:
                    want = 0
                while want > 0 and sub is not None and self.nc.is_connected:
                    batch = min(want, chunk)
                    n += 1
                    body = self.options.request(batch, self.state.pin_id)
                    self.state.requested(batch, now)
                    try:
                        await self.nc.publish(self._next_subject, json.dumps(body).encode(),
                                              reply=f"{self._inbox}.{n}")
                    except CONNECTION_DOWN as e:
                        # Nothing was sent (nothing is buffered while disconnected): wait for the
                        # connection to come back and pull afresh.
                        self._connection_down(e)
                        break
                    want -= batch
                self._wake.clear()
                wait = self.options.heartbeat if now >= self._retry_at else self._retry_at - now
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
        finally:
            if self._checking is not None:
                self._checking.cancel()
            if sub is not None:
                await self._unsubscribe(sub)

    def _throttled(self) -> bool:
        """Whether at most :data:`OUTSTANDING_CHUNKS` chunks are requested at a time (so that keys
        spread over the workers); with priorities the server must see every free slot of a better
        tier waiting, or a worse tier gets keys first."""
        return self.options.priority is None

    def _connection_down(self, error: BaseException) -> None:
        self.state.reset()
        if self.nc.is_closed and not self._closed_reported:
            self._closed_reported = True  # nats-py never reopens a closed connection: say it once
            log.warning("queue %s: the NATS connection is closed, so this worker takes no more %s; a closed "
                        "connection does not reopen: stop the worker and start it on a new one (%s)",
                        self.names.queue, self.held, type(error).__name__)
        elif not self.nc.is_closed:
            log.debug("queue %s: cannot pull %ss while disconnected (%s); pulling again once reconnected",
                      self.names.queue, self.what, type(error).__name__)

    async def _subscribe_or_none(self) -> Any:
        """The delivery subscription, or None while the connection cannot take one (tried again later)."""
        try:
            return await self._subscribe()
        except CONNECTION_DOWN as e:
            self._connection_down(e)
            return None

    async def _unsubscribe(self, sub: Any) -> None:
        # A closed connection has dropped every subscription already.
        with contextlib.suppress(*CONNECTION_DOWN):
            await sub.unsubscribe()

    async def _check_consumer(self) -> None:
        try:
            await self.api.consumer_info(self.stream, self.names.consumer)
        except ConsumerNotFound:
            log.error("queue %s: the %s consumer %s is gone; workers recreate it on restart",
                      self.names.queue, self.what, self.names.consumer)
        except KeyqueueError as e:
            log.warning("queue %s: cannot check the %s consumer: %s", self.names.queue, self.what, e)

    async def _subscribe(self) -> Any:
        generation = self._generation

        async def on_msg(msg: Msg) -> None:
            await self._on_msg(msg, generation)

        sub = await self.nc.subscribe(self._inbox + ".*", cb=on_msg)
        if self.sync_delivery:
            # Each delivery is handled from the connection's read loop (jetstream/mux.py's
            # SyncDispatch): no queue entry, task wake-up or coroutine per token; what must be
            # awaited (rarely: a hand-back, a pin change, an async on_token) runs as a task.
            SyncDispatch.install(sub, lambda msg: self._start(self._on_msg_now(msg, generation)))
        return sub

    sync_delivery = True
    """Whether deliveries are handled from the connection's read loop (a subclass whose delivery
    must be awaited in order, one at a time, says False)."""

    def _start(self, steps: list[Awaitable[Any]] | None) -> None:
        """Run what a delivery handled at once left to await, in order, as one task."""
        if steps:
            task = asyncio.ensure_future(_in_order(steps))
            self._tasks.add(task)
            task.add_done_callback(self._started)

    def _started(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("queue %s: handling a delivered %s failed", self.names.queue, self.what,
                      exc_info=task.exception())

    async def _on_msg(self, msg: Msg, generation: int) -> None:
        """Handle a delivery and await what it left to await (the subscription's callback when
        deliveries are not handled from the read loop; tests call it too)."""
        await _in_order(self._on_msg_now(msg, generation) or [])

    def _on_msg_now(self, msg: Msg, generation: int) -> list[Awaitable[Any]] | None:
        """Handle a delivery at once; returns what is left to await, in order (None: nothing)."""
        if generation != self._generation:
            # A token delivered while this process was stalled: hand it back at once rather than
            # leave it until its ack wait ends (nobody would start its key meanwhile). Harmless if it
            # went to another worker since: a token is a hint, the lease record decides.
            self.dropped += 1
            if msg.reply and not (msg.headers or {}).get(STATUS):
                log.warning("queue %s: handing back a %s delivered to an abandoned pull request", self.names.queue,
                            self.what)
                return [self._hand_back_stale(msg.reply)]
            return None
        now = self.clock()
        headers = msg.headers or {}
        status = headers.get(STATUS)
        if not status:
            self._answered()
            self.state.delivered(now)
            if self.state.pending < self._chunk:
                self._wake.set()  # a chunk was used up: request the next one
            steps: list[Awaitable[Any]] = []
            pin = headers.get(PIN_ID)
            if pin and pin != self.state.pin_id:
                self.state.pin_id = pin
                if self.on_pinned:
                    steps.append(self.on_pinned(pin))
            delivered = self._deliver(msg, now)
            if delivered is not None:
                steps.append(delivered)
            return steps
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == "100":  # idle heartbeat
            self._answered()
            self.state.last_activity = now
            return None
        pinned = self._on_status(status, headers, now)
        self._wake.set()
        return pinned

    def _answered(self) -> None:
        if self._refused and self.on_answered_again is not None:
            self.on_answered_again()
        self._refused = 0

    async def _hand_back_stale(self, reply: str) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(reply, b"-NAK")

    def _on_status(self, status: str, headers: Mapping[str, str], now: float) -> list[Awaitable[Any]] | None:
        """A pull's end (or refusal): what the server did not deliver is requested again."""
        steps: list[Awaitable[Any]] | None = None
        count = headers.get(PENDING_MESSAGES)
        if status in ("404", "408"):
            self.state.given_back(int(count) if count else None, now)
        elif status == "409" and headers.get(DESCRIPTION, "").startswith(LEADERSHIP_CHANGE):
            # The consumer's new leader answers the old one's waiting pull requests so: it is up,
            # ask it at once. (Each waiting request gets one; counted as refusals, a worker with
            # a few outstanding backed off for up to 2 s, taking no key.)
            self.state.given_back(int(count) if count else None, now)
            self._answered()
            self._retry_at = 0.0
            log.debug("queue %s: pull ended: 409 %s", self.names.queue, LEADERSHIP_CHANGE)
        elif status == "409":
            # The consumer refused the pull (its limits, a deleted consumer, ...): sent again at
            # once, it would most likely be refused again, a round trip after round trip.
            self.state.given_back(int(count) if count else None, now)
            self._back_off(now)
            log.debug("queue %s: pull ended: 409 %s", self.names.queue, headers.get(DESCRIPTION, ""))
        elif status == "423":  # our pin id is no longer the pinned one
            self.state.given_back(int(count) if count else None, now)
            if self.state.pin_id is not None:
                self.state.pin_id = None
                if self.on_pinned:
                    steps = [self.on_pinned(None)]
        elif status == "503":
            # No responders: the consumer has no leader right now (an election after its leader
            # died). Pulling again at once would spin; back off until it answers again.
            self.state.given_back(None, now)
            self._back_off(now)
            if now - self._no_responders_logged >= NO_RESPONDERS_LOG_INTERVAL:
                self._no_responders_logged = now
                log.warning("queue %s: the %s consumer does not answer pulls (503 no responders: no leader "
                            "yet?); retrying with a backoff", self.names.queue, self.what)
        else:
            log.warning("queue %s: unexpected pull status %s %s", self.names.queue, status,
                        headers.get(DESCRIPTION, ""))
            self.state.given_back(None, now)
            self._back_off(now)
        return steps

    def _deliver(self, msg: Msg, now: float) -> Awaitable[None] | None:
        """Hand a delivered message (not a status) to the worker: here, as a :class:`Token`. Returns
        what ``on_token`` left to await, if anything."""
        seq, delivered, stored_at, pending = parse_ack_subject(msg.reply)
        token = Token(self.names.key_of(msg.subject), msg.subject, msg.reply, seq, delivered, now, stored_at, pending)
        return self.on_token(token)

    def _back_off(self, now: float) -> None:
        """No pull until a pause that grows with each refusal in a row (the run loop waits for it)."""
        self._refused += 1
        self._retry_at = now + no_responders_backoff(self._refused)


async def _in_order(steps: list[Awaitable[Any]]) -> None:
    for step in steps:
        await step
