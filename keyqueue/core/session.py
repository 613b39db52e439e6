"""The key session: what a worker runs while it holds a key (docs/architecture.md, "The key session").

    token ─► acquire the key's lease record ─► open processor
                                       ┌─ lease check ─► read next request (stream order)
                                       │      │ none: wait for an arrival, at most `linger`
                                       │      ▼
                                       │  handle ─► ok: delete, reply ─┐
                                       │         └► fail: backoff, retry in place, or DLQ
                                       └──────────────────────────────┘
    quiescent ─► processor.idle() ─► ack ─► release marker ─► remove record
                                                  └ refused (a request arrived): settle deletes,
                                                    remove record, re-check inbox, re-publish token

The token only says the key has work; the lease record (core/lock.py) says who may do it. A
lost lease ends the session at once: no ack, no nak, no delete, no reply. Renewals run beside
the work, from a timer, and a renewal that finds the lease lost cancels the work.

Each step is told to the worker's :class:`~keyqueue.core.observer.SessionObserver` as it
happens, with what the session knows of it (the message type, each attempt's exception, a
superseded reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from keyqueue.core.dead_lettering import DeadLettering
from keyqueue.core.hand_back import FAILED_SESSION_DELAY, HandBack
from keyqueue.core.key_io import KeyIO
from keyqueue.core.lease import Lease
from keyqueue.core.lease_keeper import LeaseKeeper
from keyqueue.core.lock import KeyLock
from keyqueue.core.observer import DeadLetterReason, KeyHold, Outcome, RequestAttempt, SessionEnd, SessionObserver
from keyqueue.core.outage import RETRIED, RETRY_PAUSE, ride_out
from keyqueue.core.processor import CloseReason, KeyProcessor, ProcessorFactory, Reply, Request
from keyqueue.core.removals import PurgeWindows, Removals
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.slots import Slots
from keyqueue.core.turns import Turns
from keyqueue.errors import (
    Disconnected,
    InvalidSubject,
    KeyqueueError,
    LeaseLost,
    Reject,
    ReplyLost,
    WireError,
)
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.queue_io import Watch
from keyqueue.wire import headers as H

log = logging.getLogger("keyqueue.session")

READ_AHEAD: Final = 32
"""Requests read per round trip (a batched direct get)."""

FIRST_READ_UNUSED: Final = "queue %s key %s: its first read is not used (%s); the session reads again"
"""Logged at DEBUG when a key's first read, sent beside its acquire, is not used."""

ARRIVAL_GRACE: Final = 0.1
"""Seconds to keep re-reading after an arrival on the key's subject found no stored request."""

ACQUIRE_BACKOFF: Final = (0.002, 0.5)
"""First and longest wait, in seconds, between tries to acquire a key another worker holds."""

T = TypeVar("T")

_HOST: Final = socket.gethostname()
"""In each lease record with the pid: which process holds the key (``keyqueue release`` judges that process)."""


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """How key sessions behave; one value per worker."""

    ack_wait: float = 30.0
    linger: float = 0.05
    """Seconds with no new request before the key is released."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    crash_loop_limit: int = 10
    """A token delivered more than this many times dead-letters the key's head request."""
    drain_timeout: float = 10.0


class _Context:
    """The SessionContext / RequestContext handed to processors."""

    def __init__(self, session: KeySession) -> None:
        self._session = session
        self.queue = session.io.names.queue
        self.key = session.token.key
        self.fencing = (0, 0)
        """``(lease record sequence, token delivery count)``; set when the key is acquired."""
        self.request_id = ""
        self.attempt = 0

    @functools.cached_property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose records carry the queue and the key (built on first use)."""
        return logging.LoggerAdapter(logging.getLogger("keyqueue.task"), {"queue": self.queue, "key": self.key})

    def lease_valid(self) -> bool:
        return self._session.lease.valid()

    def lease_remaining(self) -> float:
        """Seconds the lease has left (0 once lost)."""
        return max(0.0, self._session.lease.remaining()) if self._session.lease.valid() else 0.0


    def check_lease(self) -> None:
        self._session.lease.check()

    def hold_removal(self, confirm: Callable[[], Awaitable[None]]) -> None:
        """Await ``confirm()`` before any removal of the requests handled so far (``RequestContext.hold_removal``)."""
        removals: Removals | None = getattr(self._session, "removals", None)
        if removals is None:
            raise LeaseLost("the key's session has ended: nothing it handled is removed any more")
        removals.hold(confirm)

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """A processor's own NATS step, retried within the lease as the session's are (``SessionContext.steady``)."""
        return await self._session._steady(step)

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` holding the key but not a worker slot (a rate limit's wait)."""
        async with self._session.off_slot():
            await asyncio.sleep(seconds)

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.check_lease()
        extra = {H.REQUEST_ID: self.request_id} if self.request_id else {}
        await self._session.io.progress(self.key, data, {**extra, **(headers or {})})


