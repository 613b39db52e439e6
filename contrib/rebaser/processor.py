"""The Rebaser's key processor: one change set's requests in order, its DVU beside them.

For each key session (one change set, held exclusively):

- ``open`` loads the change set's state and starts its :class:`SerialDvuTask`; if the stored
  state owes a DVU (a previous holder died or shut down before finishing it), it runs now.
- ``handle`` decodes an ``EnqueueUpdatesRequest`` (any supported version, upgraded), applies its
  updates all or nothing, stores the new state (revision-checked), signals the DVU task when the
  request left dependent-value roots, and returns the ``EnqueueUpdatesResponse`` the core sends
  to the caller. A request the graph refuses (unknown node, cycle, ...) gets an error response;
  it is not retried, since it would fail the same way.
- ``idle`` (the key has no more requests) waits until no DVU is owed, so the key is released
  only once its values are current.
- ``close`` stops the DVU task.

Stored-state writes and DVU commits take one lock, so the two never race within the holder;
across holders the KV revision check and the fencing token keep a stale holder out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from keyqueue import BaseProcessor, LeaseLost, Reject, Reply, Request, RequestContext, RetryPolicy, SessionContext
from keyqueue.wire import decode, encode, peek
from keyqueue.wire import headers as wire_headers

from .dvu import SerialDvuTask
from .errors import SnapshotConflict
from .events import DVU_FINISHED, DVU_STARTED
from .functions import FunctionRegistry
from .graph import recompute
from .messages import (
    AWAIT_DVU,
    REGISTRY,
    STATUS_SUCCESS,
    EnqueueUpdatesRequest,
    EnqueueUpdatesResponse,
)
from .state import ChangeSetState, DvuRun, Waiter
from .store import SnapshotStore

__all__ = ["Observer", "RebaserProcessor", "RebaserSettings", "SendReply"]

log = logging.getLogger("keyqueue.rebaser")

Observer = Callable[[str, dict[str, Any]], None]
"""``observer(event, fields)`` for ``applied``, ``refused``, ``dvu_owed``, ``dvu_started``, ``dvu_finished``,
``dvu_retry`` (each with the change set's ``key`` and the wall-clock time ``t``)."""

SendReply = Callable[[str, Mapping[str, str], bytes], Awaitable[None]]
"""Publishes a message to a caller's inbox (the DVU's follow-up responses)."""

PublishEvent = Callable[[str, str, dict[str, Any]], Awaitable[None]]
"""``publish(event, key, fields)``: a ``dvu_started`` / ``dvu_finished`` event to keyqueue's events stream
(:mod:`.events`)."""


@dataclass(frozen=True)
class RebaserSettings:
    """How the Rebaser's processors behave; one value per worker."""

    queue: str = "rebaser"
    bucket: str = "rebaser_snapshots"
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=5, base_delay=0.2, max_delay=5.0))
    """Retries of a request that failed for a passing reason (a store conflict, NATS trouble): capped, backed off."""
    write_attempts: int = 4
    """Tries of one snapshot write that conflicts with a stale holder's write, before the request is retried."""
    dvu_max_failures: int = 5
    dvu_base_delay: float = 0.1
    worker: str = ""
    """This worker's name, recorded in each DVU run."""


