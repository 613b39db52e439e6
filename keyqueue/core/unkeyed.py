"""The unkeyed lane: what a queue worker runs for its queue's unkeyed tasks, beside its key sessions.

    pull (free slots) ─► crash-loop check ─► handle ─► ok: ack, reply
                                                  └► fail: backoff (slot lent), retry in place, or DLQ + ack
    +WPI every ack_wait/3 while a request is in hand (confirmed; none in time: the run is cut off, no ack)

A task declared without ``key=`` promises no exclusivity and no order, so its requests need no
lock: each is stored in the queue's work stream and delivered to one worker by the stream's
consumer (``keyqueue.jetstream.work``), which runs it as soon as it has a free slot and acks it
(one publish) once it is done. No token, no lease record, no read of a key's inbox: a request
costs what a plain JetStream work queue costs (docs/architecture.md, "Unkeyed requests").

Everything else is the key session's, reused rather than copied: the processor (built by the same
factory for the key :data:`~keyqueue.jetstream.subjects.UNKEYED`: the default processor with the
app's unkeyed tasks, so cancels, kept results, rate limits, expiry and a task's retry policy work
as for a key), the :class:`~keyqueue.core.observer.SessionObserver` (the same log lines, counts
and lifecycle hooks, with the key ``~``), :class:`~keyqueue.core.retry.RetryPolicy`,
:class:`~keyqueue.core.slots.Slots`, :class:`~keyqueue.core.lease.Lease`, the one loop that rides
out an outage (:func:`~keyqueue.core.outage.ride_out`) and the dead letters' headers
(:func:`~keyqueue.core.dead_lettering.dead_letter_reasons`).

What differs from a key session, and why:

- *Leases are the consumer's.* While a request is in hand (running, or waiting out a backoff) the
  lane keeps it with ``+WPI`` sent as a request; the lease is extended by the answers, as a key's
  is. A request whose lease ends anyway (the connection stayed down) may be delivered to another
  worker: its run here is cut off (an async one cancelled) and nothing more is sent for it. A run
  that finished is acked even late: the ack can only spare a second run.
- *Attempts are counted in hand.* A failed attempt is retried in place after its backoff (the
  request stays with this worker, its slot lent to other work meanwhile), up to its task's
  ``max_attempts``, then dead-lettered with the reason. A worker that dies with a request in hand
  leaves it to be delivered again, attempts starting over; one delivered more than
  ``crash_loop_limit`` times (its workers keep dying on it) is dead-lettered before it runs
  (``crash-loop``). The consumer's own ``max_deliver`` stays unlimited: a request the server
  stopped delivering would stay stored and never run.
- *A drain* naks the requests it does not finish (so another worker takes them at once) and, past
  its deadline, cuts off the runs still going (they run again elsewhere), as for keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from nats.aio.client import Client

from keyqueue.core.dead_lettering import answerable, dead_letter_reasons
from keyqueue.core.lease import Lease
from keyqueue.core.observer import DeadLetterReason, RequestAttempt, SessionObserver
from keyqueue.core.outage import RETRIED, Deadline, ride_out
from keyqueue.core.processor import CloseReason, HoldRemoval, KeyProcessor, ProcessorFactory, Reply, Request
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.slots import Slots
from keyqueue.errors import InvalidSubject, KeyqueueError, LeaseLost, Reject, WireError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.jetstream.work import WorkIO, WorkItem, WorkPuller
from keyqueue.wire import headers as H

__all__ = ["LaneSettings", "UnkeyedLane"]

log = logging.getLogger("keyqueue.worker")

T = TypeVar("T")

DRAIN_GRACE: Final = 2.0
"""Seconds cut-off runs have to end after the drain deadline (a sync task to see its stop)."""

OPEN_PATIENCE: Final = 60.0
"""Seconds the lane's processor may take to open through an outage (loading the cancel records)."""


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """How the lane behaves: the queue worker's session settings that apply to it."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """The retry policy of a request whose processor names none."""
    crash_loop_limit: int = 10
    """A request delivered more than this many times is dead-lettered before it runs."""
    drain_timeout: float = 10.0


class _Run:
    """One unkeyed request in hand: the ``RequestContext`` its processor receives, and its lease."""

    __slots__ = ("_log", "_stored", "attempt", "fencing", "item", "key", "lane", "lease", "lost", "next_keepalive",
                 "queue", "request_id", "task")

    hold_removal: HoldRemoval | None = None
    """The request is acked once its processor returns: a write it owes is awaited by the processor."""

    def __init__(self, lane: UnkeyedLane, item: WorkItem) -> None:
        self.lane = lane
        self.item = item
        self.queue = lane.names.queue
        self.key = UNKEYED
        self.fencing = (item.seq, item.delivered)
        """``(work stream sequence, delivery count)``: increases from one delivery of the request to the next."""
        self.request_id = item.request_id
        self.attempt = 0
        self.lease = Lease(lane.ack_wait, item.received_at)
        self.next_keepalive = item.received_at + lane.ack_wait / 3
        self.lost = False
        """Its lease ended while it ran: the lane cut it off."""
        self.task: asyncio.Task[None] | None = None
        self._log: logging.LoggerAdapter[logging.Logger] | None = None
        self._stored: str | None = None

    @property
    def stored(self) -> str:
        """When the server stored the request (RFC 3339, its clock), "" where unknown."""
        if self._stored is None:
            at = self.item.stored_at
            self._stored = dt.datetime.fromtimestamp(at, dt.UTC).isoformat() if at else ""
        return self._stored

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        if self._log is None:
            self._log = logging.LoggerAdapter(logging.getLogger("keyqueue.task"),
                                              {"queue": self.queue, "key": self.key, "request_id": self.request_id})
        return self._log

    def lease_valid(self) -> bool:
        return self.lease.valid()

    def lease_remaining(self) -> float:
        return max(0.0, self.lease.remaining()) if self.lease.valid() else 0.0

    def check_lease(self) -> None:
        self.lease.check()

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()`` (idempotent), again after a transient NATS failure while the lease holds
        (``SessionContext.steady``): keyqueue's own I/O around a run costs no attempt."""
        return await ride_out(step, self.lease, self.lane.io.queue_io)

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (a rate limit's wait) keeping the request but lending its slot."""
        async with self.lane.slots.parked_while(self.lane.draining):
            await asyncio.sleep(seconds)

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.check_lease()
        extra = {H.REQUEST_ID: self.request_id} if self.request_id else {}
        await self.lane.io.progress(data, {**extra, **(headers or {})})

    def adopt(self, item: WorkItem) -> None:
        """The server delivered this request again while it is in hand here (a keepalive came late):
        carry on with the newer delivery, whose ack subject counts now."""
        self.item = item
        self.fencing = (item.seq, item.delivered)
        if self.lease.valid():
            self.lease = Lease(self.lease.ack_wait, item.received_at)


class _LaneContext:
    """The ``SessionContext`` the lane's processor is opened and closed with."""

    def __init__(self, lane: UnkeyedLane) -> None:
        self.lane = lane
        self.queue = lane.names.queue
        self.key = UNKEYED
        self.fencing = (0, 0)
        self.log = logging.LoggerAdapter(logging.getLogger("keyqueue.task"), {"queue": self.queue, "key": UNKEYED})

    def lease_valid(self) -> bool:
        return True

    def check_lease(self) -> None:
        return None

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """A processor's own step at open (loading the cancel records), again after a lost connection."""
        return await ride_out(step, Deadline(OPEN_PATIENCE, "opening the unkeyed lane's processor"),
                              self.lane.io.queue_io)

    def lease_remaining(self) -> float:
        return math.inf  # the lane holds no key: nothing to lose while it opens or closes

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        await self.lane.io.progress(data, headers)


class UnkeyedLane:
    """Runs a queue's unkeyed requests, at most ``concurrency`` at once (see the module docstring).

    Owned by the queue worker (``keyqueue.core.worker``): :meth:`prepare` once its queue is set up,
    :meth:`run` beside its key sessions, :meth:`stop` when it drains.
    """

    def __init__(self, nc: Client, config: QueueConfig, factory: ProcessorFactory, settings: LaneSettings, *,
                 observer: SessionObserver, concurrency: int) -> None:
        self.nc = nc
        self.config = config
        self.names = config.names
        self.factory = factory
        self.settings = settings
        self.observer = observer
        self.ack_wait = config.ack_wait
        """The work consumer's ack wait, as the server has it (read by :meth:`prepare`)."""
        self.io = WorkIO(nc, config)
        self.runs: dict[int, _Run] = {}
        """The requests in hand, by work stream sequence."""
        self.slots = Slots(concurrency, lambda: len(self.runs), freed=self._slot_freed)
        self.puller = WorkPuller(nc, self.names, capacity=self.free_slots, on_request=self._on_request)
        self.draining = asyncio.Event()
        self._stop_now = False
        self._processor: KeyProcessor | None = None
        self._context = _LaneContext(self)

    def free_slots(self) -> int:
        return 0 if self.draining.is_set() else self.slots.free()

    def _slot_freed(self) -> None:
        self.puller.wake()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Create or check the work stream and its consumer, and open the processor."""
        lease = await Topology(JetStreamApi(self.nc), self.config).ensure_unkeyed(consumer=True)
        if lease is not None:
            self.ack_wait = lease
        built = self.factory(UNKEYED)
        processor = await built if inspect.isawaitable(built) else built
        await processor.open(self._context)
        self._processor = processor

    async def run(self) -> None:
        """Pull and run requests until :meth:`stop`, then drain."""
        keepalives = asyncio.create_task(self._keep_alive(), name=f"unkeyed-keepalives:{self.names.queue}")
        try:
            await self.puller.run()
            await self._drain()
        finally:
            keepalives.cancel()
            await asyncio.gather(keepalives, return_exceptions=True)
            for run in list(self.runs.values()):
                if run.task is not None:
                    run.task.cancel()
            await asyncio.gather(*(r.task for r in list(self.runs.values()) if r.task is not None),
                                 return_exceptions=True)
            if self._processor is not None:
                with contextlib.suppress(Exception):
                    await self._processor.close(self._context, CloseReason.SHUTDOWN)
            await self.io.close()

    def stop(self, *, now: bool = False) -> None:
        """Stop pulling and drain (``now``: cut the runs in hand off; they run again elsewhere)."""
        self._stop_now = self._stop_now or now
        self.draining.set()
        self.puller.stop()
        if now:
            for run in list(self.runs.values()):
                if run.task is not None:
                    run.task.cancel()

    def reconnected(self) -> None:
        self.puller.reconnected()

    async def _drain(self) -> None:
        await self.slots.changed()  # runs waiting out a backoff go on to give their requests back
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.runs and time.monotonic() < deadline and not self._stop_now:
            tasks = [r.task for r in self.runs.values() if r.task is not None]
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=DRAIN_GRACE)

    # --- requests ------------------------------------------------------------------------------------

    async def _on_request(self, item: WorkItem) -> None:
        held = self.runs.get(item.seq)
        if held is not None:
            held.adopt(item)
            return
        if self.draining.is_set() or self._processor is None:
            with contextlib.suppress(KeyqueueError):
                await self.io.nak(item)
            return
        run = self.runs[item.seq] = _Run(self, item)
        run.task = asyncio.get_running_loop().create_task(self._run(run))

    async def _run(self, run: _Run) -> None:
        try:
            await self._handle(run)
        except LeaseLost as e:
            self._lease_lost(run, str(e))
        except asyncio.CancelledError:
            if run.lost:
                self._lease_lost(run, run.lease.lost_reason or "lease lost")
                return  # cut off by the lane itself: the task ends here
            # The drain's deadline or a stop now: the request goes back for another worker at once.
            if run.lease.valid():
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.io.nak(run.item))
            log.info("queue %s: unkeyed request %s interrupted by the stop; it runs again elsewhere",
                     self.names.queue, run.request_id or f"seq {run.item.seq}")
            raise
        except Exception:
            # The lane's own failure (not the task's: that is an attempt): give the request back shortly.
            log.exception("queue %s: unkeyed request %s failed unexpectedly; it is delivered again",
                          self.names.queue, run.request_id or f"seq {run.item.seq}")
            with contextlib.suppress(Exception):
                await self.io.nak(run.item, 1.0)
        finally:
            if self.runs.get(run.item.seq) is run:
                del self.runs[run.item.seq]
            if self.slots.resuming:
                await self.slots.changed()  # a run that waited out a backoff may go on
            self.puller.wake()

    def _lease_lost(self, run: _Run, reason: str) -> None:
        log.warning("queue %s: unkeyed request %s: lease lost (%s); nothing more was sent for it, and it runs again "
                    "once the server delivers it again", self.names.queue, run.request_id or f"seq {run.item.seq}",
                    reason)

    async def _handle(self, run: _Run) -> None:
        item = run.item
        processor = self._processor
        assert processor is not None
        request = Request(UNKEYED, item.seq, item.subject, item.headers, item.data)
        if item.delivered > self.settings.crash_loop_limit:
            error = KeyqueueError(f"this request was delivered {item.delivered} times: workers keep dying or losing "
                                  "its lease while it runs")
            await self._dead_letter(run, error, item.delivered, DeadLetterReason.CRASH_LOOP)
            return
        try:
            request.check_subjects()
        except InvalidSubject as e:  # it never runs: its reply or records could not be sent
            await self._dead_letter(run, e, 0, DeadLetterReason.REJECTED)
            return
        policy = processor.retry_policy(request) or self.settings.retry
        attempt = 0
        while True:
            attempt += 1
            await self.observer.wait_for_room()
            run.check_lease()
            run.attempt = attempt
            this = self._attempt(run, attempt, policy.max_attempts)
            self.observer.request_started(this)
            started = time.monotonic()
            try:
                async with self.observer.around_attempt(this, run, (request,)):
                    reply = await processor.handle(run, request)
            except LeaseLost:
                raise
            except Exception as e:
                self.observer.attempt_failed(this, e)
                reason = (DeadLetterReason.REJECTED if isinstance(e, WireError | Reject)
                          else DeadLetterReason.NOT_RETRIED if not policy.retries(e)
                          else DeadLetterReason.MAX_ATTEMPTS if policy.exhausted(attempt) else None)
                if reason is not None:
                    await self._dead_letter(run, e, attempt, reason)
                    return
                delay = policy.delay_after(attempt, e)
                self.observer.request_retried(this, delay, e)
                if not await self._backoff(delay):
                    await run.steady(functools.partial(self.io.nak, run.item))  # draining: another worker goes on
                    return
                continue
            await self._succeeded(run, request, reply, time.monotonic() - started, this)
            return

    def _attempt(self, run: _Run, attempt: int, max_attempts: int = 0) -> RequestAttempt:
        item = run.item
        return RequestAttempt(self.names.queue, UNKEYED, run.request_id, H.message_type_of(item.headers), item.seq,
                              attempt, 1, max_attempts, run.stored)

    async def _backoff(self, delay: float) -> bool:
        """Sleep before a retry, keeping the request but lending the slot; False if a drain began."""
        async with self.slots.parked_while(self.draining):
            waiter = asyncio.ensure_future(self.draining.wait())
            try:
                await asyncio.wait({waiter}, timeout=delay)
            finally:
                waiter.cancel()
        return not self.draining.is_set()

    async def _succeeded(self, run: _Run, request: Request, reply: Reply | None, elapsed: float,
                         this: RequestAttempt) -> None:
        # The ack first: a request whose caller got its answer must not stay stored to run again.
        await self._ack(run)
        if request.reply_inbox:
            headers = {H.STATUS: "ok", H.REQUEST_ID: request.request_id, **(reply.headers if reply else {})}
            await run.steady(functools.partial(self.io.reply, request.reply_inbox, headers,
                                               reply.data if reply else b""))
        superseded_by = None
        if reply is not None and reply.headers.get(H.STATUS) == H.STATUS_SUPERSEDED:
            superseded_by = reply.headers.get(H.SUPERSEDED_BY, "")
        self.observer.request_succeeded(this, elapsed, superseded_by)

    async def _ack(self, run: _Run) -> None:
        """Ack the request (of its latest delivery), again once connected if the connection is down."""
        try:
            await self.io.ack(run.item)  # the common case, without a retry loop around it
        except RETRIED:
            await run.steady(lambda: self.io.ack(run.item))

    async def _dead_letter(self, run: _Run, error: BaseException, attempts: int, reason: DeadLetterReason) -> None:
        """Copy the request to the dead-letter queue with why, then ack it, then tell its caller."""
        item = run.item
        run.check_lease()
        why = dead_letter_reasons(error, reason, attempts, item.subject, item.seq)
        await run.steady(functools.partial(self.io.dead_letter, item, why))
        await self._ack(run)
        inbox = item.headers.get(H.REPLY_INBOX)
        if inbox and answerable(inbox):
            answer = {H.STATUS: "dead-lettered", H.REQUEST_ID: run.request_id, H.ERROR_TYPE: type(error).__name__,
                      H.ERROR_MESSAGE: H.header_safe(str(error)), H.DLQ_REASON: reason}
            await run.steady(functools.partial(self.io.reply, inbox, answer, b""))
        self.observer.request_dead_lettered(self._attempt(run, attempts), reason, error)

    # --- leases ----------------------------------------------------------------------------------------

    async def _keep_alive(self) -> None:
        """Every request in hand gets a ``+WPI`` every ``ack_wait / 3``; one whose lease ended is cut off."""
        tick = self.ack_wait / 12
        while True:
            await asyncio.sleep(tick)
            try:
                await self._keep_alive_once()
            except Exception:  # a bug: keepalives must go on, or every long run is delivered again
                log.exception("queue %s: keeping unkeyed requests alive failed unexpectedly; carrying on",
                              self.names.queue)

    async def _keep_alive_once(self) -> None:
        now = time.monotonic()
        for run in list(self.runs.values()):
            if not run.lease.valid():
                if not run.lost and run.task is not None:
                    run.lost = True
                    run.task.cancel()
                continue
            if now < run.next_keepalive:
                continue
            run.next_keepalive = now + self.ack_wait / 3
            try:
                sent = await self.io.keepalive(run.item)
            except KeyqueueError as e:
                log.debug("queue %s: keepalive of unkeyed request %d not sent: %r", self.names.queue,
                          run.item.seq, e)
                continue
            sent.add_done_callback(functools.partial(_confirmed, run.lease, now))


def _confirmed(lease: Lease, sent_at: float, reply: asyncio.Future[Any]) -> None:
    """A keepalive's answer: it extends the lease if it came in time (``Lease.confirmed``)."""
    if not reply.cancelled() and reply.exception() is None:
        lease.confirmed(sent_at, time.monotonic())

