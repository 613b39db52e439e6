"""The worker runtime for one queue: slots, the token pull loop, sessions, drain.

One asyncio task per key session, owned by a TaskGroup; the puller, the reconciler, the
loop-lag monitor, the backlog probe and the re-checks of keys whose release was cut short are
owned tasks too, cancelled and awaited on exit.

The sessions' steps are counted, told to the worker's
:class:`~keyqueue.core.observer.SessionObserver` (whose failures are logged and never reach a
session), and logged on ``keyqueue.worker``, one line per step, each with its fields as ``kq_*``
record attributes (``kq_event``, ``kq_queue``, ``kq_key``, ``kq_request_id``, ...):

* **error**: a request dead-lettered after its last attempt (with that attempt's traceback) or
  for crash-looping; a session that failed unexpectedly (with its traceback).
* **warning**: a failed attempt that is retried, in one line (its traceback only when the logger
  is at debug); a request rejected as bad input (``Reject``, an unreadable message: no
  traceback); a lost lease; a session cut off by a lost connection or a timeout (one line, the
  same error at most once per :data:`OUTAGE_LOG_INTERVAL`, then counted).
* **info**: pinned and unpinned; a session interrupted by the stop.
* **debug**: keys acquired and released, attempts started and succeeded, superseded requests.

A request without a request id (not sent by keyqueue) is named by its inbox sequence (``seq 17``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, ParamSpec

from nats.aio.client import Client

from keyqueue.core.alarm import LeaseAlarm
from keyqueue.core.lease import Lease
from keyqueue.core.lock import KeyLock
from keyqueue.core.observer import (
    DeadLetterReason,
    KeyHold,
    NullObserver,
    Outcome,
    RequestAttempt,
    SessionEnd,
    SessionObserver,
    describe,
)
from keyqueue.core.processor import ProcessorFactory, Request, RequestContext
from keyqueue.core.reconciler import Reconciler
from keyqueue.core.removals import PurgeWindows
from keyqueue.core.session import KeySession, SessionSettings
from keyqueue.core.slots import Slots
from keyqueue.core.turns import Turns
from keyqueue.core.unkeyed import LaneSettings, UnkeyedLane
from keyqueue.core.watchdog import HeldLease, LoopWatchdog
from keyqueue.errors import ConfigError, ConnectionFailed, JetStreamUnavailable, KeyqueueError, KeyqueueTimeout
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import LogThrottle, link_of
from keyqueue.jetstream.pull import PullOptions, Token, TokenPuller
from keyqueue.jetstream.queue_io import QueueIO, count_killed_attempts
from keyqueue.jetstream.server_clock import ServerClock
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.jetstream.topology import Change, QueueConfig, Topology

log = logging.getLogger("keyqueue.worker")

NO_JETSTREAM_AFTER = 30.0
"""Seconds of "no responders" to the JetStream API after which a starting worker gives up."""

DRAIN_GRACE = 2.0
"""Seconds cut-off sessions have to end after the drain deadline (a sync task to see its stop)."""

LOOP_TICK = 0.1
"""Seconds between the loop-lag monitor's ticks."""

OUTAGE_LOG_INTERVAL = 30.0
"""Seconds during which further sessions cut off by the same connection error are counted, not logged."""

REDELETE_WINDOW = 2.0
"""Seconds before a connection drop within which a lease record this worker removed is removed
again after the reconnect: a server killed then may have lost the delete it answered (nats-server
writes it to its store after the reply; see ``QueueWorker._connection_dropped``)."""

_GAVE_BACK = (Outcome.RELEASED, Outcome.HANDED_OFF)
"""Outcomes of a session that removed its own lease record after its work was over."""

_CONNECTION_ERRORS = (ConnectionFailed, KeyqueueTimeout)
"""What cuts sessions off during an outage: expected, and named well enough to need no traceback."""

P = ParamSpec("P")