class KeySession:
    """One held key: reads its requests in order and hands them to its processor."""

    # A worker may hold ten thousand keys: no per-instance dict.
    __slots__ = (
        "_dead_letters",
        "_hand_back",
        "_hurrying",
        "_in_hand",
        "_waiter",
        "_work_task",
        "buffer",
        "counted_head",
        "ctx",
        "cursor",
        "draining",
        "ending",
        "factory",
        "idle",
        "io",
        "keeper",
        "key",
        "lease",
        "lock",
        "marker_seq",
        "more",
        "observer",
        "on_running",
        "processed",
        "recheck_later",
        "removals",
        "settings",
        "should_yield",
        "slots",
        "token",
        "turns",
        "worker",
    )

    def __init__(self, io: KeyIO, token: Token, factory: ProcessorFactory, settings: SessionSettings, *,
                 observer: SessionObserver, draining: asyncio.Event, should_yield: Callable[[], bool] = lambda: False,
                 worker: str = "", turns: Turns | None = None, idle: dict[str, KeySession] | None = None,
                 recheck_later: Callable[[Token, int], None] | None = None, slots: Slots | None = None,
                 on_running: Callable[[KeySession, bool], None] | None = None,
                 server_now: Callable[[], float | None] | None = None,
                 ended_claim: Callable[[], str | None] | None = None, windows: PurgeWindows | None = None) -> None:
        self.io = io
        self.token = token
        self.key = token.key
        self.factory = factory
        self.settings = settings
        self.observer = observer
        self.draining = draining
        self.should_yield = should_yield
        self.worker = worker
        self.turns = turns or Turns()
        """Shared by the worker's sessions: how a busy session yields the loop between requests."""
        self.idle = idle
        """Shared by the worker's sessions: those waiting for a request, longest waiting first. The
        worker wakes them (:meth:`wake`) to give their keys back when more keys wait for a worker
        than it has free slots."""
        self.slots = slots
        """The worker's slots: a session waiting out a backoff or a rate limit gives its own back (core/slots.py)."""
        self.recheck_later = recheck_later
        """Who re-checks the key's inbox (and removes this token) once the connection allows, when
        this session could not (the worker: :meth:`~keyqueue.core.worker.QueueWorker.recheck_later`)."""
        self.on_running = on_running
        """Told when the session's work (which runs the processor, so the user's code) begins and when
        it has ended (the worker arms its lease alarm by it: core/alarm.py)."""
        self.lock = KeyLock(io, io.names.lease(self.key), settings.ack_wait,
                            holder={"worker": worker, "host": _HOST, "pid": os.getpid(), "token": token.stream_seq,
                                    "delivered": token.delivered, "ack": token.reply},
                            server_now=server_now, ended_claim=ended_claim)
        self.lease = Lease(settings.ack_wait, token.received_at)
        self.lease.lose("the key's lease record is not acquired yet")
        self.cursor = 1
        """The inbox sequence to read the next request from."""
        self.marker_seq = 0
        """The inbox sequence of the release marker read on the key's subject, if any: a former
        holder's (it lives a second, before every request of the key); read past, never handled."""
        self.processed = 0
        self.buffer: list[StoredMsg] = []
        """Requests read ahead and not yet processed, in stream order (a list: an empty deque
        costs 600 bytes, for each of thousands of held keys)."""
        self.more = True
        """Whether the inbox may hold requests past the read-ahead buffer (until a read says no;
        after that, an arrival on the key's subject says yes again)."""
        self.counted_head = False
        """Whether this session has counted its first request as a crash-loop suspect."""
        self._in_hand = 0
        """The inbox sequence of the request being processed (0 between requests)."""
        self.removals = Removals(io, self.key, lease=lambda: self.lease, cursor=lambda: self.cursor,
                                 in_hand=lambda: self._in_hand, steady=self._steady, windows=windows)
        """The removals of the requests handled (core/removals.py)."""
        self.ctx = _Context(self)
        self.ending: SessionEnd | None = None
        """How the session ends, once that is decided (the counts are filled in when it is told)."""
        self._hurrying = False
        self._waiter: asyncio.Future[None] | None = None
        """What the session awaits while it waits for a request (see :meth:`wake`)."""
        self._work_task: asyncio.Task[Any] | None = None
        """The task running the work while the lease is renewed beside it."""
        self.keeper = LeaseKeeper(self.lock, io, self.key, lease=lambda: self.lease, token=lambda: self.token)
        """Renews the lease record beside the work (core/lease_keeper.py)."""
        self._dead_letters: DeadLettering | None = None
        self._hand_back: HandBack | None = None
        """Made when first needed (most sessions dead-letter nothing; a contended one gives nothing back)."""

    def _hurry(self, on: bool) -> None:
        """Whether this session is on its way to its first request: busy sessions let it go first
        (core/turns.py). Not while it waits for another worker's record or for a request."""
        if on != self._hurrying:
            self._hurrying = on
            self.turns.hurry(on)

    def wake(self) -> None:
        """Cut short the wait for a request: the session gives its key back unless one has just
        arrived (the worker calls this when it starts draining, or needs the slot)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def forget(self) -> None:
        """Drop the session's parts once its worker is done with it (it has run, and its lock was
        looked at): each part calls back into the session, so together they form reference cycles
        that only the cyclic garbage collector would free, some fifty objects per key, which made
        collections a tenth of a cold key's CPU. A processor that kept the context can still ask
        it about the lease; it can no longer hold a removal. A give-back still running (a session
        cut off while giving its key back) keeps them until it ends."""
        back = self._hand_back
        if back is not None and back.task is not None and not back.task.done():
            back.task.add_done_callback(lambda _: self.forget())
            return
        self._hand_back = self._dead_letters = None
        del self.removals, self.keeper, self.ctx

    @property
    def republished(self) -> bool:
        """Whether the give-back published the key's token again (a request remained)."""
        return self._hand_back is not None and self._hand_back.republished

    @property
    def giving_back(self) -> bool:
        """Whether the session has begun giving its key back."""
        return self._hand_back is not None and self._hand_back.begun

    @property
    def hand_back(self) -> HandBack:
        """Gives the key back at the session's end (core/hand_back.py)."""
        if self._hand_back is None:
            self._hand_back = HandBack(self.io, self.key, self.lock, self.removals, lease=lambda: self.lease,
                                       token=lambda: self.token, cursor=lambda: self.cursor,
                                       marker=lambda: self.marker_seq, steady=self._steady,
                                       forgive_head=self._forgive_head, recheck_later=self._recheck_by_worker,
                                       ack_wait=self.settings.ack_wait)
        return self._hand_back

    @property
    def dead_letters(self) -> DeadLettering:
        """Moves requests that will not run again to the DLQ; keeps the crash-loop counts (core/dead_lettering.py)."""
        if self._dead_letters is None:
            self._dead_letters = DeadLettering(self.io, self.key, self.removals, lease=lambda: self.lease,
                                               steady=self._steady)
        return self._dead_letters

    @property
    def acquired(self) -> bool:
        return self.lock.lease is not None

    def hold(self) -> KeyHold:
        """What the observer is told of this session's hold on its key."""
        fencing = self.ctx.fencing if self.acquired else (0, self.token.delivered)
        return KeyHold(self.io.names.queue, self.key, fencing, self.token.delivered)

    def adopt(self, token: Token) -> bool:
        """Take a newer delivery of the same token (the server redelivered it to this worker while
        this session holds the key's lease record): keepalives and the ack go to it from now on.
        False if this session can no longer use it (it lost its lease or is giving the key back)."""
        if token.stream_seq != self.token.stream_seq or self.giving_back:
            return False
        if self.acquired and not self.lease.valid():
            return False
        self.token = token
        self.lock.update_holder(delivered=token.delivered, ack=token.reply)
        return True

    # --- the whole session -----------------------------------------------------------------------

    async def run(self) -> Outcome:
        """Run to the end; returns an :class:`Outcome`. Never raises but for cancellation.

        The observer hears ``key_released`` exactly once for a session that acquired its key
        (however it ends, cancellation included) and for one that gave up waiting for it."""
        self._hurry(True)
        try:
            try:
                if not await self._acquire():
                    self.observer.key_released(self.hold(), SessionEnd(Outcome.CONTENDED))
                    return Outcome.CONTENDED
            except Exception as e:  # NATS down, a timeout: the token comes back later, to anyone
                log.warning("queue %s key %s: could not acquire the key's lease record: %r", self.io.names.queue,
                            self.key, e)
                # A write of this claim may have been stored all the same (its reply lost): remove it,
                # so the key is free when the token comes back, not only once the record expires.
                with contextlib.suppress(Exception):
                    await self.io.nak(self.token, FAILED_SESSION_DELAY)
                with contextlib.suppress(Exception):
                    await self.lock.release()
                return Outcome.FAILED
            return await self._run()
        except asyncio.CancelledError:
            # Cut off by the drain deadline (or a second signal): the request in hand stays
            # stored and runs again on the next holder, who may start at once.
            back = self._hand_back
            if back is not None and back.begun and back.task is None and not back.ended:
                # Cut off while giving its key back in its own task (the worker cancels no session
                # that is; something else did): the give-back begins again, as a task of its own.
                assert back.outcome is not None
                back.begin(back.outcome)
            elif not self.giving_back and self.acquired and self.lease.valid():
                self.hand_back.begin(Outcome.HANDED_OFF)
                self.ending = SessionEnd(Outcome.INTERRUPTED)
            elif self.ending is None and self.acquired and not self.lease.valid():
                self.ending = SessionEnd(Outcome.LEASE_LOST, reason=self.keeper.lost_reason())
            if self._hand_back is not None and self._hand_back.task is not None:
                # Even when cut off, a session that acked its token re-checks the inbox.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(self._hand_back.task)
            elif not self.acquired:
                # Cut off while waiting for the key: hand the token back for another worker now
                # (and remove our record, should the acquire cut off have been stored).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(asyncio.gather(self.io.nak(self.token), self.lock.release()))
            raise
        finally:
            self._hurry(False)
            if self.acquired:
                ending = self.ending or SessionEnd(Outcome.FAILED, reason="the session ended unexpectedly")
                self.observer.key_released(self.hold(), dataclasses.replace(
                    ending, processed=self.processed, republished=self.republished))

    async def _acquire(self) -> bool:
        """Acquire the key's lease record, waiting while another worker holds it."""
        delay, longest = ACQUIRE_BACKOFF
        next_expiry_check = 0.0
        # The server's redelivery timer runs from the delivery, which came before received_at: a
        # token that waited in a buffer for a third of ack_wait gets a keepalive at once, a fresh
        # one only when it has waited that long here.
        next_keepalive = self.token.received_at + self.settings.ack_wait / 3
        first = True
        pause, longest_pause = RETRY_PAUSE
        give_up = time.monotonic() + 2 * self.settings.ack_wait
        while True:
            if self.draining.is_set():
                with contextlib.suppress(Exception):
                    await self.io.nak(self.token)
                return False
            now = time.monotonic()
            if now >= next_keepalive:
                # The token may have waited in a buffer; refresh its server-side timer at once so
                # it is not redelivered while this worker works (or waits) for the key.
                with contextlib.suppress(Exception):
                    await self.io.keepalive(self.token)
                next_keepalive = now + self.settings.ack_wait / 3
            # The first try reads the key's first requests in the same round trip. A read is
            # harmless before the key is ours; its result is used only if the key was free at once
            # (a holder settles its deletes before it deletes its record, so the read is current
            # unless that holder was still working when this token arrived: after a fault).
            first_read = await self._send_first_read() if first else None
            first = False
            try:
                acquired = await self.lock.try_acquire()
            except RETRIED as e:
                if first_read is not None:
                    self._first_read_unused(first_read, f"the acquire is tried again after {e!r}")
                # The connection is down, or the server did not answer (a replicated stream
                # electing a leader): try again once it is back. The record decides who holds
                # the key, so trying for longer than the token is ours to keep is harmless.
                if time.monotonic() >= give_up:
                    raise
                self._hurry(False)
                if await self.io.wait_connected(max(0.0, give_up - time.monotonic())) and not isinstance(
                        e, Disconnected | ReplyLost):
                    await asyncio.sleep(pause)
                    pause = min(longest_pause, pause * 2)
                self._hurry(True)
                continue
            except BaseException:
                if first_read is not None:
                    first_read.cancel()
                raise
            if acquired:
                assert self.lock.lease is not None
                self.lease = self.lock.lease
                self.ctx.fencing = (self.lock.fence, self.token.delivered)
                self.observer.key_acquired(self.hold())
                if first_read is not None:
                    try:
                        msgs, self.more = await self._first_read_result(first_read)
                        self.buffer.extend(self._requests(msgs))
                    except KeyqueueError as e:  # the session reads again
                        log.debug(FIRST_READ_UNUSED, self.io.names.queue, self.key, f"it failed: {e!r}")
                    except Exception:  # a bug (one hid here once: every key read twice); read again
                        log.exception("queue %s key %s: the first read could not be used", self.io.names.queue,
                                      self.key)
                return True
            if first_read is not None:
                self._first_read_unused(first_read, "the key is held")
            # Another worker's record is live: it is working on the key, or it is a former holder's
            # record that the server will expire. Either way, it is not ours to start.
            self._hurry(False)
            await asyncio.sleep(delay)
            self._hurry(True)
            delay = min(longest, delay * 2)
            # A record this worker's own ended session may have left is looked at once refused.
            own = self.lock.ended_claim is not None and self.lock.ended_claim() is not None
            if (delay >= longest or own) and time.monotonic() >= next_expiry_check:
                with contextlib.suppress(KeyqueueError):
                    await self.lock.clear_expired()  # logs what it removed, if anything
                # Look again in half a lease, or once the record is past its TTL by the server's clock.
                expires_in = self.lock.expires_in
                next_expiry_check = time.monotonic() + min(self.settings.ack_wait / 2,
                                                           self.settings.ack_wait if expires_in is None else expires_in)

    def _first_read_unused(self, sent: asyncio.Future[Any], why: str) -> None:
        sent.cancel()
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())
        log.debug(FIRST_READ_UNUSED, self.io.names.queue, self.key, why)

    async def _send_first_read(self) -> asyncio.Future[Any] | None:
        """The key's first read, sent beside its acquire (None if it could not be sent: the session
        reads later): with direct gets, a request on the worker's read mux, published now and its
        replies read once the acquire is answered (no task per key); else the read as a task (a
        replicated inbox is read from its leader, one request at a time)."""
        if not self.io.direct:
            return asyncio.ensure_future(self.io.read(self.key, self.cursor, READ_AHEAD))
        try:
            return await self.io.send_read(self.key, self.cursor, READ_AHEAD)
        except KeyqueueError as e:
            log.debug(FIRST_READ_UNUSED, self.io.names.queue, self.key, f"it could not be sent: {e!r}")
            return None

    async def _first_read_result(self, sent: asyncio.Future[Any]) -> tuple[list[StoredMsg], bool]:
        if not self.io.direct:
            read: tuple[list[StoredMsg], bool] = await sent
            return read
        return await self.io.read_reply(self.key, sent)

    async def _run(self) -> Outcome:
        """Work until the key is given back; sets :attr:`ending` before giving it back.

        The lease is renewed beside the work by a timer (a renewal runs as a task only while its
        reply is awaited: thousands of held keys keep no task each for it); a renewal that finds
        the lease lost cancels the work, as a task group would."""
        work = asyncio.current_task()
        assert work is not None
        self._work_task = work
        if self.on_running is not None:
            self.on_running(self, True)
        self.keeper.start(work)
        error: Exception | None = None
        outcome: Outcome | None = None
        try:
            outcome = await self._work()
        except asyncio.CancelledError:
            if not self.keeper.cut or work.uncancel() > 0:
                raise  # cancelled from outside (the drain deadline, a second signal)
        except LeaseLost:
            if self.keeper.cut:
                work.uncancel()  # the renewal's cancel was turned into this on the way
        except Exception as e:
            error = e
            if self.keeper.cut:
                work.uncancel()
        else:
            if self.keeper.cut:
                work.uncancel()  # the renewal's cancel was swallowed on the way
        finally:
            await self._stop_renewals()
        if self.keeper.cut or (outcome is None and error is None):
            # A renewal found the lease lost (and cancelled the work), or the work found it lost.
            self.ending = SessionEnd(Outcome.LEASE_LOST, reason=self.keeper.lost_reason())
            return Outcome.LEASE_LOST
        if error is not None:
            # A processor or NATS failure: give the key back now, not after ack_wait, with a short
            # delay so a failure that repeats cannot spin through the fleet.
            self.ending = SessionEnd(Outcome.FAILED, reason=repr(error), error=error)  # the observer logs it
            await self._give_back(Outcome.FAILED)
            return Outcome.FAILED
        assert outcome is not None
        self.ending = SessionEnd(outcome)
        await self._give_back(outcome)
        return outcome

    async def _steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """Run an idempotent NATS step of this session, and again after a lost connection, a lost
        reply or no answer (a replicated stream electing a leader) for as long as the lease holds.
        Raises :class:`~keyqueue.errors.LeaseLost` once it does not: an outage shorter than the
        lease costs a pause, not the key (core/outage.py)."""
        return await ride_out(step, self.lease, self.io)

    @property
    def running(self) -> bool:
        """Whether the session's work is going on: from when the key is acquired until the work,
        the user's code included, has ended (a thread the work waits for, a cancelled coroutine
        that has not yet finished)."""
        return self._work_task is not None

    async def _stop_renewals(self) -> None:
        self._work_task = None
        if self.on_running is not None:
            self.on_running(self, False)
        await self.keeper.stop()

    async def _work(self) -> Outcome:
        await self.observer.wait_for_room()
        processor = await self._build_processor()
        # The arrival watch (a core subscription on the key's inbox subject) is opened only when
        # the session first has to wait: a key released at once (its worker is full and other
        # keys wait) never pays for it. Opening it is followed by one more read, since a request
        # may have landed between the last read and the subscription.
        watch: Watch | None = None
        reason = CloseReason.QUIESCENT
        try:
            await processor.open(self.ctx)
            while True:
                if self.draining.is_set():
                    reason = CloseReason.SHUTDOWN
                    break
                self.lease.check()
                if self.buffer or self.more or (watch is not None and watch.arrived):
                    woken = watch is not None and watch.arrived and not self.buffer and not self.more
                    if watch is not None and watch.arrived:
                        # A watch wakes once. While the key is busy it has none (the worker is
                        # not sent a copy of each of its requests); the next is opened, followed
                        # by one more read, when the session must wait again.
                        spent, watch = watch, None
                        await spent.close()
                    batch = await self._read(processor)
                    if not batch and woken:
                        batch = await self._read_after_arrival(processor)
                    if batch:
                        await self._process(processor, batch)
                        # With requests read ahead and deletes pipelined, a session can go many
                        # requests without awaiting I/O: yield, so other keys, keepalives and the
                        # connection's flusher run between requests, and a few busy sessions per
                        # loop iteration only, so a key that just arrived is not kept waiting.
                        # A session with no request left to read (a cold key's, say) goes on to
                        # wait or to give its key back without a turn: it is no longer busy.
                        if self.buffer or self.more:
                            await self.turns.take()
                        continue
                if self.should_yield():
                    break
                self._hurry(False)
                if watch is None:
                    watch = await self.io.watch(self.key)
                    self.more = True
                    continue
                # A key waiting for requests keeps no replies: the deletes confirmed by now go (the
                # read just above was answered after them); the release settles the rest.
                await self.removals.before_wait(self.settings.linger, ARRIVAL_GRACE)
                if not await self._await_arrival(watch):
                    break
            return await self._release(processor, reason)
        finally:
            if watch is not None:
                await watch.close()
            # Always closed, so a processor can stop its background work; a processor must not
            # write anything on "lease-lost" (another worker may own the key now).
            await processor.close(self.ctx, reason if self.lease.valid() else CloseReason.LEASE_LOST)

    async def _build_processor(self) -> KeyProcessor:
        built = self.factory(self.key)
        return await built if inspect.isawaitable(built) else built

    async def _await_arrival(self, watch: Watch) -> bool:
        """Wait for a new request; False once ``linger`` passes (or a drain starts) with none.

        True also asks for one more read (``more``), once per watch, after ``ARRIVAL_GRACE``."""
        # One future, woken by the watch or the drain (no helper tasks: thousands of held keys
        # wait here at once).
        if self.draining.is_set():
            return False
        if watch.arrived:  # it landed during the read that followed the subscribe
            return True
        # A request published just before the subscribe reached the server can be stored only
        # after the read that followed it (the server stores asynchronously): the watch never sees
        # it and that read missed it. So a long wait reads once more after ARRIVAL_GRACE.
        recheck = not watch.rechecked and self.settings.linger > ARRIVAL_GRACE
        self._waiter = watch.waiter = asyncio.get_running_loop().create_future()
        if self.idle is not None:
            self.idle[self.key] = self
        try:
            async with asyncio.timeout(ARRIVAL_GRACE if recheck else self.settings.linger):
                await self._waiter
        except TimeoutError:
            if recheck and not self.draining.is_set():
                watch.rechecked = True
                self.more = True
                return True
        finally:
            self._waiter = watch.waiter = None
            if self.idle is not None and self.idle.get(self.key) is self:
                del self.idle[self.key]
        return watch.arrived and not self.draining.is_set()

    async def _read_after_arrival(self, processor: KeyProcessor) -> list[StoredMsg]:
        """Read again, briefly, after an arrival found nothing: core subscribers can see a
        publish before the stream has stored it."""
        delay = 0.001
        while delay < ARRIVAL_GRACE:
            await asyncio.sleep(delay)
            self.more = True
            batch = await self._read(processor)
            if batch:
                return batch
            delay *= 2
        return []

    async def _read(self, processor: KeyProcessor) -> list[StoredMsg]:
        """The next request (or, for a batch processor, all available up to its batch size).

        Requests are read ahead in batches of :data:`READ_AHEAD` with one round trip each.
        """
        want = max(1, getattr(processor, "batch_size", 0))
        while len(self.buffer) < want:
            start = self.buffer[-1].seq + 1 if self.buffer else max(self.cursor, self.marker_seq + 1)
            read = functools.partial(self.io.read, self.key, start, max(want - len(self.buffer), READ_AHEAD))
            msgs, self.more = await self._steady(read)
            self.buffer.extend(self._requests(msgs))
            if not self.more:
                break
        batch = self.buffer[:want]
        del self.buffer[:want]
        return batch

    def _requests(self, msgs: list[StoredMsg]) -> list[StoredMsg]:
        """The requests among messages read from the key's subject: a release marker (which can
        only come first) is noted, so that reads go past it and the release knows it is there."""
        if msgs and H.is_release_marker(msgs[0].headers):
            self.marker_seq = max(self.marker_seq, msgs[0].seq)
            return msgs[1:]
        return msgs

    # --- processing with retries -----------------------------------------------------------------

    async def _process(self, processor: KeyProcessor, batch: list[StoredMsg]) -> None:
        killed = 0
        if not self.counted_head and self.token.delivered > 1:
            # A redelivered token: the previous holder may have died on this very request.
            self.counted_head = True
            runs, killed = await self._count_head_run(batch[0])
            if runs > self.settings.crash_loop_limit:
                self.buffer[0:0] = batch[1:]
                error = KeyqueueError(f"this request was at the head of {runs} sessions of redelivered tokens: "
                                      "workers keep dying or losing the lease on it")
                await self._dead_letter([batch[0]], error, runs, reason=DeadLetterReason.CRASH_LOOP)
                return
            head_policy = processor.retry_policy(Request(self.key, batch[0].seq, batch[0].subject, batch[0].headers,
                                                         batch[0].data)) or self.settings.retry
            if killed and head_policy.exhausted(killed):
                # Each of its attempts blocked the event loop until the loop watchdog stopped its
                # worker (core/watchdog.py): they count toward max_attempts like failed ones.
                self.buffer[0:0] = batch[1:]
                error = KeyqueueError(f"its attempt blocked the event loop past the lease, or outlived a lost lease "
                                      f"in a thread, {killed} time(s), and the worker was stopped each time (the "
                                      "worker's log says which)")
                await self._dead_letter([batch[0]], error, killed, reason=DeadLetterReason.MAX_ATTEMPTS)
                return
        self._hurry(False)
        requests = [Request(self.key, m.seq, m.subject, m.headers, m.data) for m in batch]
        for n, request in enumerate(requests):
            try:
                request.check_subjects()
            except InvalidSubject as e:
                if n == 0:  # it never runs: its reply or records could not be sent (docs/decisions.md)
                    self.buffer[0:0] = batch[1:]
                    await self._dead_letter([batch[0]], e, 0, reason=DeadLetterReason.REJECTED)
                    return
                self.buffer[0:0] = batch[n:]  # the batch runs up to it; it is the head of the next
                batch, requests = batch[:n], requests[:n]
                break
        head = requests[0]
        self._in_hand = head.seq
        self.removals.arm()
        policy = processor.retry_policy(head) or self.settings.retry
        attempt = killed  # attempts a watchdog stopped count as made
        while True:
            attempt += 1
            await self.observer.wait_for_room()
            self.lease.check()
            self.ctx.request_id, self.ctx.attempt = head.request_id, attempt
            this = self._attempt(head.seq, head.headers, attempt, len(requests), policy.max_attempts,
                                 batch[0].timestamp)
            self.observer.request_started(this)
            started = time.monotonic()
            try:
                async with self.observer.around_attempt(this, self.ctx, requests):
                    if getattr(processor, "batch_size", 0) > 0:
                        outcomes = await processor.handle_batch(self.ctx, requests)
                        if not 0 < len(outcomes) <= len(requests):
                            raise TypeError(f"handle_batch returned {len(outcomes)} outcomes for {len(requests)} "
                                            "requests; return one per request handled, at least one")
                    else:
                        outcomes = [await processor.handle(self.ctx, head)]
            except LeaseLost:
                raise
            except Exception as e:
                self.observer.attempt_failed(this, e)
                if isinstance(e, WireError | Reject):
                    await self._dead_letter(batch, e, attempt, reason=DeadLetterReason.REJECTED)
                    return
                if not policy.retries(e):  # the task's retry_on does not list it
                    await self._dead_letter(batch, e, attempt, reason=DeadLetterReason.NOT_RETRIED)
                    return
                if policy.exhausted(attempt):
                    await self._dead_letter(batch, e, attempt, reason=DeadLetterReason.MAX_ATTEMPTS)
                    return
                delay = policy.delay_after(attempt, e)
                self.observer.request_retried(this, delay, e)
                if not await self._backoff(delay):
                    return  # draining: the request stays at the head for the next holder
                continue
            # A batch processor may handle a prefix of the batch (the rest stays at the head, in
            # order) and may reject single requests by returning the exception in their place.
            handled = len(outcomes)
            if handled == 1 and len(batch) == 1:
                # One request, done (the usual case): what follows, without its lists.
                outcome = outcomes[0]
                if outcome is None or isinstance(outcome, Reply):
                    await self._succeeded(batch, requests, [outcome], time.monotonic() - started,
                                          through=batch[0].seq, attempt=attempt, told=this)
                    return
            self.buffer[0:0] = batch[handled:]
            batch, requests = batch[:handled], requests[:handled]
            for msg, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    await self._dead_letter([msg], outcome, attempt, reason=DeadLetterReason.REJECTED)
            done = [(m, r, o) for m, r, o in zip(batch, requests, outcomes, strict=True)
                    if o is None or isinstance(o, Reply)]
            if done:
                await self._succeeded([d[0] for d in done], [d[1] for d in done], [d[2] for d in done],
                                      time.monotonic() - started, through=batch[-1].seq, attempt=attempt)
            return

    def _attempt(self, seq: int, headers: Mapping[str, str], attempt: int, batch: int,
                 max_attempts: int = 0, stored_at: str = "") -> RequestAttempt:
        """What the observer is told of the request stored at ``seq`` (at ``stored_at``, its stream timestamp)."""
        return RequestAttempt(self.io.names.queue, self.key, headers.get(H.MSG_ID, ""), H.message_type_of(headers),
                              seq, attempt, batch, max_attempts, stored_at)

    async def _backoff(self, delay: float) -> bool:
        """Sleep before a retry, holding the key but not a slot; False if a drain started meanwhile."""
        async with self.off_slot():
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancel that arrives as
            # the drain starts.
            waiter = asyncio.ensure_future(self.draining.wait())
            try:
                await asyncio.wait({waiter}, timeout=delay)
            finally:
                waiter.cancel()
        return not self.draining.is_set()

    def off_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While the session only waits (a backoff, a rate limit), it keeps its key (its lease is
        renewed, nothing behind its request runs) and lends its slot to another key (core/slots.py)."""
        if self.slots is None:
            return contextlib.nullcontext()
        return self.slots.parked_while(self.draining)

    async def _succeeded(self, batch: list[StoredMsg], requests: list[Request], replies: list[Reply | None],
                         elapsed: float, through: int, attempt: int, told: RequestAttempt | None = None) -> None:
        """``told``: a lone request's attempt as its start was told (the same request, attempt and batch)."""
        self.lease.check()
        self.cursor = through + 1
        if len(batch) == 1 and batch[0].seq == through:
            # Pipelined and coalesced: the next request starts without waiting for this one's
            # removal (core/removals.py).
            await self.removals.done_one(more_read=bool(self.buffer))
        else:
            await self.removals.done_through(through)
        self._in_hand = 0
        self.processed += len(batch)
        for request, reply in zip(requests, replies, strict=False):
            if request.reply_inbox:
                self.lease.check()
                headers = {H.STATUS: "ok", H.REQUEST_ID: request.request_id, **(reply.headers if reply else {})}
                await self._steady(functools.partial(self.io.reply, request.reply_inbox, headers,
                                                     reply.data if reply else b""))
            superseded_by = None
            if reply is not None and reply.headers.get(H.STATUS) == H.STATUS_SUPERSEDED:
                superseded_by = reply.headers.get(H.SUPERSEDED_BY, "")
            self.observer.request_succeeded(told or self._attempt(request.seq, request.headers, attempt, len(requests)),
                                            elapsed, superseded_by)

    async def _dead_letter(self, batch: list[StoredMsg], error: BaseException, attempts: int, *,
                           reason: DeadLetterReason) -> None:
        for msg in batch:
            await self.dead_letters.move(msg, error, attempts, reason)
            self.cursor = msg.seq + 1
            self._in_hand = 0
            self.observer.request_dead_lettered(self._attempt(msg.seq, msg.headers, attempts, len(batch)), reason,
                                                error)

    async def _count_head_run(self, head: StoredMsg) -> tuple[int, int]:
        """Count one more session that starts with ``head`` on a redelivered token; the counts of
        such sessions and of its attempts a loop watchdog stopped."""
        return await self.dead_letters.add_head_runs(head.seq, +1)

    async def _forgive_head(self) -> None:
        """This session hands the key back with a request in hand (a drain, a failure): it did not
        die on it, so the session of the redelivered token must not count it as a crash."""
        if self._in_hand:
            await self.dead_letters.add_head_runs(self._in_hand, -1)

    # --- release ---------------------------------------------------------------------------------

    async def _release(self, processor: KeyProcessor, reason: CloseReason) -> Outcome:
        """Finish owed work; the hand-back (core/hand_back.py) then gives the key back."""
        if reason == CloseReason.SHUTDOWN:
            try:
                async with asyncio.timeout(self.settings.drain_timeout):
                    await processor.idle(self.ctx)
            except TimeoutError:
                log.warning("queue %s key %s: owed work did not finish within the drain deadline; the next "
                            "holder does it", self.io.names.queue, self.key)
            return Outcome.HANDED_OFF
        await processor.idle(self.ctx)
        return Outcome.RELEASED

    async def _give_back(self, outcome: Outcome) -> None:
        """Give the key back in this task (the worker does not cancel a session that is giving its
        key back: :meth:`run` begins it again as a task of its own if something else does)."""
        await self.hand_back.run(outcome)

    def _recheck_by_worker(self, token: Token, cursor: int) -> None:
        if self.recheck_later is not None:
            self.recheck_later(token, cursor)

