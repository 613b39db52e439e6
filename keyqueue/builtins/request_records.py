"""The default processor with per-request records: cancelled requests skipped, results kept.

``RecordingTaskProcessor`` is the ``TaskProcessor`` a worker builds for a queue of tasks. Around
each request it

- checks, just before the request starts, whether it was cancelled (``keyqueue.app.cancel``): a
  cancelled request never runs; its reply says ``Cancelled`` (status ``superseded`` by
  :data:`~keyqueue.tasks.arguments.CANCELLED_BY`, so the key session removes it like any superseded
  request, in order, by the key's holder), the cancel record is answered ``cancelled`` and a
  ``cancelled`` event is published;
- exposes a cancel asked while it runs as ``ctx.cancel_requested``;
- keeps the reply (the result, or the final error) in the queue's records stream for the task's
  ``result_ttl`` (or the app's), before the session removes the request, so a result is kept
  whenever the request is done;
- keeps each run's last progress (``ctx.progress``) under its request ids, coalesced to about one
  write a second and written last when the run ends (``keyqueue.app.progress``);
- holds a rate-limited task's request (``rate_limit=``) until the key's window has room, keeping
  the key (and the lease, which the session renews meanwhile) so the key's later requests stay
  behind it in order, and records the run's start where the key's next holder reads it
  (``kq.Q.runs.<task>.<key>``, written by compare-and-set). Other keys run on meanwhile.

Only the user's code is charged an attempt: this I/O around a run (loading cancel records,
taking a rate-limit slot, answering a cancel) goes through the session's retries
(``ctx.steady``, :meth:`~keyqueue.core.processor.SessionContext.steady`), so a lost connection or a
request with no answer is tried again within the lease, and a lease that ends meanwhile ends the
session as a lost lease, never as a failed attempt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from keyqueue.app.progress import PROGRESS_TTL, ProgressKeeper
from keyqueue.app.transport import NatsTransport
from keyqueue.builtins.processor import TaskProcessor
from keyqueue.builtins.workflows import keyqueue_request_settled as workflows_settled
from keyqueue.core.processor import BatchOutcome, Reply, Request, RequestContext, SessionContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import (
    ConnectionFailed,
    Disconnected,
    KeyqueueError,
    KeyqueueTimeout,
    LeaseLost,
    Reject,
    ReplyLost,
    WireError,
    WrongLastSequence,
)
from keyqueue.events import publish_event
from keyqueue.jetstream.api import stored_seconds
from keyqueue.jetstream.connect import wait_connected
from keyqueue.tasks.arguments import CANCELLED_BY, EXPIRED_BY, result_headers
from keyqueue.tasks.context import CANCEL_CHECK, PROGRESS_KEEP
from keyqueue.tasks.task import Task
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from keyqueue.app.application import App
    from keyqueue.app.cancel import CancelWatch
    from keyqueue.app.process_pool import ProcessPool
    from keyqueue.jetstream.records import RequestRecords
    from keyqueue.tasks.task import AnyTask

__all__ = ["RecordingTaskProcessor", "RunStore"]

log = logging.getLogger("keyqueue.task")

T = TypeVar("T")

RESULT_WRITE_PATIENCE: Final = 5.0
"""Seconds a result whose write got no answer (no stream leader yet, no reply) is written again."""


class RunStore(Protocol):
    """Where the start times of a key's recent runs of a rate-limited task live (``RequestRecords``)."""

    async def get_runs(self, task: str, key: str) -> tuple[list[float], int]:
        """The start times (Unix seconds) and the record's revision (0: none)."""

    async def put_runs(self, task: str, key: str, starts: list[float], expected_last: int, ttl: float) -> int:
        """Store them over revision ``expected_last`` (``WrongLastSequence`` if it changed); the new revision."""