class RebaserProcessor(BaseProcessor):
    """Serves one change set for one key session."""

    def __init__(self, store: SnapshotStore, functions: FunctionRegistry, send_reply: SendReply, *,
                 settings: RebaserSettings | None = None, observer: Observer | None = None,
                 publish_event: PublishEvent | None = None) -> None:
        self.store = store
        self.functions = functions
        self.send_reply = send_reply
        self.settings = settings or RebaserSettings()
        self.observer = observer
        self.publish_event = publish_event
        self.state = ChangeSetState()
        self.revision = 0
        self.lock = asyncio.Lock()
        self._ctx: SessionContext | None = None
        self._dvu: SerialDvuTask | None = None

    # --- the session -----------------------------------------------------------------------------

    async def open(self, ctx: SessionContext) -> None:
        self._ctx = ctx
        self.state, self.revision = await self.store.load(ctx.key)
        if self.state.fencing > ctx.fencing:
            # Either this holder is already stale, or the queue's token stream was recreated (its
            # sequences restart). Refusing would strand the change set in the second case; the
            # revision check on every write keeps a stale holder out in the first.
            log.warning("change set %s: stored by fencing token %s, newer than this holder's %s (was the token "
                        "stream recreated?)", ctx.key, self.state.fencing, ctx.fencing)
            ctx.check_lease()
        self._dvu = SerialDvuTask(ctx.key, owed=lambda: self.state.dvu_owed, run=self._run_dvu,
                                  lease_valid=ctx.lease_valid, max_failures=self.settings.dvu_max_failures,
                                  base_delay=self.settings.dvu_base_delay)
        self._dvu.start()
        if self.state.dvu_owed:
            # A previous holder applied requests but did not finish their DVU: it is owed now.
            self._emit("dvu_owed", roots=len(self.state.roots), waiters=len(self.state.waiters),
                       covered=self.state.dvu_covered, change=self.state.change)
            log.info("change set %s: a DVU is owed from the stored state (%d roots, %d waiting callers)",
                     ctx.key, len(self.state.roots), len(self.state.waiters))
            self._dvu.signal()

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        message = decode(request.headers, request.data, REGISTRY)
        if not isinstance(message, EnqueueUpdatesRequest):
            raise Reject(f"the rebaser queue takes EnqueueUpdatesRequest messages, not {message.TYPE}")
        if message.key != ctx.key:
            raise Reject(f"request for change set {message.key} was stored under key {ctx.key}")
        await_dvu = request.reply_inbox if request.headers.get(AWAIT_DVU, "").lower() == "true" else None
        response = await self._apply(ctx, request, message, await_dvu)
        content_type = peek(request.headers).content_type
        encoded = encode(response, content_type=content_type, request_id=request.request_id or None)
        return Reply(encoded.body, encoded.headers)

    async def idle(self, ctx: SessionContext) -> None:
        if self._dvu is not None:
            await self._dvu.wait_idle()

    async def close(self, ctx: SessionContext, reason: str) -> None:
        if self._dvu is not None:
            await self._dvu.stop()

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        return self.settings.retry

    # --- requests --------------------------------------------------------------------------------

    async def _apply(self, ctx: RequestContext, request: Request, message: EnqueueUpdatesRequest,
                     await_dvu: str | None) -> EnqueueUpdatesResponse:
        async with self.lock:
            for attempt in range(1, self.settings.write_attempts + 1):
                ctx.check_lease()
                state, response = self.state.apply(message, seq=request.seq, request_id=request.request_id,
                                                   functions=self.functions, fencing=ctx.fencing,
                                                   await_dvu_inbox=await_dvu)
                if state is None:
                    break
                try:
                    self.revision = await self.store.save(ctx.key, state, expected_revision=self.revision)
                except SnapshotConflict as e:
                    await self._reload(ctx, e)
                    if attempt == self.settings.write_attempts:
                        raise
                    continue
                self.state = state
                break
        if response.status == STATUS_SUCCESS and state is not None:
            self._emit("applied", seq=request.seq, request_id=request.request_id, change=response.change,
                       updates=response.updates_performed, roots=len(self.state.roots))
            if self.state.dvu_owed and self._dvu is not None:
                self._dvu.signal()
        elif response.status != STATUS_SUCCESS:
            self._emit("refused", seq=request.seq, request_id=request.request_id, message=response.message)
            log.warning("change set %s: request %s refused: %s", ctx.key, request.request_id, response.message)
        return response

    async def _reload(self, ctx: SessionContext, conflict: SnapshotConflict) -> None:
        """After a lost write: take the stored state, or stop if a newer holder wrote it."""
        self.state, self.revision = await self.store.load(ctx.key)
        if self.state.fencing > ctx.fencing:
            raise LeaseLost(f"{conflict}; the snapshot now carries the newer holder's fencing token "
                            f"{self.state.fencing}, so this holder stops") from conflict
        log.warning("%s; reloaded revision %d (written by fencing token %s)", conflict, self.revision,
                    self.state.fencing)

    # --- the DVU ---------------------------------------------------------------------------------

    async def _run_dvu(self) -> None:
        """One DVU run: compute from a snapshot of the state, then commit it (revision-checked)."""
        ctx = self._ctx
        assert ctx is not None
        ctx.check_lease()
        plan = self.state.plan_dvu()
        number = self.state.dvu_runs + 1
        started = time.time()
        self._emit("dvu_started", run=number, roots=len(plan.roots), triggers=plan.triggers, covered=plan.covered)
        await self._event(DVU_STARTED, ctx.key, ts=started, run_id=f"{ctx.key}#{number}",
                          worker=self.settings.worker or None)
        # Functions are user code and may be slow: compute in a thread so keepalives keep flowing.
        result = await asyncio.to_thread(recompute, plan.nodes, plan.roots, self.functions)
        async with self.lock:
            ctx.check_lease()
            state, run, served = self.state.commit_dvu(plan, result, started=started, finished=time.time(),
                                                       fencing=ctx.fencing, worker=self.settings.worker)
            try:
                self.revision = await self.store.save(ctx.key, state, expected_revision=self.revision)
            except SnapshotConflict as e:
                await self._reload(ctx, e)
                self._emit("dvu_retry", run=number, error=str(e))
                raise
            self.state = state
        for error in run.errors:
            log.warning("change set %s: DVU run %d: %s", ctx.key, run.run, error)
        self._emit("dvu_finished", run=run.run, covered=run.covered, triggers=run.triggers, roots=run.roots,
                   recomputed=run.recomputed, errors=len(run.errors), elapsed=round(run.finished - run.started, 4),
                   waiters=len(served))
        await self._event(DVU_FINISHED, ctx.key, ts=run.finished, run=run.finished - run.started,
                          triggers=run.triggers, run_id=f"{ctx.key}#{run.run}", worker=run.worker or None)
        for waiter in served:
            await self._notify(waiter, run)

    async def _event(self, name: str, key: str, **fields: Any) -> None:
        """Best effort, like every keyqueue event: a failure is logged, never raised."""
        if self.publish_event is None:
            return
        try:
            await self.publish_event(name, key, fields)
        except Exception as e:
            log.debug("change set %s: %s event not published: %r", key, name, e)

    async def _notify(self, waiter: Waiter, run: DvuRun) -> None:
        """Tell a caller that a DVU covering its request finished (at most once per run; losing it is logged)."""
        response = EnqueueUpdatesResponse(STATUS_SUCCESS, updates_performed=waiter.updates_performed,
                                          change=waiter.change, dvu_owed=False, dvu_run=run.run,
                                          dvu_errors=list(run.errors))
        encoded = encode(response, request_id=waiter.request_id)
        try:
            await self.send_reply(waiter.inbox, {**encoded.headers, wire_headers.STATUS: wire_headers.STATUS_OK,
                                                 wire_headers.REQUEST_ID: waiter.request_id}, encoded.body)
        except Exception as e:
            log.warning("could not tell request %s that DVU run %d covered it: %r", waiter.request_id, run.run, e)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.observer is None:
            return
        key = self._ctx.key if self._ctx is not None else ""
        try:
            self.observer(event, {"key": key, "t": time.time(), **fields})
        except Exception:
            log.exception("rebaser observer failed on %s", event)

