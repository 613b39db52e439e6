"""Helpers for testing code that uses keyqueue: run tasks in this process, without NATS.

::

    from keyqueue.testing import eager

    async def test_checkout() -> None:
        with eager(app) as runner:
            assert await charge.call(order_id="o1", amount=5) == {"charged": 5}
            await charge.enqueue(order_id="o1", amount=-1)   # raises the task's ValueError
        assert runner.dead_letters == []

In eager mode ``enqueue``, ``call``, ``delay`` and ``enqueue_many`` hand requests to an
``EagerRunner`` instead of NATS. Requests travel the same way as in a worker (arguments
encoded as CBOR, decoded by the default processor, results encoded back), so a non-plain
argument or a result that cannot travel fails here too. Each key's requests run one at a time
and in order: a request enqueued for a key while that key runs (from inside a task, say) runs
after the current one. Unkeyed tasks' requests run one at a time too (in one queue, in order), but a
``call`` of an unkeyed task from inside a run is run at once, as a worker's unkeyed lane would run it
beside the caller. Retries run at once, without backoff; after ``max_attempts`` a request is
dead-lettered (``runner.dead_letters``) and, with ``propagate=True`` (the default), its last
exception is raised from the ``enqueue`` / ``call`` that ran it.

``autorun=False`` keeps requests pending until ``await runner.drain()``, so the ``batch``,
``latest`` and ``merge`` policies see several requests of a key at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from keyqueue.app.application import App, default_app
from keyqueue.app.eager_clock import EagerClock
from keyqueue.app.status import kept_status
from keyqueue.builtins.processor import TaskProcessor
from keyqueue.builtins.request_records import RecordingTaskProcessor
from keyqueue.core.processor import HoldRemoval, Request
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import ConfigError, EnqueueError, InvalidSchedule, Reject, WireError
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.tasks.arguments import CANCELLED_BY
from keyqueue.tasks.context import Progress
from keyqueue.tasks.task import Receipt, TaskRequest
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

__all__ = ["EagerDeadLetter", "EagerProgress", "EagerRunner", "eager"]

T = TypeVar("T")


@dataclass(frozen=True)
class EagerDeadLetter:
    """A request the runner dead-lettered, and why."""

    queue: str
    key: str
    request_id: str
    task: str
    reason: str
    """``rejected`` (bad input, unknown task, ``Reject``), ``not-retried`` (not in ``retry_on``) or ``max-attempts``."""
    error: BaseException
    attempts: int


@dataclass(frozen=True)
class EagerProgress:
    """One ``ctx.progress(...)`` a task published."""

    queue: str
    key: str
    request_id: str
    value: Any
    task: str = ""
    attempt: int = 0


class _EagerRuns:
    """Rate-limit run logs in memory (the ``RunStore`` of eager mode)."""

    def __init__(self) -> None:
        self.logs: dict[tuple[str, str], tuple[list[float], int]] = {}

    async def get_runs(self, task: str, key: str) -> tuple[list[float], int]:
        return self.logs.get((task, key), ([], 0))

    async def put_runs(self, task: str, key: str, starts: list[float], expected_last: int, ttl: float) -> int:
        revision = self.logs.get((task, key), ([], 0))[1] + 1
        self.logs[(task, key)] = (list(starts), revision)
        return revision


@dataclass
class _Pending:
    request: TaskRequest
    seq: int


class _EagerContext:
    """The core's ``RequestContext`` for one attempt, in process: the lease never runs out."""

    hold_removal: HoldRemoval | None = None
    """Nothing is removed after the run: a write the processor owes is awaited by the processor."""

    def __init__(self, runner: EagerRunner, queue: str, key: str, request_id: str, attempt: int) -> None:
        self._runner = runner
        self.queue, self.key = queue, key
        self.fencing = (1, 1)
        self.request_id, self.attempt = request_id, attempt
        self.log = logging.LoggerAdapter(logging.getLogger("keyqueue.task"), {"queue": queue, "key": key})

    def lease_valid(self) -> bool:
        return True

    def lease_remaining(self) -> float:
        return math.inf

    def check_lease(self) -> None:
        return None

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        return await step()  # no connection to lose

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # no worker slot to lend

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        content_type = (headers or {}).get(H.CONTENT_TYPE, CBOR)
        value = loads(data, content_type) if data else None
        self._runner.progress.append(EagerProgress(self.queue, self.key, self.request_id, value,
                                                   (headers or {}).get(H.TASK, ""), self.attempt))


