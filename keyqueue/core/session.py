"""The key session: what a worker runs while it holds a key's token (DESIGN.md section 4).

    acquire token ─► open processor ─► ┌─ lease check ─► read next request (stream order)
                                       │      │ none: wait for an arrival, at most `linger`
                                       │      ▼
                                       │  handle ─► ok: delete, reply ─┐
                                       │         └► fail: backoff, retry in place, or DLQ
                                       └──────────────────────────────┘
    quiescent ─► processor.idle() ─► lease check ─► ack ─► re-check inbox ─► re-publish token?

A lost lease ends the session at once: no ack, no nak, no delete, no reply. The keepalive task
and the work run in one TaskGroup, so a keepalive that finds the lease lost cancels the work.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from keyqueue.core.lease import Lease
from keyqueue.core.processor import KeyProcessor, ProcessorFactory, Reply, Request
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import KeyqueueError, LeaseLost, Reject, WireError
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.queue_io import QueueIO, Watch
from keyqueue.wire import headers as H

log = logging.getLogger("keyqueue.session")

READ_AHEAD: Final = 32
"""Requests read per round trip (a batched direct get)."""

ARRIVAL_GRACE: Final = 0.1
"""Seconds to keep re-reading after an arrival on the key's subject found no stored request."""

MAX_UNCONFIRMED_DELETES: Final = 8
"""Deletes in flight before the session waits for their confirmations."""

Emit = Callable[..., None]
"""``emit(event, **fields)``: the worker's sink for session lifecycle events."""


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


class Outcome:
    RELEASED = "released"
    LEASE_LOST = "lease-lost"
    HANDED_OFF = "handed-off"
    FAILED = "failed"


class _Context:
    """The SessionContext / RequestContext handed to processors."""

    def __init__(self, session: KeySession) -> None:
        self._session = session
        self.queue = session.io.names.queue
        self.key = session.token.key
        self.fencing = session.token.fencing
        self.request_id = ""
        self.attempt = 0
        self.log = logging.LoggerAdapter(logging.getLogger("keyqueue.task"),
                                         {"queue": self.queue, "key": self.key})

    def lease_valid(self) -> bool:
        return self._session.lease.valid()

    def check_lease(self) -> None:
        self._session.lease.check()

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.check_lease()
        extra = {H.REQUEST_ID: self.request_id} if self.request_id else {}
        await self._session.io.progress(self.key, data, {**extra, **(headers or {})})


