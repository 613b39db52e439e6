"""The built-in plugin that carries workflows on: the worker that finishes a step enqueues what follows.

A step of a workflow is a request with the headers ``X-KQ-Workflow-Id``, ``-Step`` and ``-Queue``
(``keyqueue.app.workflows``). When the default processor has its outcome, and before the key
session removes it from its inbox, ``keyqueue_request_settled`` fires here, and this plugin:

- **done**: reads the step's record first: one recorded ``done`` has handed its result on already
  (a holder ran it and died before its request left the inbox, or a duplicate of it ran) and does
  nothing more. Otherwise it hands the result on to where the plan sends it, then records the
  step ``done`` with where the steps it enqueued were stored. Handing on:

  - a **step** is enqueued with the result in front of its arguments, under its derived request
    id (``<workflow id>_<step>``): an enqueue repeated after a crash stores nothing new within the
    inbox's duplicate window;
  - a **join slot** (a part of a group) is written to its own subject, then the join's slots are
    counted; the worker that counts them all reads them, hands the list on, and records the join
    handed on (compare-and-set). A part that ran twice wrote one subject twice, counted once; two
    workers that both count the last slot hand the list on under the same request ids, stored
    once; a handed-on record stops any later one;
  - the **end** is written with the workflow's result.

  A workflow cancelled meanwhile wrote a cancel record for each of its open steps: the steps
  handed on to are skipped by their keys' holders, and nothing follows them.
- **dead-lettered** (after its retries, or rejected): records the step ``failed`` and why,
  enqueues its errbacks (``link_error``) with a ``StepFailure``, and marks the end ``failed`` (unless
  it is done or cancelled). Every step after it is left unenqueued; a reader sees why
  (``keyqueue.app.workflows.WorkflowView``). A replay of the step from the dead-letter queue that
  succeeds hands its result on as above, and turns the end back to ``running``.
- **cancelled** / **expired** (it did not run): recorded; nothing after it runs.

A step dead-lettered by its session without an attempt (``crash-loop``) reaches
``keyqueue_request_dead_lettered`` instead, off the session's path; its record is written there.

Everything here is keyqueue's own I/O around a run, retried within the lease (``ctx.steady``):
no attempt is charged for it. A step whose successor cannot be enqueued at all (its arguments do
not fit the next task, or the next key's backlog is full) is recorded as that successor's failure:
the workflow stops there, saying why.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from keyqueue.app.workflows import StepRef, build_step, mark_resumed, step_of, step_queue, store_of
from keyqueue.errors import (
    ConfigError,
    EnqueueError,
    KeyqueueError,
    LeaseLost,
    PartiallyEnqueued,
    TokenPublishFailed,
    WireError,
    WrongLastSequence,
)
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.workflows import decode_record, find_workflow_queue
from keyqueue.plugins.manager import hookimpl
from keyqueue.tasks.canvas import (
    StepFailure,
    Target,
    WorkflowPlan,
    parse_step_request_id,
    step_request_id,
)
from keyqueue.tasks.task import Task
from keyqueue.wire import CBOR, dumps, loads, to_fields
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.app.application import App
    from keyqueue.app.worker import Worker
    from keyqueue.core.processor import Reply, Request, RequestContext
    from keyqueue.jetstream.workflows import WorkflowStore
    from keyqueue.tasks.task import Receipt, TaskRequest, TaskSpec

__all__: list[str] = []

log = logging.getLogger("keyqueue.workflow")

T = TypeVar("T")

PLANS_KEPT: Final = 4096
"""Plans a worker keeps decoded (a plan never changes once stored), the most recently used: enough
for the steps of thousands of workflows running at once to find theirs without reading it again."""


class _Plans:
    """One app's decoded plans, by ``(queue, workflow id)``, the most recently used kept.

    A plan is read and decoded once however many of its steps want it at the same moment (the
    parts of a group start together): they all wait for the one read in flight.
    """

    def __init__(self) -> None:
        self.plans: collections.OrderedDict[tuple[str, str], WorkflowPlan] = collections.OrderedDict()
        self.loading: dict[tuple[str, str], asyncio.Future[WorkflowPlan | None]] = {}

    async def get(self, store: WorkflowStore, workflow_id: str,
                  steady: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> WorkflowPlan | None:
        key = (store.queue, workflow_id)
        plan = self.plans.get(key)
        if plan is None:
            # Shielded: one waiter's cancellation (its lease lost) must not cancel the others' read.
            plan = await steady(lambda: asyncio.shield(self._read(store, workflow_id)))
            if plan is None:
                return None
        self.plans.move_to_end(key)
        return plan

    def _read(self, store: WorkflowStore, workflow_id: str) -> asyncio.Future[WorkflowPlan | None]:
        """The read of a plan in flight, started if there is none (a failed one is started again)."""
        key = (store.queue, workflow_id)
        loading = self.loading.get(key)
        if loading is None:
            loading = self.loading[key] = asyncio.ensure_future(self._load(store, workflow_id))
            loading.add_done_callback(functools.partial(self._loaded, key))
        return loading

    async def _load(self, store: WorkflowStore, workflow_id: str) -> WorkflowPlan | None:
        record = decode_record(await store.last(store.subject(workflow_id, "plan")))
        if record is None:
            return None
        plan = self.plans[store.queue, workflow_id] = WorkflowPlan.from_record(record)
        while len(self.plans) > PLANS_KEPT:
            self.plans.popitem(last=False)
        return plan

    def _loaded(self, key: tuple[str, str], future: asyncio.Future[WorkflowPlan | None]) -> None:
        del self.loading[key]
        if not future.cancelled():
            future.exception()  # seen: each waiter got it and tries again through its own retries


_APPS: weakref.WeakKeyDictionary[Any, _Plans] = weakref.WeakKeyDictionary()


def _plans(app: App) -> _Plans:
    plans = _APPS.get(app)
    if plans is None:
        plans = _APPS[app] = _Plans()
    return plans


class _Step:
    """One settled step of one workflow, and what it hands on (see the module docstring)."""

    def __init__(self, app: App, store: WorkflowStore, plan: WorkflowPlan, step: int,
                 ctx: RequestContext | None) -> None:
        self.app = app
        self.store = store
        self.plan = plan
        self.step = step
        self.ctx = ctx
        self.wf = plan.workflow_id

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """keyqueue's own idempotent I/O, again after a transient failure while the lease holds."""
        return await (self.ctx.steady(step) if self.ctx is not None else step())

    def check_lease(self) -> None:
        if self.ctx is not None:
            self.ctx.check_lease()

    async def read(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None, int]:
        """The step's record, the end's, and the end's sequence (0: none)."""
        own, end = self.store.subject(self.wf, "step", self.step), self.store.subject(self.wf, "end")
        found = await self.steady(lambda: self.store.lasts([own, end]))
        stored_end = found.get(end)
        return decode_record(found.get(own)), decode_record(stored_end), stored_end.seq if stored_end else 0

    async def notify(self, change: str, *, step: int | None = None, key: str | None = None,
                     reason: str | None = None) -> None:
        at = self.step if step is None else step
        spec = self.plan.steps[at] if 0 <= at < len(self.plan.steps) else None
        await self.app.plugins.lifecycle.workflow_changed(
            app=self.app, queue=self.store.queue, workflow_id=self.wf, change=change, step=at,
            task=spec.task if spec is not None else None, key=key, reason=reason)

    # --- outcomes ---

    async def succeeded(self, request: Request, queue: str, key: str, value: bytes, attempt: int,
                        elapsed: float) -> None:
        # It may have run before (a holder that died after handing on, before its request left the
        # inbox), or be a dead-letter replay: what does its record say?
        own = decode_record(await self.steady(lambda: self.store.last(self.store.subject(self.wf, "step", self.step))))
        if own is not None and own.get("state") == "done":
            return  # handed on already: this is a run again, or a duplicate of the step
        if own is not None and own.get("state") == "failed":
            await self.resume(key)
        handed = await self.deliver(self.plan.steps[self.step].then, value)
        now = time.time()
        record = {"state": "done", "request_id": request.request_id, "key": key, "queue": queue,
                  "task": self.plan.steps[self.step].task, "attempt": attempt, "started": now - elapsed,
                  "finished": now, "next": handed}
        self.check_lease()
        await self.steady(lambda: self.store.put_record(self.store.subject(self.wf, "step", self.step), record))

    async def resume(self, key: str) -> None:
        """A failed step succeeded (its dead-letter replay): the end no longer says it failed there."""
        await self.steady(functools.partial(mark_resumed, self.store, self.wf, self.step))
        await self.notify("resumed", key=key)

    async def failed(self, request_id: str, queue: str, key: str, error_type: str, message: str, reason: str,
                     attempts: int) -> None:
        own, end, end_seq = await self.read()
        if own is not None and (own.get("state") == "done" or (
                own.get("state") == "failed" and own.get("request_id") == request_id)):
            return  # done (a duplicate that failed), or this very failure recorded, its errbacks enqueued
        failure = StepFailure(self.wf, self.step, self.plan.steps[self.step].task, request_id, key, queue,
                              error_type, message, reason)
        errbacks: list[Target] = [("step", e) for e in self.plan.steps[self.step].errors]
        handed = await self.deliver(errbacks, dumps(to_fields(failure), CBOR)) if errbacks else {}
        await self.record_failure(self.step, failure, handed, attempts)
        await self.mark_end_failed(failure, end, end_seq)
        await self.notify("failed", key=key, reason=f"{reason}: {error_type}: {message}")

    async def record_failure(self, step: int, failure: StepFailure, handed: Mapping[str, Any] | None = None,
                             attempts: int | None = None) -> None:
        record = {"state": "failed", "attempt": attempts or None, "request_id": failure.request_id,
                  "key": failure.key or None,
                  "queue": failure.queue or None, "task": failure.task, "error_type": failure.error_type,
                  "message": failure.message, "reason": failure.reason, "finished": time.time(),
                  "next": dict(handed or {})}
        await self.steady(lambda: self.store.put_record(self.store.subject(self.wf, "step", step), record))

    async def mark_end_failed(self, failure: StepFailure, end: dict[str, Any] | None, seq: int) -> None:
        """Say where the workflow stopped, unless its end is already done or cancelled."""
        await self.mark_end(end, seq, {
            "state": "failed", "step": failure.step, "task": failure.task, "request_id": failure.request_id,
            "error_type": failure.error_type, "message": failure.message, "reason": failure.reason,
            "at": time.time()})

    async def mark_end(self, end: dict[str, Any] | None, seq: int, record: Mapping[str, Any]) -> None:
        """Write the end ``record`` over the end read at ``seq``, unless it is done or cancelled already."""
        for _ in range(10):
            if end is not None and end.get("state") in ("done", "cancelled"):
                return
            try:
                await self.steady(functools.partial(self.store.put_record, self.store.subject(self.wf, "end"), record,
                                                    expected_last=seq))
                return
            except WrongLastSequence:
                _, end, seq = await self.read()

    async def skipped(self, request: Request, queue: str, key: str, status: str) -> None:
        """The step did not run: cancelled (the workflow was), or its ``expires`` passed."""
        if status == "expired":
            await self.failed(request.request_id, queue, key, "Expired", "its expires time passed before it started",
                              "expired", 0)
            return
        record = {"state": "cancelled", "request_id": request.request_id, "key": key, "queue": queue,
                  "task": self.plan.steps[self.step].task, "finished": time.time()}
        await self.steady(lambda: self.store.put_record(self.store.subject(self.wf, "step", self.step), record))
        # The workflow's cancel said so already; a cancel of this step's request id alone says it here.
        _, end, seq = await self.read()
        await self.mark_end(end, seq, {"state": "cancelled", "step": self.step, "at": time.time()})

    # --- handing a value on ---

    async def deliver(self, targets: Sequence[Target], value: bytes) -> dict[str, Any]:
        """Hand ``value`` (a CBOR-encoded result) to each target; where each step enqueued was stored."""
        requests: list[tuple[int, TaskRequest]] = []
        decoded: list[Any] = []
        for target in targets:
            kind = target[0]
            if kind == "step":
                n = int(target[1])
                if not decoded:
                    decoded.append(loads(value, CBOR) if value else None)
                request = await self.build(n, decoded[0])
                if request is not None:
                    requests.append((n, request))
            elif kind == "join":
                await self.join_slot(int(target[1]), int(target[2]), value)
            elif kind == "end":
                await self.finish(value)
        return await self.enqueue(requests) if requests else {}

    async def build(self, n: int, value: Any) -> TaskRequest | None:
        """Step ``n``'s request with ``value`` in front of its arguments; None (recorded as that step's
        failure) if it cannot be built."""
        spec = self.plan.steps[n]
        task = self.app.tasks.get(spec.task)
        try:
            if not isinstance(task, Task):
                raise ConfigError(f"task {spec.task!r} is not a task of app {self.app.name}, which ran step "
                                  f"{self.step}: a worker enqueues the step after its own, so its app must know both")
            return build_step(self.plan, n, task, (value,))
        except (TypeError, WireError, ConfigError) as exc:
            await self.step_not_enqueued(n, step_queue(self.plan, n, task if isinstance(task, Task) else None) or "",
                                         "", exc)
            return None

    async def step_not_enqueued(self, n: int, queue: str, key: str, error: BaseException) -> None:
        log.error("workflow %s: step %d (%s) cannot be enqueued after step %d: %s", self.wf, n,
                  self.plan.steps[n].task, self.step, error)
        failure = StepFailure(self.wf, n, self.plan.steps[n].task, step_request_id(self.wf, n), key, queue,
                              type(error).__name__, str(error), "not-enqueued")
        await self.record_failure(n, failure)
        _, end, seq = await self.read()
        await self.mark_end_failed(failure, end, seq)
        await self.notify("failed", step=n, reason=f"not-enqueued: {type(error).__name__}: {error}")

    async def enqueue(self, requests: Sequence[tuple[int, TaskRequest]]) -> dict[str, Any]:
        """Store the requests, each queue's pipelined; where each was stored, by step."""
        self.check_lease()
        by_queue: dict[str, list[tuple[int, TaskRequest]]] = {}
        for n, request in requests:
            by_queue.setdefault(request.queue, []).append((n, request))
        handed: dict[str, Any] = {}
        for queue, batch in by_queue.items():
            outcomes = await self.steady(functools.partial(self._publish, [r for _, r in batch]))
            for (n, request), outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, TokenPublishFailed):  # stored: the reconciler schedules its key
                    handed[str(n)] = [queue, request.key, outcome.seq]
                elif isinstance(outcome, BaseException):
                    await self.step_not_enqueued(n, queue, request.key, outcome)
                else:
                    handed[str(n)] = [queue, outcome.key, outcome.seq]
        return handed

    async def _publish(self, batch: list[TaskRequest]) -> Sequence[Receipt | EnqueueError]:
        try:
            return await self.app.publish(batch)
        except PartiallyEnqueued as exc:
            return list(exc.results)
        except EnqueueError as exc:
            if isinstance(exc, TimeoutError):
                raise  # may be stored: sent again (with its id) by steady
            return [exc]

    async def join_slot(self, join: int, slot: int, value: bytes) -> None:
        """Fill slot ``slot`` of join ``join``; the worker that finds every slot filled hands the list on."""
        store, wf = self.store, self.wf
        self.check_lease()
        await self.steady(lambda: store.put(store.subject(wf, "slot", join, slot), value))
        size = self.plan.joins[join].size
        filled = await self.steady(lambda: store.count(store.subject(wf, "slot", join, "*")))
        if filled < size:
            return
        flag = store.subject(wf, "join", join)
        if await self.steady(lambda: store.last(flag)) is not None:
            return  # handed on already
        slots = await self.steady(lambda: store.slots(wf, join))
        if len(slots) < size:
            return  # (a slot counted but expired: cannot happen within the records' life)
        values = dumps([loads(slots[i], CBOR) for i in range(size)], CBOR)
        handed = await self.deliver(self.plan.joins[join].then, values)
        try:
            await self.steady(lambda: store.put_record(flag, {"next": handed, "at": time.time()}, expected_last=0))
        except WrongLastSequence:
            return  # another worker counted the last slot too, and recorded it first
        await self.notify("joined", reason=f"{size} part(s) of group {join} done")

    async def finish(self, value: bytes) -> None:
        """The workflow's result."""
        self.check_lease()
        await self.steady(lambda: self.store.put_record(self.store.subject(self.wf, "end"),
                                                        {"state": "done", "value": value, "at": time.time()}))
        await self.notify("done")