class QueueWorker:
    """Runs key sessions for one queue with at most ``concurrency`` keys held at once."""

    def __init__(self, nc: Client, config: QueueConfig, factory: ProcessorFactory, *,
                 concurrency: int = 16, settings: SessionSettings | None = None,
                 pull: PullOptions | None = None, reconcile_interval: float = 30.0,
                 name: str | None = None, observer: SessionObserver | None = None,
                 follow_lease: bool = False, watchdog: bool = False, unkeyed: ProcessorFactory | None = None) -> None:
        """``unkeyed``: the queue has unkeyed tasks; their processor's factory (called with the key
        ``~``). The worker then runs an unkeyed lane beside its key sessions (core/unkeyed.py)."""
        self.nc = nc
        self.config = config
        self.factory = factory
        self.concurrency = concurrency
        self.follow_lease = follow_lease
        """Take the queue's lease (ack_wait) from the server at start, instead of setting the
        server's to ``settings.ack_wait`` (docs/decisions.md, "Who owns each setting")."""
        self.settings = settings or SessionSettings(ack_wait=config.ack_wait)
        if self.settings.ack_wait != config.ack_wait:
            raise ConfigError(
                f"the session lease ({self.settings.ack_wait}s) differs from queue {config.name!r}'s ack_wait "
                f"({config.ack_wait}s); use one value for both (SessionSettings(ack_wait=config.ack_wait))"
            )
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.report = _Report(config.name, observer or NullObserver())
        """What the sessions call: logs and counts each step, then tells ``observer``."""
        self.io = QueueIO(nc, config)
        pull = dataclasses.replace(pull) if pull is not None else PullOptions()
        if config.priority_policy != "none":
            pull.group = config.priority_group
        elif pull.group or pull.min_pending or pull.min_ack_pending or pull.priority is not None:
            raise ConfigError(
                f"queue {config.name!r} has no priority policy, so overflow thresholds and priorities "
                "do not apply; configure priority_policy on the queue (see docs/priority-groups.md)"
            )
        _check_pull_options(config, pull)
        self.pinned: str | None = None
        """The pin id while this worker is the pinned client of a ``pinned_client`` queue."""
        # Tokens refused by a token stream with no leader (a producer's, a release's) are the
        # reconciler's: it runs once the consumer answers again.
        self.puller = TokenPuller(nc, config.names, capacity=self.free_slots, on_token=self._on_token,
                                  options=pull, on_pinned=self._on_pinned,
                                  on_answered_again=lambda: self.reconciler.wake())
        self.reconciler = Reconciler(self.io, interval=reconcile_interval, worker=self.name)
        self.sessions: dict[str, asyncio.Task[str]] = {}
        self.slots = Slots(concurrency, lambda: len(self.sessions) - len(self._giving_back), freed=self._slot_freed)
        """The worker's slots (core/slots.py): a session waiting out a backoff or a rate limit gives its
        slot back, and one whose work has ended holds none while it gives its key back."""
        self._giving_back: set[KeySession] = set()
        """Sessions whose work (the user's code) has ended and that only give their key back: the
        token's ack and the release marker are round trips to the server, no work of the slot's,
        so a new key starts meanwhile. Such a session still holds its key (``sessions``) until
        it has given it back: a token of the key that comes meanwhile waits for it (``_on_token``)."""
        self.draining = asyncio.Event()
        self._stop_now = False
        self._tg: asyncio.TaskGroup | None = None
        self._tokens_pending = 0
        """Tokens waiting on the server for a worker, as the last token delivered (or the probe) said."""
        self._started = asyncio.Event()
        self._start_error: BaseException | None = None
        self._held: dict[str, KeySession] = {}
        self._idle: dict[str, KeySession] = {}
        """Held keys whose sessions wait for a request, longest waiting first (see :meth:`_make_room`)."""
        self.turns = Turns()
        """Loop iterations shared between busy sessions (core/turns.py)."""
        self.purge_windows = PurgeWindows()
        """The purge windows of its sessions, on one timer (core/removals.py)."""
        self._last_tick = time.monotonic()
        self._stale_after = self.settings.ack_wait - Lease.default_margin(self.settings.ack_wait)
        """A stall this long may have outlived every lease this worker held."""
        self.watchdog: LoopWatchdog | None = None
        """With ``watchdog``: the thread that ends this process before a blocked loop outlives a
        lease (core/watchdog.py). Started with the worker; it is for processes that run workers,
        not for a process the worker is a guest in."""
        self.alarm: LeaseAlarm | None = None
        """With ``watchdog``: the kernel timer that kills this process at the earliest kill point of
        the runs going on (core/alarm.py), for the runs no code of the process can stop in time."""
        if watchdog:
            self.watchdog = LoopWatchdog(self.settings.ack_wait, self._held_leases, count_killed=self._count_killed)
            self.alarm = LeaseAlarm()
        self._running: set[KeySession] = set()
        """Sessions whose work (the user's code) is going on, the key's lease lost or not."""
        self._rechecks: dict[str, tuple[Token, int]] = {}
        """Keys whose session could not finish its release (the connection was down): the token it
        released (maybe unconfirmed) and the inbox sequence to re-check from."""
        self._recheck_wanted = asyncio.Event()
        self._leftovers: list[tuple[KeyLock, float]] = []
        """Lease records of sessions that lost their lease, to remove once connected (:meth:`remove_leftover`)."""
        self._released: deque[tuple[float, int, float]] = deque()
        """The lease records this worker's sessions removed in the last :data:`REDELETE_WINDOW`
        seconds: when, the record's sequence, its TTL (see :meth:`_connection_dropped`)."""
        self.server_clock = ServerClock()
        """The server's clock, from the tokens' stamps: on one server, the lease records are stamped
        by the same clock, so a waiter can tell a record the server kept past its TTL (core/lock.py)."""
        self._ended_claims: dict[str, tuple[str, float]] = {}
        """Per key, the nonce of this worker's last claim whose session ended having lost its lease or
        with a write unanswered, and until when it matters (twice its TTL): see :meth:`_ended_claim`."""
        self._redeletes: list[tuple[int, float]] = []
        """Records to remove again once connected: sequence, when to give up."""
        self._unkeyed = unkeyed
        self.lane: UnkeyedLane | None = None
        """The unkeyed lane, once started (with ``unkeyed``)."""

    # --- slots -----------------------------------------------------------------------------------

    def free_slots(self) -> int:
        return 0 if self.draining.is_set() else self.slots.free()

    def _slot_freed(self) -> None:
        self.puller.wake()

    def _should_yield(self) -> bool:
        """An idle session releases at once, rather than lingering, when more keys wait for a
        worker than this one has free slots."""
        return self._tokens_pending > self.free_slots()

    def _make_room(self, waiting: int) -> None:
        """``waiting`` more keys wait for a worker than this one has free slots: as many sessions
        that wait for a request (longest waiting first) give their keys back now, not after ``linger``.
        Without this a worker full of lingering keys serves at most ``concurrency / linger`` keys
        a second, however fast it is."""
        while waiting > 0 and self._idle:
            key = next(iter(self._idle))
            self._idle.pop(key).wake()
            waiting -= 1

    @property
    def counts(self) -> dict[str, int]:
        """Session steps seen, by name (acquired, started, succeeded, retried, dead_lettered, released, ...)."""
        return self.report.counts

    def summary(self) -> str:
        """What this worker did, for a log line: ``120 succeeded, 3 retried, 2 dead-lettered``."""
        counts = self.counts
        parts = [f"{counts.get('succeeded', 0)} succeeded"]
        for event, what in (("retried", "retried"), ("dead_lettered", "dead-lettered"),
                            ("lease_lost", "leases lost"), ("session_failed", "sessions failed")):
            if counts.get(event):
                parts.append(f"{counts[event]} {what}")
        return ", ".join(parts)

    # --- tokens ----------------------------------------------------------------------------------

    def _on_token(self, token: Token) -> Awaitable[None] | None:
        # A token is a scheduling hint: whoever acts on it must first acquire the key's lease
        # record (core/lock.py), so even a token that sat in a buffer while this process was
        # paused is safe to act on. Called from the connection's read loop (jetstream/pull.py):
        # it starts the key's session and returns; only a hand-back is left to await.
        self._tokens_pending = token.pending
        self.server_clock.saw_seconds(token.stored_at, token.received_at)
        self.report.token_received(self.config.name, token.key, token.delivered)
        held = self._held.get(token.key)
        previous: asyncio.Task[str] | None = None
        if held is not None:
            if held.adopt(token):
                # The server redelivered the token of a key this worker holds (a keepalive came
                # late): the session carries on under its lease record with the newer delivery.
                log.info("key %s: token redelivered to its holder; the session continues with it", token.key)
                return None
            # Our session is closing (it acked the token, found a request at its re-check and
            # scheduled the key again) or lost its lease: start after it has finished.
            previous = self.sessions.get(token.key)
            self._giving_back.discard(held)  # the key's entry in sessions is the new session's from now on
        if self.draining.is_set() or self._tg is None:
            return self._hand_back(token)
        session = KeySession(self.io, token, self.factory, self.settings, observer=self.report,
                             draining=self.draining, should_yield=self._should_yield, worker=self.name,
                             turns=self.turns, idle=self._idle, recheck_later=self.recheck_later, slots=self.slots,
                             on_running=self._run_changed,
                             server_now=None if self.io.replicated else self.server_clock.now_seconds,
                             ended_claim=functools.partial(self._ended_claim, token.key),
                             windows=self.purge_windows)
        task = self._tg.create_task(self._run_session(session, previous), name=f"session:{token.key}")
        self.sessions[token.key] = task
        self._held[token.key] = session
        if token.pending > self.free_slots():
            self._make_room(token.pending - self.free_slots())
        return None

    async def _hand_back(self, token: Token) -> None:
        """A token that came while draining (or before the sessions could start) goes back at once."""
        with contextlib.suppress(KeyqueueError):
            await self.io.nak(token)

    async def _on_pinned(self, pin_id: str | None) -> None:
        was, self.pinned = self.pinned, pin_id
        if pin_id is not None:
            self.report.worker_pinned(self.config.name, pin_id)
        elif was is not None:
            self.report.worker_unpinned(self.config.name, was)

    async def _run_session(self, session: KeySession, previous: asyncio.Task[str] | None = None) -> str:
        try:
            if previous is not None:
                await asyncio.wait([previous])
            outcome = await session.run()
            if outcome == Outcome.LEASE_LOST:
                self.remove_leftover(session.lock)
            elif outcome in _GAVE_BACK and session.lock.seq:
                self._note_released(session.lock)
            if outcome == Outcome.LEASE_LOST or session.lock.unanswered:
                # It may have left a record behind (a write of it stored after its release looked):
                # the key's next session here removes such a record at once, not after its TTL.
                self._note_ended_claim(session.key, session.lock)
            return outcome
        except Exception:
            # A session reports its own failures; one that escapes must not take the worker down.
            log.exception("queue %s key %s: session ended with an unexpected error", self.config.name, session.key)
            return "failed"
        finally:
            if self._held.get(session.key) is session:
                self.sessions.pop(session.key, None)
                del self._held[session.key]
            self._giving_back.discard(session)
            session.forget()
            await self.slots.changed()  # a parked session may take the slot
            self.puller.wake()

    # --- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Ensure the topology, then hold keys until :meth:`stop` and the drain finish."""
        try:
            await self._ensure_topology()
            _raise_if_cancelled()
            await self._start_lane()
        except BaseException as e:
            self._start_error = e
            self._started.set()
            raise
        log.info("worker %s serving queue %s with %d slots (ack_wait=%ss, linger=%ss)", self.name,
                 self.config.name, self.concurrency, self.settings.ack_wait, self.settings.linger)
        link = link_of(self.nc)
        unlisten = link.on_down(self._connection_dropped) if link is not None else None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                helpers = [
                    tg.create_task(self.puller.run(), name="puller"),
                    tg.create_task(self.reconciler.run(), name="reconciler"),
                    tg.create_task(self._watch_loop_lag(), name="loop-lag"),
                    tg.create_task(self._probe_waiting_tokens(), name="waiting-tokens"),
                    tg.create_task(self._recheck_keys(), name="rechecks"),
                ]
                lane = tg.create_task(self.lane.run(), name="unkeyed") if self.lane is not None else None
                self._started.set()
                if self.watchdog is not None:
                    self.watchdog.start()
                try:
                    await self.draining.wait()
                except asyncio.CancelledError:
                    # Cut off (another queue failed to start, say).
                    await _cancel_all(helpers + ([lane] if lane is not None else []))
                    raise
                self.puller.stop()
                if self.lane is not None:
                    self.lane.stop(now=self._stop_now)  # it drains beside the key sessions
                await self._drain()
                if lane is not None:
                    await asyncio.wait([lane])
                await _cancel_all(helpers)
        finally:
            if unlisten is not None:
                unlisten()
            self._tg = None
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.alarm is not None and not self._running:
                self.alarm.close()  # else it stays armed: a run still going on ends with the process
        log.debug("worker %s stopped serving queue %s: %s", self.name, self.config.name, self.summary())

    async def _ensure_topology(self) -> None:
        """Create or check the queue's streams and consumer, and settle this worker's lease: the
        server's (``follow_lease``) or ``settings.ack_wait``, set on the server in place. A server
        that cannot answer yet (a cluster electing leaders, a restart) is waited for, each attempt
        logged; a layout that does not match is raised at once."""
        delay = 0.5
        began = time.monotonic()
        while True:
            try:
                topology = Topology(JetStreamApi(self.nc), self.config)
                lease = await topology.ensure_worker(None if self.follow_lease else self.settings.ack_wait)
                self._use_lease(lease)
                self.io.release_markers = await topology.allow_release_markers()
                return
            except (KeyqueueTimeout, ConnectionFailed, JetStreamUnavailable) as e:
                # "No responders" that lasts is a server without JetStream, not an election. (A cluster
                # electing, just formed or with a node down answers JetStreamUnavailable meanwhile.)
                no_jetstream = type(e) is ConnectionFailed and time.monotonic() - began > NO_JETSTREAM_AFTER
                if self.draining.is_set() or no_jetstream:
                    raise
                log.warning("queue %s: cannot set up its streams yet (%s); retrying in %.1fs", self.config.name, e,
                            delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def _start_lane(self) -> None:
        """With unkeyed tasks: set up the work stream's consumer and open the lane (core/unkeyed.py)."""
        if self._unkeyed is None:
            return
        settings = LaneSettings(self.settings.retry, self.settings.crash_loop_limit, self.settings.drain_timeout)
        self.lane = UnkeyedLane(self.nc, self.config, self._unkeyed, settings, observer=self.report,
                                concurrency=self.concurrency)
        await self.lane.prepare()

    def _use_lease(self, lease: Change) -> None:
        """Hold keys for the lease the server now has. Workers already running keep their own until
        they restart: each holds its keys through lease records whose TTL is its own lease, so no
        worker ever believes it holds a key longer than the server keeps its record."""
        if lease.before != lease.after:
            log.warning("queue %s: the lease changed on the server, %s; workers already running keep theirs "
                        "until they restart", self.config.name, lease)
        elif self.follow_lease:
            log.info("queue %s: lease (ack_wait) %gs, the queue's on the server (`keyqueue configure %s "
                     "--ack-wait SECONDS` changes it)", self.config.name, lease.after, self.config.name)
        if lease.after != self.settings.ack_wait:
            self.settings = dataclasses.replace(self.settings, ack_wait=lease.after)
            self.config = dataclasses.replace(self.config, ack_wait=lease.after)
            self._stale_after = lease.after - Lease.default_margin(lease.after)

    async def started(self) -> None:
        """Wait until the worker is pulling tokens; raises what kept it from starting."""
        await self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self, *, now: bool = False) -> None:
        """Begin a graceful drain; ``now`` cuts running requests off (they run again elsewhere)."""
        self._stop_now = self._stop_now or now
        self.draining.set()
        if self.lane is not None:
            self.lane.stop(now=now)
        for session in list(self._held.values()):
            session.wake()  # a session waiting for a request notices the drain at once
        if now:
            self._cut_off_sessions()

    async def _drain(self) -> None:
        await self.slots.changed()  # parked sessions go on to give their keys back
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.sessions and time.monotonic() < deadline and not self._stop_now:
            await asyncio.wait(list(self.sessions.values()), timeout=max(0.0, deadline - time.monotonic()))
        self._cut_off_sessions()
        if self.sessions:
            await asyncio.wait(list(self.sessions.values()), timeout=DRAIN_GRACE)
        if self.sessions and self.watchdog is not None:
            # A session cut off at the deadline still runs: a sync task blocked in C code, which no
            # exception reaches. Its thread ends only with the process, so the process ends now
            # (the drain deadline holds), before anything is given back for those keys: their
            # leases end on the server, or the --processes parent releases them as it reaps us.
            self.watchdog.end_process(
                f"{len(self.sessions)} key session(s) still ran {DRAIN_GRACE:g}s after the drain deadline "
                f"(a sync task that no exception stops: {', '.join(sorted(self.sessions)[:5])})")

    def _cut_off_sessions(self) -> None:
        """Cancel the key sessions (the drain deadline, a stop now), but none that is giving its key
        back: a give-back runs in its session's task and to its end, each step tried for 5 s at a
        time and again only while the lease holds (core/hand_back.py), as it did when cut off (it
        was then awaited all the same)."""
        for key, task in list(self.sessions.items()):
            held = self._held.get(key)
            if held is None or not held.giving_back:
                task.cancel()

    def reconnected(self) -> None:
        self.puller.reconnected()
        self.reconciler.wake()
        if self.lane is not None:
            self.lane.reconnected()

    # --- keys whose release was cut short ----------------------------------------------------------

    def recheck_later(self, token: Token, cursor: int) -> None:
        """A session released its key without knowing its token is gone, or could not re-check the
        key's inbox after (the connection was down): remove that token for sure and re-check the
        inbox once connected, so a request stored meanwhile is not left without a token until a
        reconciler pass. Safe at any time: a token is a hint, and a newer one has another sequence."""
        self._rechecks[token.key] = (token, cursor)
        self._recheck_wanted.set()

    def remove_leftover(self, lock: KeyLock) -> None:
        """A session lost its lease, and its work has ended: remove its lease record once connected.
        The server expires it by itself after its TTL, but not always after a kill -9 and restart
        (core/lock.py), and then the next holder waits until it has watched it for twice the TTL.
        Safe at any time: a record is removed by its sequence (one written since by anyone else is
        untouched), and nothing of the session runs any more. Given up after twice the TTL."""
        if lock.seq or lock.unsettled:
            self._leftovers.append((lock, time.monotonic() + 2 * lock.ttl))
            self._recheck_wanted.set()

    def _ended_claim(self, key: str) -> str | None:
        """The nonce of this worker's last ended claim on ``key`` that may have left a record (None:
        none, or it is older than twice its TTL, when the record has expired anyway)."""
        ended = self._ended_claims.get(key)
        if ended is None:
            return None
        if time.monotonic() >= ended[1]:
            del self._ended_claims[key]
            return None
        return ended[0]

    def _note_ended_claim(self, key: str, lock: KeyLock) -> None:
        now = time.monotonic()
        if len(self._ended_claims) >= 1024:
            self._ended_claims = {k: v for k, v in self._ended_claims.items() if v[1] > now}
        self._ended_claims[key] = (lock.nonce, now + 2 * lock.ttl)

    def _note_released(self, lock: KeyLock) -> None:
        now = time.monotonic()
        released = self._released
        released.append((now, lock.seq, lock.ttl))
        while released[0][0] < now - REDELETE_WINDOW:
            released.popleft()

    def _connection_dropped(self) -> None:
        """The connection dropped: the lease records removed just before may come back.

        nats-server answers a delete before its store has written it, so a server killed right
        after may restart with a record whose removal it confirmed, and it does not always expire
        such a record by its TTL after a restart (core/lock.py); the next holder would then wait until
        it has watched it for twice the TTL. So the records removed in the last
        :data:`REDELETE_WINDOW` seconds are removed again once connected. Safe at any time: by
        sequence, a record written since by anyone else is untouched, and those sessions are over."""
        now = time.monotonic()
        self._redeletes.extend((seq, now + 2 * ttl) for when, seq, ttl in self._released
                               if when >= now - REDELETE_WINDOW)
        self._released.clear()
        if self._redeletes:
            self._recheck_wanted.set()

    async def _remove_again(self) -> None:
        now = time.monotonic()
        batch = [(seq, give_up) for seq, give_up in self._redeletes if give_up > now]
        self._redeletes.clear()
        results = await asyncio.gather(*(self.io.remove_record(seq) for seq, _ in batch), return_exceptions=True)
        failed = [entry for entry, result in zip(batch, results, strict=True) if isinstance(result, BaseException)]
        if failed:
            log.debug("queue %s: removing %d released lease records again failed, trying again: %r",
                      self.config.name, len(failed), next(r for r in results if isinstance(r, BaseException)))
            self._redeletes.extend(failed)
            await asyncio.sleep(0.5)

    async def _remove_leftovers(self) -> None:
        while self._leftovers:
            lock, give_up = self._leftovers.pop(0)
            if time.monotonic() >= give_up:
                continue
            try:
                await lock.release()
            except Exception as e:  # a bug too: it must not end the key sessions (one task group)
                log.log(logging.DEBUG if isinstance(e, KeyqueueError) else logging.ERROR,
                        "queue %s: removing a lost lease's record failed, trying again: %r", self.config.name, e,
                        exc_info=not isinstance(e, KeyqueueError))
                self._leftovers.append((lock, give_up))
                await asyncio.sleep(0.5)

    async def _recheck_keys(self) -> None:
        while True:
            await self._recheck_wanted.wait()
            self._recheck_wanted.clear()
            if self._leftovers or self._redeletes:
                if await self.io.wait_connected(self.settings.ack_wait):
                    await self._remove_leftovers()
                    while self._redeletes and self.io.nc.is_connected:
                        await self._remove_again()
                if self._redeletes or self._leftovers:
                    self._recheck_wanted.set()  # later (each entry is given up after twice its TTL)
            while self._rechecks:
                if not await self.io.wait_connected(self.settings.ack_wait):
                    continue
                key, (token, cursor) = next(iter(self._rechecks.items()))
                try:
                    await self.io.delete_token(token)
                    if await self.io.next_request(key, cursor, requests_only=True) is not None:
                        await self.io.schedule(key)
                except Exception as e:  # a bug too: it must not end the key sessions (one task group)
                    log.log(logging.DEBUG if isinstance(e, KeyqueueError) else logging.ERROR,
                            "queue %s key %s: re-check failed, trying again: %r", self.config.name, key, e,
                            exc_info=not isinstance(e, KeyqueueError))
                    await asyncio.sleep(0.5)
                    continue
                if self._rechecks.get(key) == (token, cursor):
                    del self._rechecks[key]

    def _held_leases(self) -> list[HeldLease]:
        """The keys held under a valid lease, and those whose run goes on after their lease was lost
        (read by the watchdog's thread)."""
        sessions = {id(s): s for s in list(self._held.values()) if s.acquired and s.lease.lost_reason is None}
        sessions.update((id(s), s) for s in list(self._running))
        return [HeldLease(s.key, s.lease.deadline, s._in_hand, running=s.running) for s in sessions.values()]

    # --- the lease alarm (core/alarm.py) -------------------------------------------------------------

    def _run_changed(self, session: KeySession, running: bool) -> None:
        """A session's work began or ended: keep the lease alarm no later than the earliest kill point
        of the runs going on. A run that ends leaves the alarm where it is, at a kill point no later
        than the others', until the next tick of the loop (every :data:`LOOP_TICK`) moves it to the
        earliest of those still going on: a loop that stalls meanwhile for most of a lease is ended
        a little sooner than it had to be, never later. (Moving it at once cost a scan of every run
        and a system call for each of most cold keys.) The last run to end disarms it."""
        if running:
            self._running.add(session)
            if self.alarm is not None and (self.alarm.armed is None or session.lease.kill_point < self.alarm.armed):
                self.alarm.set(session.lease.kill_point)
            return
        self._running.discard(session)
        if self.alarm is not None and not self._running:
            self.alarm.set(None)
        if self._held.get(session.key) is session:
            # Its slot goes to a new key (a parked session waiting to go on is told when the session
            # ends, as before: until then free() keeps the slot for it).
            self._giving_back.add(session)
            self._slot_freed()

    def _arm_alarm(self) -> None:
        if self.alarm is not None:
            self.alarm.set(min((s.lease.kill_point for s in self._running), default=None))

    def _count_killed(self, held: Sequence[HeldLease], budget: float) -> None:
        count_killed_attempts(self.nc, self.config, [(h.key, h.in_hand) for h in held], budget)

    async def _watch_loop_lag(self) -> None:
        """Track when the loop last ran freely, and warn when it stalls past ``ack_wait / 3``."""
        limit = self.settings.ack_wait / 3
        while True:
            self._last_tick = time.monotonic()
            if self.watchdog is not None:
                self.watchdog.beat()
            self._arm_alarm()  # renewals moved the kill points later
            await asyncio.sleep(LOOP_TICK)
            lag = time.monotonic() - self._last_tick - LOOP_TICK
            if lag >= self._stale_after:
                log.warning("this process stalled for %.1fs, longer than the ack wait: abandoning in-flight "
                            "pulls so no stale token is acted on", lag)
                self.puller.abandon_pulls()
            if lag > limit:
                held = ", ".join(sorted(self.sessions)[:5])
                log.warning("event loop blocked for %.1fs (keys held: %s): a handler is blocking the loop; "
                            "make it async or a sync function (run in a thread), or the lease is lost", lag, held)

    async def _probe_waiting_tokens(self) -> None:
        """While every slot is busy, learn whether other keys wait for a slot."""
        while True:
            await asyncio.sleep(1.0)
            if self.free_slots() > 0:
                self._tokens_pending = 0  # the puller is asking for more: the next token says
                continue
            try:
                self._tokens_pending = await self.io.tokens_waiting()
                self._make_room(self._tokens_pending - self.free_slots())
            except KeyqueueError:
                pass  # learnt from the next token, or the next probe
            except Exception:
                log.exception("queue %s: probing the tokens waiting failed unexpectedly", self.config.name)