class RecordingTaskProcessor(TaskProcessor):
    """``TaskProcessor`` plus cancels and kept results (see the module docstring)."""

    def __init__(self, app: App, queue: str, key: str, tasks: Mapping[str, AnyTask],
                 executor: Executor | None = None, *, pool: ProcessPool | None = None, runs: RunStore | None = None,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """``runs``, ``clock`` and ``sleep`` serve rate limits (default: the queue's records, wall
        time, real sleeps; the eager test mode passes its own)."""
        super().__init__(app, queue, key, tasks, executor, pool)
        self.watch: CancelWatch | None = None
        self.records: RequestRecords | None = None
        self.runs = runs
        self.clock = clock
        self.sleep = sleep
        self._run_logs: dict[str, tuple[list[float], int]] = {}
        self._keeps = app.result_ttl is not None or any(t.spec.result_ttl for t in tasks.values())
        """Whether any request handled here may keep its result (else :meth:`_keep` has nothing to do)."""
        self._rate_limited = any(t.spec.rate_limit is not None for t in tasks.values())
        """Whether any task handled here has a rate limit (else :meth:`_take_slot` has nothing to do)."""

    async def open(self, ctx: SessionContext) -> None:
        transport = self.app.transport()
        if isinstance(transport, NatsTransport):
            watch = transport.current_cancel_watch(self.queue)
            if watch is None:  # the first key on this connection, or the first since a reconnect
                watch = await ctx.steady(functools.partial(transport.cancel_watch, self.queue))
                await ctx.steady(watch.refresh)
            self.watch = watch
            self.records = watch.records
            if self.runs is None:
                self.runs = self.records
        await super().open(ctx)

    # --- results ---

    def result_ttl(self, task: AnyTask | None) -> float | None:
        """Seconds ``task``'s results are kept (its own ``result_ttl``, else the app's), or None (0 keeps none)."""
        return task.spec.kept_for(self.app.result_ttl) if task is not None else self.app.result_ttl

    def encodes_result(self, task: AnyTask, request: Request) -> bool:
        # A workflow's step hands its result on (keyqueue.builtins.workflows).
        return (request.reply_inbox is not None or self.result_ttl(task) is not None
                or H.WORKFLOW_ID in request.headers)

    def _task_or_none(self, request: Request) -> AnyTask | None:
        try:
            return self.task_of(request)
        except WireError:
            return None

    async def _keep(self, ctx: RequestContext, requests: Sequence[Request], outcomes: Sequence[BatchOutcome]) -> None:
        if self.records is None or not self._keeps:
            return
        kept: list[tuple[str, dict[str, str], bytes, float]] = []
        for request, outcome in zip(requests, outcomes, strict=False):
            ttl = self.result_ttl(self._task_or_none(request))
            if ttl is None:
                continue
            if isinstance(outcome, BaseException):
                headers, body = self._failure(request, outcome, "rejected"), b""
            else:
                headers = {H.STATUS: H.STATUS_OK, H.REQUEST_ID: request.request_id,
                           **(outcome.headers if outcome is not None else {})}
                body = outcome.data if outcome is not None else b""
            kept.append((request.request_id, headers, body, ttl))
        if not kept:
            return
        ctx.check_lease()
        records = self.records
        hold = ctx.hold_removal
        if hold is not None:
            # Pipelined: sent now, confirmed by the session before it removes the request (with the
            # removal of those done before it), so a result is stored before its request is gone
            # and the next request does not wait for this one's write.
            for entry in kept:
                try:
                    sent = await records.send_result(*entry)
                except (ConnectionFailed, KeyqueueTimeout):
                    sent = None  # not sent: written, and retried, when the session confirms it
                hold(functools.partial(self._confirm_result, ctx, records, sent, entry))
            return
        try:
            if len(kept) == 1:
                await self._put_result(ctx, records, *kept[0])  # no task for one write: most runs answer one
            else:
                await asyncio.gather(*(self._put_result(ctx, records, *entry) for entry in kept))
        except (LeaseLost, asyncio.CancelledError):
            raise
        except Exception as exc:
            # The request ran: running it again would repeat its side effects for a record. Its
            # result is not kept (a lookup says so); the key goes on.
            log.error("request(s) %s (key %s) finished but their result could not be kept: %s",
                      ", ".join(k[0] for k in kept), self.key, exc)

    async def _confirm_result(self, ctx: RequestContext, records: RequestRecords,
                              sent: asyncio.Future[list[Msg]] | None,
                              entry: tuple[str, dict[str, str], bytes, float]) -> None:
        """Await a result sent beside the work (:meth:`_keep`); one whose reply the connection took,
        that got none, or that could not be sent is written again as :meth:`_put_result` does."""
        try:
            try:
                if sent is None:
                    raise ReplyLost("the result was not sent")
                await records.stored(sent)
            except (ConnectionFailed, KeyqueueTimeout):
                ctx.check_lease()
                await self._put_result(ctx, records, *entry)
        except (LeaseLost, asyncio.CancelledError):
            raise
        except Exception as exc:
            # As in _keep: the request ran, so it is removed all the same; its result is not kept.
            log.error("request %s (key %s) finished but its result could not be kept: %s", entry[0], self.key, exc)

    async def _put_result(self, ctx: RequestContext, records: RequestRecords, request_id: str,
                          headers: dict[str, str], body: bytes, ttl: float) -> None:
        """Keep one result. After a lost connection it is written again once connected, while the
        lease holds; a stream without a leader yet (no responders) or no answer, for a few seconds.
        Writing a result twice is harmless (a kept result is one record per request id)."""
        pause, until = 0.05, time.monotonic() + RESULT_WRITE_PATIENCE
        while True:
            try:
                await records.put_result(request_id, headers, body, ttl)
                return
            except (Disconnected, ReplyLost):
                ctx.check_lease()
                await wait_connected(records.nc, ctx.lease_remaining())
                ctx.check_lease()
            except (ConnectionFailed, KeyqueueTimeout):
                if time.monotonic() + pause > until:
                    raise
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
                ctx.check_lease()

    def _final_reason(self, ctx: RequestContext, requests: Sequence[Request], error: Exception) -> str | None:
        """Why the requests' failure is final (they are dead-lettered next), or None (retried, or a lost lease)."""
        if not requests or isinstance(error, LeaseLost):
            return None
        policy = self.retry_policy(requests[0]) or RetryPolicy()
        if isinstance(error, WireError | Reject):
            return "rejected"
        if not policy.retries(error):
            return "not-retried"
        if policy.exhausted(ctx.attempt):
            return "max-attempts"
        return None

    async def _keep_failure(self, ctx: RequestContext, requests: Sequence[Request], error: Exception) -> None:
        """Keep the error of requests whose failure is final (rejected, or their last attempt), and
        tell ``keyqueue_request_settled``."""
        reason = self._final_reason(ctx, requests, error)
        if reason is None:
            return
        if self.records is not None:
            await self._keep(ctx, requests, [_Failure(error, reason)] * len(requests))
        for request in requests:
            await self._settled(ctx, request, H.STATUS_DEAD_LETTERED, error=error, reason=reason)

    async def _settled(self, ctx: RequestContext, request: Request, status: str, *, reply: Reply | None = None,
                       error: BaseException | None = None, reason: str | None = None, elapsed: float = 0.0) -> None:
        """``keyqueue_request_settled``, awaited: the request is still in the inbox (see the hook's spec)."""
        plugins = self.app.plugins
        if not plugins.implementations("keyqueue_request_settled") or (
                H.WORKFLOW_ID not in request.headers
                and plugins.implemented_only_by("keyqueue_request_settled", workflows_settled)):
            return  # nobody to tell (the built-in workflows plugin acts on workflow steps alone)
        task = self._task_or_none(request)
        try:
            await plugins.collect("keyqueue_request_settled", app=self.app, queue=self.queue, key=self.key,
                                  request=request, task=task.spec if task is not None else None, status=status,
                                  reply=reply, error=error, reason=reason, elapsed=elapsed, context=ctx)
        except (LeaseLost, asyncio.CancelledError):
            raise
        except Exception:
            # The request ran (or was settled without running): it is removed all the same.
            log.exception("a keyqueue_request_settled hook failed for request %s (key %s)", request.request_id,
                          self.key)

    def _failure(self, request: Request, error: BaseException, reason: str) -> dict[str, str]:
        if isinstance(error, _Failure):
            reason = error.reason
            error = error.error
        task = self._task_or_none(request)
        headers = result_headers(task.name, task.spec.version) if task is not None else {}
        return {**headers, H.STATUS: H.STATUS_DEAD_LETTERED, H.REQUEST_ID: request.request_id,
                H.ERROR_TYPE: type(error).__name__, H.ERROR_MESSAGE: H.header_safe(str(error)),
                H.DLQ_REASON: reason}

    # --- progress ---

    def _progress_keeper(self, ctx: RequestContext, requests: Sequence[Request], task: AnyTask) -> ProgressKeeper:
        """What keeps the progress of a run of ``requests`` of ``task`` (built at its first value)."""
        records = self.records
        assert records is not None
        ttl = max(PROGRESS_TTL, task.spec.kept_for(self.app.result_ttl) or 0)
        ids = [r.request_id for r in requests]

        async def write(body: bytes, headers: Mapping[str, str]) -> None:
            ctx.check_lease()  # a run that lost its key writes no more
            await ctx.steady(lambda: asyncio.gather(
                *(records.put_progress(i, {**headers, H.REQUEST_ID: i}, body, ttl) for i in ids)))

        return ProgressKeeper(write, describe=f"request {ids[0]} (key {self.key})")

    async def _keeping_progress(self, ctx: RequestContext, requests: Sequence[Request],
                                run: Callable[[], Awaitable[T]]) -> T:
        """``run()`` with its ``ctx.progress`` kept: the last value is written before this returns
        (or raises), and before the run's result is kept; a run cut off writes no more. Nothing is
        kept for a task declared with ``result_ttl=0``, or without a records stream (the eager mode).

        The keeper is built at the run's first value: most runs report none, and pay nothing."""
        task = self._task_or_none(requests[0]) if requests else None
        if self.records is None or task is None or task.spec.result_ttl == 0:
            return await run()
        keeper: ProgressKeeper | None = None
        ended = False

        def offer(body: bytes, headers: Mapping[str, str]) -> None:
            nonlocal keeper
            if ended:
                return  # offered after the run ended (a thread it left behind): not kept
            if keeper is None:
                keeper = self._progress_keeper(ctx, requests, task)
            keeper.offer(body, headers)

        token = PROGRESS_KEEP.set(offer)
        flush = True
        try:
            return await run()
        except asyncio.CancelledError:
            flush = False  # cut off: its lease may be gone
            raise
        finally:
            PROGRESS_KEEP.reset(token)
            ended = True
            if keeper is not None:
                await keeper.close(flush=flush)

    # --- cancels ---

    def _skipped_reply(self, request: Request, by: str) -> Reply:
        task = self._task_or_none(request)
        headers = result_headers(task.name, task.spec.version) if task is not None else {}
        return Reply(b"", {**headers, H.STATUS: H.STATUS_SUPERSEDED, H.SUPERSEDED_BY: by})

    def _expired(self, request: Request) -> bool:
        """Whether the request's ``expires`` time (``options(expires=...)``) has passed."""
        stamp = request.headers.get(H.EXPIRES)
        if not stamp:
            return False
        deadline = stored_seconds(stamp)
        return deadline is not None and self.clock() >= deadline

    async def _skip(self, ctx: RequestContext, requests: Sequence[Request],
                    by: str = CANCELLED_BY) -> list[BatchOutcome]:
        """The replies of requests that do not run (cancelled, or expired), once answered and recorded."""
        ctx.check_lease()
        replies: list[BatchOutcome] = [self._skipped_reply(r, by) for r in requests]
        if by == CANCELLED_BY:
            assert self.watch is not None
            await asyncio.gather(*(self._answer_cancelled(ctx, self.watch, r.request_id) for r in requests))
        await self._keep(ctx, requests, replies)
        for request, reply in zip(requests, replies, strict=True):
            await self._settled(ctx, request, "cancelled" if by == CANCELLED_BY else "expired",
                                reply=reply if isinstance(reply, Reply) else None)
        event, why = (("cancelled", "cancelled before it started") if by == CANCELLED_BY else
                      ("expired", "its expires time passed before it started"))
        for request in requests:
            log.info("request %s (key %s): %s; it does not run", request.request_id, self.key, why)
            await publish_event(self.app, event, self.queue, self.key, request_id=request.request_id,
                                task=request.headers.get(H.MESSAGE_TYPE), reason=why)
        return replies

    async def _answer_cancelled(self, ctx: RequestContext, watch: CancelWatch, request_id: str) -> None:
        """Answer ``cancelled`` on the request's cancel record, through a passing outage; a refusal is
        logged (the canceller then looks for the request itself and finds it gone)."""
        try:
            await ctx.steady(functools.partial(watch.write_answer, request_id, "cancelled"))
        except LeaseLost:
            raise
        except KeyqueueError as exc:
            log.warning("could not answer the cancel of request %s (cancelled): %s", request_id, exc)

    # --- rate limits ---

    async def _take_slot(self, ctx: RequestContext, requests: Sequence[Request]) -> None:
        """Wait until the task of ``requests`` (one run) may start on this key, then record the start.

        Nothing is recorded for a run whose requests were all cancelled meanwhile.
        """
        if not self._rate_limited:
            return
        task = self._task_or_none(requests[0])
        limit = task.spec.rate_limit if task is not None else None
        if task is None or limit is None or self.runs is None:
            return
        state = self._run_logs.get(task.name)
        runs = self.runs
        if state is None:
            state = await ctx.steady(functools.partial(runs.get_runs, task.name, self.key))
        while True:
            if self.watch is not None and all(self.watch.is_cancelled(r.request_id) for r in requests):
                return  # it will not run: no wait, no slot
            starts, revision = state
            delay = limit.wait(starts, self.clock())
            if delay > 0:
                log.debug("task %s on key %s waits %.3fs for its rate limit %s", task.name, self.key, delay, limit)
                # Through the session: the key stays held, its worker slot serves another key.
                await (ctx.pause(delay) if self.sleep is asyncio.sleep else self.sleep(delay))
                continue
            now = self.clock()
            window = [*limit.window(starts, now), now][-limit.count:]
            ctx.check_lease()
            try:
                revision = await ctx.steady(functools.partial(runs.put_runs, task.name, self.key, window, revision,
                                                              limit.period + 1))
            except WrongLastSequence:
                # Another holder ran it meanwhile (or a write of ours whose reply was lost landed): read again.
                state = await ctx.steady(functools.partial(runs.get_runs, task.name, self.key))
                continue
            self._run_logs[task.name] = (window, revision)
            return

    # --- handling ---

    def _serial(self, request: Request) -> bool:
        task = self._task_or_none(request)
        return isinstance(task, Task) and task.spec.policy == "serial"

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        if self._expired(request):
            [expired] = await self._skip(ctx, [request], EXPIRED_BY)
            assert isinstance(expired, Reply)
            return expired
        serial = self._serial(request)
        if serial:  # other policies run (and count) as one batch, in handle_batch
            await self._take_slot(ctx, [request])
        watch = self.watch
        if watch is None:
            return await self._handle_keeping(ctx, request, serial)
        # Cancels written while this worker was disconnected never reached its subscription: a
        # session that outlived the outage loads them again before its next request starts.
        if watch.stale():
            await ctx.steady(watch.refresh)
        request_id = request.request_id
        flag = watch.start_run(request_id)
        if flag is None:
            [reply] = await self._skip(ctx, [request])
            assert isinstance(reply, Reply)
            return reply
        token = CANCEL_CHECK.set(flag)
        try:
            return await self._handle_keeping(ctx, request, serial)
        finally:
            CANCEL_CHECK.reset(token)
            watch.end_run(request_id)

    async def _handle_keeping(self, ctx: RequestContext, request: Request, serial: bool) -> Reply | None:
        """Handle ``request`` (``serial``: of a serial task) with its progress, outcome and result kept."""
        began = time.monotonic()
        try:
            if serial:  # other policies keep their progress in handle_batch
                reply = await self._keeping_progress(ctx, [request], functools.partial(super().handle, ctx, request))
            else:
                reply = await super().handle(ctx, request)
        except Exception as exc:
            if serial or self._task_or_none(request) is None:  # others were kept in handle_batch
                await self._keep_failure(ctx, [request], exc)
            raise
        if serial:  # other policies keep (and settle) in handle_batch
            await self._keep(ctx, [request], [reply])
            await self._settled(ctx, request, H.STATUS_OK, reply=reply, elapsed=time.monotonic() - began)
        return reply

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        if requests and not self._serial(requests[0]):
            await self._take_slot(ctx, requests)
        watch = self.watch
        if watch is None:
            return await self._batch_keeping(ctx, requests)
        if watch.stale():
            await ctx.steady(watch.refresh)
        expired = [i for i, r in enumerate(requests) if self._expired(r)]
        flags = [None if i in expired else watch.start_run(r.request_id) for i, r in enumerate(requests)]
        try:
            skipped = [i for i, flag in enumerate(flags) if flag is None and i not in expired]
            runnable = [i for i, flag in enumerate(flags) if flag is not None]
            outcomes: dict[int, BatchOutcome] = {}
            if expired:
                outcomes.update(zip(expired, await self._skip(ctx, [requests[i] for i in expired], EXPIRED_BY),
                                    strict=True))
            if skipped:
                outcomes.update(zip(skipped, await self._skip(ctx, [requests[i] for i in skipped]), strict=True))
            if runnable:
                token = CANCEL_CHECK.set(_AnyFlag([f for f in flags if f is not None]))
                try:
                    ran = await self._batch_keeping(ctx, [requests[i] for i in runnable])
                finally:
                    CANCEL_CHECK.reset(token)
                outcomes.update(zip(runnable, ran, strict=False))
        finally:
            for request in requests:
                watch.end_run(request.request_id)
        # The processor may answer only a prefix of the requests (the rest stay at the head): keep it a prefix.
        answered: list[BatchOutcome] = []
        for i in range(len(requests)):
            if i not in outcomes:
                break
            answered.append(outcomes[i])
        return answered

    async def _batch_keeping(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        began = time.monotonic()
        try:
            outcomes = await self._keeping_progress(ctx, requests,
                                                    functools.partial(super().handle_batch, ctx, requests))
        except Exception as exc:
            await self._keep_failure(ctx, requests, exc)
            raise
        await self._keep(ctx, requests[: len(outcomes)], outcomes)
        elapsed = time.monotonic() - began
        for request, outcome in zip(requests, outcomes, strict=False):
            if self._serial(request):
                continue  # a serial task mixed into a batch ran (and settled) through handle
            if isinstance(outcome, BaseException):
                await self._settled(ctx, request, H.STATUS_DEAD_LETTERED, error=outcome, reason="rejected")
            else:
                await self._settled(ctx, request, H.STATUS_OK, reply=outcome, elapsed=elapsed)
        return outcomes


class _Failure(Exception):
    """A final failure on its way to the records, with its dead-letter reason."""

    def __init__(self, error: BaseException, reason: str) -> None:
        super().__init__(str(error))
        self.error, self.reason = error, reason


class _AnyFlag:
    """``ctx.cancel_requested`` for a run answering several requests: true once any of them is cancelled."""

    def __init__(self, flags: Sequence[Any]) -> None:
        self.flags = flags

    def __call__(self) -> bool:
        return any(flag() for flag in self.flags)