async def _step_for(app: App, ref: StepRef, ctx: RequestContext | None) -> _Step | None:
    store = await store_of(app, ref.queue)

    async def plain(step: Callable[[], Awaitable[Any]]) -> Any:
        return await step()

    plan = await _plans(app).get(store, ref.workflow_id, ctx.steady if ctx is not None else plain)
    if plan is None or not 0 <= ref.step < len(plan.steps):
        log.error("request of workflow %s step %d: the workflow's plan is not in %s (expired, or the stream was "
                  "deleted): nothing follows it", ref.workflow_id, ref.step, store.stream)
        return None
    return _Step(app, store, plan, ref.step, ctx)


# --- the hooks -------------------------------------------------------------------------------------


@hookimpl(trylast=True)
def keyqueue_request_settled(app: App, queue: str, key: str, request: Request, task: TaskSpec | None,
                             status: str, reply: Reply | None, error: BaseException | None, reason: str | None,
                             elapsed: float, context: RequestContext) -> Awaitable[None] | None:
    # Every request of every task passes here: one that is no step costs a header lookup, no coroutine.
    ref = step_of(request.headers)
    if ref is None:
        return None
    return _settled(app, ref, queue, key, request, status, reply, error, reason, elapsed, context)


async def _settled(app: App, ref: StepRef, queue: str, key: str, request: Request, status: str, reply: Reply | None,
                   error: BaseException | None, reason: str | None, elapsed: float, context: RequestContext) -> None:
    try:
        step = await _step_for(app, ref, context)
        if step is None:
            return
        if status == H.STATUS_OK:
            headers = reply.headers if reply is not None else {}
            if headers.get(H.STATUS) == H.STATUS_ERROR:  # it ran, but its result cannot travel
                await step.failed(request.request_id, queue, key, headers.get(H.ERROR_TYPE, "MalformedBody"),
                                  headers.get(H.ERROR_MESSAGE, ""), "rejected", context.attempt)
            else:
                value = reply.data if reply is not None and reply.data else dumps(None, CBOR)
                await step.succeeded(request, queue, key, value, context.attempt, elapsed)
        elif status == H.STATUS_DEAD_LETTERED:
            assert error is not None
            await step.failed(request.request_id, queue, key, type(error).__name__, str(error), reason or "",
                              context.attempt)
        else:
            await step.skipped(request, queue, key, status)
    except (LeaseLost, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("workflow %s: what follows step %d (request %s) could not be handed on", ref.workflow_id,
                      ref.step, request.request_id)


@hookimpl(trylast=True)
async def keyqueue_worker_started(worker: Worker) -> None:
    """Each queue's workflows stream exists once its workers run: a producer that may not create
    streams (``keyqueue permissions producer``) can start workflows there."""
    for queue in worker.queues:
        try:
            await store_of(worker.app, queue)
        except KeyqueueError as exc:
            log.warning("queue %s: workflows cannot start there until its stream KQ_%s_WORKFLOWS exists: %s",
                        queue, queue, exc)


@hookimpl(trylast=True)
async def keyqueue_request_dead_lettered(worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                                         reason: str, attempts: int, error: str) -> None:
    # The processor saw every other dead letter (keyqueue_request_settled); a crash loop it never saw.
    if reason != "crash-loop":
        return
    parsed = parse_step_request_id(request_id)
    if parsed is None:
        return
    workflow_id, n = parsed
    app = worker.app
    home = await find_workflow_queue(JetStreamApi(await app.connection()), workflow_id)
    if home is None:
        return
    step = await _step_for(app, StepRef(home, workflow_id, n), None)
    if step is not None:
        error_type, _, message = error.partition(": ")
        await step.failed(request_id, queue, key, error_type, message, reason, attempts)