class _Report:
    """The observer a queue worker's sessions call: logs and counts each step (by its event name:
    ``acquired``, ``lease_lost``, ``dead_lettered``, ...), then tells the worker's observer."""

    def __init__(self, queue: str, observer: SessionObserver) -> None:
        self.queue = queue
        self.observer = observer
        self.counts: dict[str, int] = {}
        self.outage = LogThrottle(OUTAGE_LOG_INTERVAL)

    def _log(self, event: str, level: int, key: str | None, message: str, *args: object,
             exc_info: BaseException | None = None, **fields: Any) -> None:
        """Count ``event``; log ``message % args`` with the event's fields as ``kq_*`` attributes."""
        self._count(event)
        if log.isEnabledFor(level):
            extra = {"kq_event": event, "kq_queue": self.queue, "kq_key": key,
                     **{f"kq_{k}": v for k, v in fields.items()}}
            log.log(level, message, *args, extra=extra, exc_info=exc_info)

    def _count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1

    def _tell(self, step: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            step(*args, **kwargs)
        except Exception:
            log.exception("session observer failed in %s; carrying on", step.__name__)

    def token_received(self, queue: str, key: str, delivered: int) -> None:
        self._tell(self.observer.token_received, queue, key, delivered)

    def key_acquired(self, hold: KeyHold) -> None:
        self._log("acquired", logging.DEBUG, hold.key, "queue %s key %s: acquired (fencing %s)", self.queue,
                  hold.key, hold.fencing, fencing=hold.fencing, delivered=hold.delivered)
        self._tell(self.observer.key_acquired, hold)

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        outcome, key = end.outcome, hold.key
        if outcome is Outcome.LEASE_LOST:
            self._log("lease_lost", logging.WARNING, key, "queue %s key %s: lease lost (%s); nothing more was "
                      "sent for the key", self.queue, key, end.reason, reason=end.reason)
        elif outcome is Outcome.FAILED:
            self._session_failed(key, end)
        elif outcome is Outcome.INTERRUPTED:
            self._log(outcome.value, logging.INFO, key, "queue %s key %s: interrupted by the stop; the request in "
                      "hand runs again elsewhere", self.queue, key)
        elif outcome is Outcome.CONTENDED:
            self._log(outcome.value, logging.DEBUG, key, "queue %s key %s: not acquired (another worker held it) "
                      "before the drain", self.queue, key)
        else:
            self._log(outcome.value, logging.DEBUG, key, "queue %s key %s: %s after %d request(s)%s", self.queue, key,
                      outcome.value, end.processed, "; requests arrived meanwhile, so it is scheduled again"
                      if end.republished else "", processed=end.processed, republished=end.republished)
        self._tell(self.observer.key_released, hold, end)

    def _session_failed(self, key: str, end: SessionEnd) -> None:
        error = end.error
        message = "queue %s key %s: session failed: %s; the key is delivered again shortly%s"
        described = describe(error) if error is not None else end.reason
        if not isinstance(error, _CONNECTION_ERRORS):
            self._log("session_failed", logging.ERROR, key, message, self.queue, key, described, "", exc_info=error,
                      error=described)
            return
        # An outage cuts off every session in hand at once: one line per error type and interval.
        held_back = self.outage.admit(type(error))
        if held_back is None:
            self._count("session_failed")
            return
        self._log("session_failed", logging.WARNING, key, message, self.queue, key, described,
                  LogThrottle.suffix(held_back), error=described)

    def request_started(self, attempt: RequestAttempt) -> None:
        if not log.isEnabledFor(logging.DEBUG):  # the per-request path: build no line nobody reads
            self._count("started")
            self._tell(self.observer.request_started, attempt)
            return
        self._log("started", logging.DEBUG, attempt.key, "%s started, attempt %d (%s)", _what(attempt),
                  attempt.attempt, self._where(attempt), request_id=attempt.request_id, seq=attempt.seq,
                  attempt=attempt.attempt, batch=attempt.batch, message_type=attempt.message_type)
        self._tell(self.observer.request_started, attempt)

    def attempt_failed(self, attempt: RequestAttempt, error: BaseException) -> None:
        self._count("failed")  # logged as retried or dead_lettered
        self._tell(self.observer.attempt_failed, attempt, error)

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        # One line per retry; where it was raised only at debug (the last attempt's traceback is
        # logged if the request is dead-lettered).
        self._log("retried", logging.WARNING, attempt.key, "%s failed on attempt %s, retrying in %s: %s (%s)",
                  _what(attempt), _of(attempt), _seconds(delay), describe(error), self._where(attempt),
                  exc_info=error if log.isEnabledFor(logging.DEBUG) else None, request_id=attempt.request_id,
                  seq=attempt.seq, attempt=attempt.attempt, delay=delay, error=describe(error),
                  message_type=attempt.message_type)
        self._tell(self.observer.request_retried, attempt, delay, error)

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            self._count("succeeded")
        elif superseded_by is not None:
            self._log("succeeded", logging.DEBUG, request.key, "%s superseded by request %s (%s)", _what(request),
                      superseded_by, self._where(request), request_id=request.request_id, seq=request.seq,
                      superseded_by=superseded_by, message_type=request.message_type)
        else:
            self._log("succeeded", logging.DEBUG, request.key, "%s succeeded in %.3fs (%s)", _what(request), elapsed,
                      self._where(request), request_id=request.request_id, seq=request.seq, elapsed=elapsed,
                      message_type=request.message_type)
        self._tell(self.observer.request_succeeded, request, elapsed, superseded_by)

    def request_dead_lettered(self, request: RequestAttempt, reason: DeadLetterReason, error: BaseException) -> None:
        fields: dict[str, Any] = {"request_id": request.request_id, "seq": request.seq, "reason": reason,
                                  "attempts": request.attempt, "error": describe(error),
                                  "message_type": request.message_type}
        what, where = _what(request), self._where(request)
        if reason == DeadLetterReason.REJECTED:
            # Bad input (Reject, an unreadable message): expected, and its message says why.
            self._log("dead_lettered", logging.WARNING, request.key, "%s rejected, moved to the dead-letter queue: "
                      "%s (%s)", what, describe(error), where, **fields)
        elif reason == DeadLetterReason.MAX_ATTEMPTS:
            last = request.attempt
            self._log("dead_lettered", logging.ERROR, request.key, "%s failed on attempt %d of %d, moved to the "
                      "dead-letter queue: %s (%s)", what, last, last, describe(error), where, exc_info=error, **fields)
        else:
            self._log("dead_lettered", logging.ERROR, request.key, "%s moved to the dead-letter queue (%s): %s (%s)",
                      what, reason, describe(error), where, **fields)
        self._tell(self.observer.request_dead_lettered, request, reason, error)

    def worker_pinned(self, queue: str, pin_id: str) -> None:
        self._log("pinned", logging.INFO, None, "queue %s: this worker is its pinned client (pin %s)", queue, pin_id,
                  pin_id=pin_id)
        self._tell(self.observer.worker_pinned, queue, pin_id)

    def worker_unpinned(self, queue: str, pin_id: str) -> None:
        self._log("unpinned", logging.INFO, None, "queue %s: this worker is no longer its pinned client (pin %s)",
                  queue, pin_id, pin_id=pin_id)
        self._tell(self.observer.worker_unpinned, queue, pin_id)

    def _where(self, request: RequestAttempt) -> str:
        """``queue shop, key o1, request 01J...``; a request without an id (not sent by keyqueue) by
        its inbox sequence: ``seq 17``."""
        named = f"request {request.request_id}" if request.request_id else f"seq {request.seq}"
        return f"queue {self.queue}, {'unkeyed' if request.key == UNKEYED else f'key {request.key}'}, {named}"

    def around_attempt(self, attempt: RequestAttempt, context: RequestContext,
                       requests: Sequence[Request]) -> AbstractAsyncContextManager[object]:
        return self.observer.around_attempt(attempt, context, requests)

    async def wait_for_room(self) -> None:
        try:
            await self.observer.wait_for_room()
        except Exception:
            log.exception("session observer failed in wait_for_room; carrying on")


def _what(request: RequestAttempt) -> str:
    """What a log line calls a request: its task (``X-MESSAGE-TYPE``), else "request"."""
    return request.message_type or "request"


def _seconds(delay: float) -> str:
    """A delay for a log line: ``52ms``, ``1.5s``."""
    return f"{delay * 1000:.0f}ms" if delay < 1 else f"{delay:.1f}s"


def _of(attempt: RequestAttempt) -> str:
    """``2 of 5``, or ``2`` where the number of attempts allowed is not known."""
    return f"{attempt.attempt} of {attempt.max_attempts}" if attempt.max_attempts else str(attempt.attempt)


def _check_pull_options(config: QueueConfig, pull: PullOptions) -> None:
    """Refuse a worker's part that its queue's priority policy would silently ignore."""
    thresholds = bool(pull.min_pending or pull.min_ack_pending)
    ignored = {"pinned_client": ("a priority or overflow thresholds", pull.priority is not None or thresholds),
               "overflow": ("a priority", pull.priority is not None),
               "prioritized": ("overflow thresholds", thresholds)}.get(config.priority_policy)
    if ignored is not None and ignored[1]:
        raise ConfigError(f"queue {config.name!r} has priority policy {config.priority_policy}, which takes no "
                          f"{ignored[0]}; drop the option (see docs/priority-groups.md)")


def _raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if this task was cancelled but the cancel was dropped on the way
    (nats-py's requests use ``asyncio.wait_for``, which on Python 3.11 drops a cancel that arrives
    as its reply does): a queue worker cancelled while it set up its streams must not start."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they end, cancelling again any that carries on: on Python
    3.11 ``asyncio.wait_for`` drops a cancel that arrives as its future completes, so a helper
    cancelled at that moment would run another round (a reconciler would sleep a full interval)."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)