@dataclass
class EagerRunner:
    """Runs an app's task requests in this process, one at a time and in order per key."""

    app: App
    propagate: bool = True
    autorun: bool = True
    dead_letters: list[EagerDeadLetter] = field(default_factory=list)
    progress: list[EagerProgress] = field(default_factory=list)
    succeeded: list[str] = field(default_factory=list)
    """Request ids in the order they completed."""
    _pending: dict[tuple[str, str], collections.deque[_Pending]] = field(default_factory=dict)
    _running: set[tuple[str, str]] = field(default_factory=set)
    _seen: set[str] = field(default_factory=set)
    _replies: dict[str, tuple[dict[str, str], bytes]] = field(default_factory=dict)
    _kept: dict[str, tuple[dict[str, str], bytes]] = field(default_factory=dict)
    """Every finished request's reply, for ``App.result`` (which checks that its task keeps results)."""
    cancelled: list[str] = field(default_factory=list)
    """Request ids cancelled before they ran (``receipt.cancel()``), in order."""
    rate_waits: list[float] = field(default_factory=list)
    """Every wait for a key's rate limit (``rate_limit=``), in seconds, in order: the runner's clock
    (``now``) jumps ahead by each instead of sleeping (what falls due meanwhile runs at the next ``advance``)."""
    _runs: _EagerRuns = field(default_factory=_EagerRuns)
    _seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    now: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    """The runner's clock (UTC): a delayed request runs, and a periodic schedule ticks, when
    ``advance`` / ``advance_to`` move it past their time; it starts at the real time."""
    _clock: EagerClock | None = None

    # --- the Transport protocol ---

    async def enqueue(self, requests: Sequence[TaskRequest]) -> list[Receipt | EnqueueError]:
        receipts: list[Receipt | EnqueueError] = []
        for request in requests:
            if request.delay is not None and (due := request.delay.due(self.now)) > self.now:
                receipts.append(self.clock.hold(request, due))
                continue
            duplicate = request.request_id in self._seen
            seq = next(self._seq)
            if not duplicate:
                self._seen.add(request.request_id)
                self._pending.setdefault((request.queue, request.key), collections.deque()).append(
                    _Pending(request, seq))
            receipts.append(
                Receipt(request.request_id, request.key, seq, duplicate, request.queue, request.message_type)
            )
        if self.autorun:
            for queue_key in dict.fromkeys((r.queue, r.key) for r in requests):
                await self._drain_key(queue_key)
        return receipts

    async def call(self, request: TaskRequest, timeout: float) -> tuple[Mapping[str, str], bytes]:
        queue_key = (request.queue, request.key)
        nested = queue_key in self._running
        if nested and request.key != UNKEYED:  # an unkeyed request waits for no one: it runs at once
            raise ConfigError(
                f"call() for key {request.key!r} from inside a run of that key would wait for itself "
                "(a worker would time out); use enqueue() for follow-up work on the same key"
            )
        request.headers[H.REPLY_INBOX] = f"_INBOX.eager.{request.request_id}"  # so the result is encoded
        [receipt] = await self.enqueue([request])
        if isinstance(receipt, EnqueueError):
            raise receipt
        request.receipt = receipt
        if receipt.due is not None:  # waiting for a delayed request's result is the clock passing its due time
            await self.advance_to(receipt.due)
        if nested:
            await self._run_now(queue_key, request.request_id)
        else:
            await self._drain_key(queue_key)
        return self._replies.pop(request.request_id)

    async def kept_result(self, queue: str, request_id: str, timeout: float) -> tuple[Mapping[str, str], bytes] | None:
        """The reply of a finished request (results never expire in eager mode); None if it has not run."""
        return self._kept.get(request_id)

    async def status(self, queue: str, request_id: str, seq: int | None, key: str | None) -> str:
        """Where the request is in the runner: pending, scheduled, running, done, failed, cancelled or unknown."""
        if request_id in self.cancelled:
            return "cancelled"
        kept = self._kept.get(request_id)
        if kept is not None:
            return kept_status(dict(kept[0])) or "pending"
        for (pending_queue, pending_key), pending in self._pending.items():
            for index, item in enumerate(pending):
                if pending_queue == queue and item.request.request_id == request_id:
                    return "running" if index == 0 and (queue, pending_key) in self._running else "pending"
        if self._clock is not None and any(r.queue == queue and r.request_id == request_id
                                           for r in self._clock.pending):
            return "scheduled"
        return "done" if request_id in self._seen else "unknown"

    async def kept_progress(self, queue: str, request_id: str) -> Progress | None:
        """The last progress the request's task reported in this runner (every one is kept), or None."""
        for reported in reversed(self.progress):
            if reported.queue == queue and reported.request_id == request_id:
                return Progress(reported.value, request_id, reported.key, reported.task, reported.attempt, None)
        return None

    async def cancel(self, queue: str, request_id: str, seq: int | None, wait: float,
                     key: str | None = None) -> str:
        """Remove a pending request (``autorun=False``): ``cancelled``; ``running`` or ``done`` if it is too late."""
        if request_id in self.cancelled:
            return "cancelled"
        for (pending_queue, key), pending in self._pending.items():
            for index, item in enumerate(pending):
                if pending_queue != queue or item.request.request_id != request_id:
                    continue
                if index == 0 and (queue, key) in self._running:
                    return "running"
                del pending[index]
                self.cancelled.append(request_id)
                self._kept[request_id] = ({H.STATUS: H.STATUS_SUPERSEDED, H.REQUEST_ID: request_id,
                                           H.SUPERSEDED_BY: CANCELLED_BY,
                                           H.MESSAGE_TYPE: f"{item.request.message_type}.result"}, b"")
                return "cancelled"
        if self._clock is not None and self._clock.drop(queue, request_id):  # delayed, not due yet
            self.cancelled.append(request_id)
            return "cancelled"
        return "done" if request_id in self._seen else "unknown"

    async def _rate_wait(self, seconds: float) -> None:
        self.rate_waits.append(seconds)
        self.now += dt.timedelta(seconds=seconds)

    # --- running ---

    async def drain(self) -> None:
        """Run every pending request (and any they enqueue), key by key in order of arrival."""
        while keys := [k for k, pending in self._pending.items() if pending and k not in self._running]:
            for queue_key in keys:
                await self._drain_key(queue_key)

    @property
    def clock(self) -> EagerClock:
        """The delayed requests and periodic ticks waiting for the runner's clock."""
        if self._clock is None:
            self._clock = EagerClock(self.now, list(self.app.periodics.values()))
        return self._clock

    async def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead, running what falls due on the way (see ``advance_to``)."""
        if seconds < 0:
            raise InvalidSchedule(f"the clock only moves forward, not by {seconds}s")
        await self.advance_to(self.now + dt.timedelta(seconds=seconds))

    async def advance_to(self, when: dt.datetime) -> None:
        """Move the clock to ``when``: each delayed request and periodic tick due by then joins its
        key's order at its own time, oldest first (run at once unless ``autorun=False``)."""
        if when.tzinfo is None:
            raise InvalidSchedule(f"advance_to needs an aware datetime, not the naive {when.isoformat()}")
        while (event := self.clock.pop_due(when)) is not None:
            self.now = max(self.now, event.due)
            request = event.request
            seq = next(self._seq)
            if request.request_id not in self._seen:
                self._seen.add(request.request_id)
                self._pending.setdefault((request.queue, request.key), collections.deque()).append(
                    _Pending(request, seq))
                if self.autorun:
                    await self._drain_key((request.queue, request.key))
        self.now = max(self.now, when.astimezone(dt.UTC))

    async def _drain_key(self, queue_key: tuple[str, str]) -> None:
        if queue_key in self._running:
            return  # the run in progress picks it up when it is done
        self._running.add(queue_key)
        try:
            queue, key = queue_key
            processor = RecordingTaskProcessor(self.app, queue, key, self.app.queue_tasks(queue), runs=self._runs,
                                               clock=lambda: self.now.timestamp(), sleep=self._rate_wait)
            pending = self._pending.get(queue_key)
            while pending:
                take = max(1, processor.batch_size)
                batch = list(itertools.islice(pending, take))
                try:
                    await self._process(processor, batch)
                finally:
                    for _ in batch:
                        pending.popleft()
        finally:
            self._running.discard(queue_key)

    async def _run_now(self, queue_key: tuple[str, str], request_id: str) -> None:
        """Run one pending unkeyed request now, beside the run that called it (as a worker's lane would)."""
        pending = self._pending.get(queue_key, collections.deque())
        item = next((p for p in pending if p.request.request_id == request_id), None)
        if item is None:
            return  # already run (or cancelled)
        pending.remove(item)
        queue, key = queue_key
        processor = RecordingTaskProcessor(self.app, queue, key, self.app.queue_tasks(queue), runs=self._runs,
                                           clock=lambda: self.now.timestamp(), sleep=self._rate_wait)
        await self._process(processor, [item])

    async def _process(self, processor: TaskProcessor, batch: list[_Pending]) -> None:
        queue, key = processor.queue, processor.key
        subject = f"kq.{queue}.in.{key}"
        requests = [Request(key, p.seq, subject, dict(p.request.headers), p.request.body) for p in batch]
        head = requests[0]
        policy = processor.retry_policy(head) or RetryPolicy()
        attempt = 0
        while True:
            attempt += 1
            ctx = _EagerContext(self, queue, key, head.request_id, attempt)
            try:
                if processor.batch_size > 0:
                    replies = await processor.handle_batch(ctx, requests)
                else:
                    replies = [await processor.handle(ctx, head)]
            except (WireError, Reject) as exc:
                self._dead_letter(batch, exc, attempt, "rejected")
                return
            except Exception as exc:
                if not policy.retries(exc):
                    self._dead_letter(batch, exc, attempt, "not-retried")
                    return
                if policy.exhausted(attempt):
                    self._dead_letter(batch, exc, attempt, "max-attempts")
                    return
                continue
            for pending_item, request, reply in zip(batch, requests, replies, strict=False):
                if isinstance(reply, BaseException):  # the processor rejected this request alone
                    self._dead_letter([pending_item], reply, attempt, "rejected")
                    continue
                headers = {H.STATUS: H.STATUS_OK, H.REQUEST_ID: request.request_id, **(reply.headers if reply else {})}
                self._replies[request.request_id] = self._kept[request.request_id] = (
                    headers, reply.data if reply else b"")
                self.succeeded.append(request.request_id)
            return

    def _dead_letter(self, batch: list[_Pending], error: BaseException, attempts: int, reason: str) -> None:
        for pending in batch:
            request = pending.request
            self.dead_letters.append(EagerDeadLetter(request.queue, request.key, request.request_id,
                                                     request.message_type, reason, error, attempts))
            self._replies[request.request_id] = self._kept[request.request_id] = ({
                H.STATUS: H.STATUS_DEAD_LETTERED, H.REQUEST_ID: request.request_id,
                H.ERROR_TYPE: type(error).__name__, H.ERROR_MESSAGE: H.header_safe(str(error)), H.DLQ_REASON: reason,
            }, b"")
        if self.propagate:
            raise error


@contextlib.contextmanager
def eager(app: App | None = None, *, propagate: bool = True, autorun: bool = True) -> Iterator[EagerRunner]:
    """Run ``app``'s tasks (default: the default app's) in this process while the block lasts."""
    app = app if app is not None else default_app()
    runner = EagerRunner(app, propagate=propagate, autorun=autorun)
    previous = app.set_transport(runner)
    try:
        yield runner
    finally:
        app.set_transport(previous)