class KeySession:
    """One held key: reads its requests in order and hands them to its processor."""

    def __init__(self, io: QueueIO, token: Token, factory: ProcessorFactory, settings: SessionSettings, *,
                 emit: Emit, draining: asyncio.Event, should_yield: Callable[[], bool] = lambda: False,
                 worker: str = "") -> None:
        self.io = io
        self.token = token
        self.key = token.key
        self.factory = factory
        self.settings = settings
        self.emit = emit
        self.draining = draining
        self.should_yield = should_yield
        self.worker = worker
        self.lease = Lease(settings.ack_wait, token.received_at)
        self.cursor = 1
        """The inbox sequence to read the next request from."""
        self.processed = 0
        self.republished = False
        self.buffer: collections.deque[StoredMsg] = collections.deque()
        """Requests read ahead and not yet processed, in stream order."""
        self.more = True
        """Whether the inbox may hold requests past the read-ahead buffer (until a read says no;
        after that, an arrival on the key's subject says yes again)."""
        self.deletes: list[asyncio.Future[Any]] = []
        """Deletes sent and not yet confirmed."""
        self.ctx = _Context(self)

    # --- the whole session -----------------------------------------------------------------------

    async def run(self) -> str:
        """Run to the end; returns an :class:`Outcome`. Never raises but for cancellation."""
        self.emit("acquired", key=self.key, fencing=self.token.fencing, delivered=self.token.delivered)
        try:
            return await self._run()
        except asyncio.CancelledError:
            # Cut off by the drain deadline (or a second signal): the request in hand stays
            # stored; a nak hands the key to another worker now rather than after ack_wait.
            if self.draining.is_set() and self.lease.valid():
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.io.nak(self.token))
                self.emit("interrupted", key=self.key)
            raise

    async def _run(self) -> str:
        try:
            async with asyncio.TaskGroup() as tg:
                keepalive = tg.create_task(self._keepalive(), name=f"keepalive:{self.key}")
                try:
                    outcome = await self._work()
                finally:
                    keepalive.cancel()
        except BaseExceptionGroup as group:
            lost = group.subgroup(LeaseLost)
            if lost is not None:
                reason = self.lease.lost_reason or str(lost.exceptions[0]) or "lease lost"
                self.emit("lease_lost", key=self.key, reason=reason)
                return Outcome.LEASE_LOST
            failed = group.subgroup(Exception)
            if failed is None:
                raise
            # A processor or NATS failure: nothing is acked, the token is redelivered later.
            first = failed.exceptions[0]
            self.emit("session_failed", key=self.key, error=repr(first))
            log.error("queue %s key %s: session failed: %r", self.io.names.queue, self.key, first,
                      exc_info=first)
            return Outcome.FAILED
        self.emit(outcome, key=self.key, processed=self.processed, republished=self.republished)
        return outcome

    async def _keepalive(self) -> None:
        # The first deadline already runs from receipt, so a keepalive sent at once would buy
        # only the milliseconds since then: the first one goes out after one interval.
        await asyncio.sleep(min(self.lease.interval, max(0.0, self.lease.remaining())))
        while True:
            self.lease.check()  # first thing on waking: a resumed process must not renew a lapsed lease
            sent = time.monotonic()
            try:
                await self.io.keepalive(self.token, timeout=max(0.05, self.lease.remaining()))
                self.lease.confirmed(sent, time.monotonic())
            except LeaseLost:
                raise
            except Exception as e:
                log.debug("keepalive for %s failed: %r", self.key, e)
            if not self.lease.valid():
                raise LeaseLost(self.lease.lost_reason)
            await asyncio.sleep(min(self.lease.interval, max(0.0, self.lease.remaining())))

    async def _work(self) -> str:
        processor = await self._build_processor()
        # The arrival watch (a core subscription on the key's inbox subject) is opened only when
        # the session first has to wait: a key released at once (its worker is full and other
        # keys wait) never pays for it. Opening it is followed by one more read, since a request
        # may have landed between the last read and the subscription.
        watch: Watch | None = None
        reason = "quiescent"
        try:
            await processor.open(self.ctx)
            if self.token.delivered > self.settings.crash_loop_limit:
                await self._break_crash_loop()
            while True:
                if self.draining.is_set():
                    reason = "shutdown"
                    break
                self.lease.check()
                if self.buffer or self.more or (watch is not None and watch.event.is_set()):
                    woken = watch is not None and watch.event.is_set() and not self.buffer and not self.more
                    if watch is not None:
                        watch.event.clear()
                    batch = await self._read(processor)
                    if not batch and woken:
                        batch = await self._read_after_arrival(processor)
                    if batch:
                        await self._process(processor, batch)
                        # With requests read ahead and deletes pipelined, a session can go many
                        # requests without awaiting I/O: yield, so other keys, keepalives and the
                        # connection's flusher run between requests.
                        await asyncio.sleep(0)
                        continue
                if self.should_yield():
                    break
                if watch is None:
                    watch = await self.io.watch(self.key)
                    self.more = True
                    continue
                if not await self._await_arrival(watch):
                    break
            return await self._release(processor, reason)
        finally:
            if watch is not None:
                await watch.close()
            # Always closed, so a processor can stop its background work; a processor must not
            # write anything on "lease-lost" (another worker may own the key now).
            await processor.close(self.ctx, reason if self.lease.valid() else "lease-lost")

    async def _build_processor(self) -> KeyProcessor:
        built = self.factory(self.key)
        return await built if inspect.isawaitable(built) else built

    async def _await_arrival(self, watch: Watch) -> bool:
        """Wait for a new request; False once ``linger`` passes (or a drain starts) with none."""
        waiters = {asyncio.ensure_future(watch.event.wait()), asyncio.ensure_future(self.draining.wait())}
        try:
            await asyncio.wait(waiters, timeout=self.settings.linger,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return watch.event.is_set() and not self.draining.is_set()

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
            start = self.buffer[-1].seq + 1 if self.buffer else self.cursor
            msgs, self.more = await self.io.read(self.key, start, max(want - len(self.buffer), READ_AHEAD))
            self.buffer.extend(msgs)
            if not self.more:
                break
        return [self.buffer.popleft() for _ in range(min(want, len(self.buffer)))]

    # --- processing with retries -----------------------------------------------------------------

    async def _process(self, processor: KeyProcessor, batch: list[StoredMsg]) -> None:
        requests = [Request(self.key, m.seq, m.subject, m.headers, m.data) for m in batch]
        head = requests[0]
        policy = processor.retry_policy(head) or self.settings.retry
        attempt = 0
        while True:
            attempt += 1
            self.lease.check()
            self.ctx.request_id, self.ctx.attempt = head.request_id, attempt
            started = time.monotonic()
            self.emit("started", key=self.key, request_id=head.request_id, seq=head.seq, attempt=attempt,
                      batch=len(requests), message_type=head.headers.get(H.MESSAGE_TYPE, ""))
            try:
                if getattr(processor, "batch_size", 0) > 0:
                    outcomes = await processor.handle_batch(self.ctx, requests)
                    if not 0 < len(outcomes) <= len(requests):
                        raise TypeError(f"handle_batch returned {len(outcomes)} outcomes for {len(requests)} "
                                        "requests; return one per request handled, at least one")
                else:
                    outcomes = [await processor.handle(self.ctx, head)]
            except LeaseLost:
                raise
            except (WireError, Reject) as e:
                await self._dead_letter(batch, e, attempt, reason="rejected")
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if policy.exhausted(attempt):
                    await self._dead_letter(batch, e, attempt, reason="max-attempts")
                    return
                delay = policy.delay(attempt)
                self.emit("retried", key=self.key, request_id=head.request_id, attempt=attempt,
                          delay=delay, error=f"{type(e).__name__}: {e}",
                          message_type=head.headers.get(H.MESSAGE_TYPE, ""))
                if not await self._backoff(delay):
                    return  # draining: the request stays at the head for the next holder
                continue
            # A batch processor may handle a prefix of the batch (the rest stays at the head, in
            # order) and may reject single requests by returning the exception in their place.
            handled = len(outcomes)
            self.buffer.extendleft(reversed(batch[handled:]))
            batch, requests = batch[:handled], requests[:handled]
            for msg, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    await self._dead_letter([msg], outcome, attempt, reason="rejected")
            done = [(m, r, o) for m, r, o in zip(batch, requests, outcomes, strict=True)
                    if o is None or isinstance(o, Reply)]
            if done:
                await self._succeeded([d[0] for d in done], [d[1] for d in done], [d[2] for d in done],
                                      time.monotonic() - started, through=batch[-1].seq)
            return

    async def _backoff(self, delay: float) -> bool:
        """Sleep before a retry, holding the key; False if a drain started meanwhile."""
        try:
            await asyncio.wait_for(self.draining.wait(), delay)
        except TimeoutError:
            return True
        return False

    async def _succeeded(self, batch: list[StoredMsg], requests: list[Request], replies: list[Reply | None],
                         elapsed: float, through: int) -> None:
        self.lease.check()
        last = through
        if len(batch) == 1 and batch[0].seq == through:
            # Pipelined: the next request starts without waiting for this delete's reply; every
            # delete is confirmed before the token is acked.
            self.deletes.append(await self.io.delete_soon(last))
            if len(self.deletes) >= MAX_UNCONFIRMED_DELETES:
                await self._settle_deletes()
        else:
            await self.io.purge_through(self.key, last)
        self.cursor = last + 1
        self.processed += len(batch)
        for request, reply in zip(requests, replies, strict=False):
            if request.reply_inbox:
                self.lease.check()
                await self.io.reply(request.reply_inbox, {H.STATUS: "ok", H.REQUEST_ID: request.request_id,
                                                          **(reply.headers if reply else {})},
                                    reply.data if reply else b"")
            self.emit("succeeded", key=self.key, request_id=request.request_id, seq=request.seq,
                      elapsed=elapsed, message_type=request.headers.get(H.MESSAGE_TYPE, ""))

    async def _settle_deletes(self) -> None:
        deletes, self.deletes = self.deletes, []
        await self.io.settle(deletes)

    async def _dead_letter(self, batch: list[StoredMsg], error: BaseException, attempts: int, *,
                           reason: str) -> None:
        for msg in batch:
            self.lease.check()
            why = {
                H.DLQ_REASON: reason,
                H.DLQ_ERROR_TYPE: type(error).__name__,
                H.ERROR_MESSAGE: H.header_safe(str(error)),
                H.DLQ_ATTEMPTS: str(attempts),
                H.DLQ_ORIGINAL_SUBJECT: msg.subject,
                H.DLQ_ORIGINAL_SEQ: str(msg.seq),
                H.DLQ_TIME: datetime.now(UTC).isoformat(),
            }
            await self.io.dead_letter(self.key, msg, why)
            await self.io.delete(msg.seq)
            self.cursor = msg.seq + 1
            inbox = msg.headers.get(H.REPLY_INBOX)
            if inbox:
                await self.io.reply(inbox, {H.STATUS: "dead-lettered", H.REQUEST_ID: msg.headers.get(H.MSG_ID, ""),
                                            H.ERROR_TYPE: type(error).__name__,
                                            H.ERROR_MESSAGE: H.header_safe(str(error)),
                                            H.DLQ_REASON: reason}, b"")
            self.emit("dead_lettered", key=self.key, request_id=msg.headers.get(H.MSG_ID, ""), seq=msg.seq,
                      reason=reason, attempts=attempts, error=f"{type(error).__name__}: {error}",
                      message_type=msg.headers.get(H.MESSAGE_TYPE, ""))

    async def _break_crash_loop(self) -> None:
        head = await self.io.next_request(self.key, self.cursor)
        if head is None:
            return
        error = KeyqueueError(f"the key's token was delivered {self.token.delivered} times while this request "
                              "stayed at the head: workers keep dying or losing the lease on it")
        await self._dead_letter([head], error, self.token.delivered, reason="crash-loop")

    # --- release ---------------------------------------------------------------------------------

    async def _release(self, processor: KeyProcessor, reason: str) -> str:
        """Finish owed work, ack the token, then re-check the inbox and re-schedule if needed."""
        if reason == "shutdown":
            try:
                await asyncio.wait_for(processor.idle(self.ctx), self.settings.drain_timeout)
            except TimeoutError:
                self.lease.check()
                await self.io.nak(self.token)
                return Outcome.HANDED_OFF
        else:
            await processor.idle(self.ctx)
        await self._settle_deletes()
        self.lease.check()
        await self.io.ack(self.token)
        # A request stored after our last read had its token publish rejected (ours still
        # existed): look again now that our token is gone, and schedule the key if one remains.
        if await self.io.next_request_authoritative(self.key, self.cursor) is not None:
            self.republished = await self.io.schedule(self.key)
        return Outcome.HANDED_OFF if reason == "shutdown" else Outcome.RELEASED
