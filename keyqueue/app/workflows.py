"""Workflows from the app's side: starting one, and reading, waiting for and cancelling it by its id.

``App.start_workflow`` (what ``canvas.enqueue()`` calls) stores the plan in the workflows stream
of the queue of its first step (``keyqueue.jetstream.workflows``), by compare-and-set on an empty
subject, then enqueues the first steps under their derived request ids, then records where they
were stored. Each step after that is enqueued by the worker that finished what comes before it
(``keyqueue.builtins.workflows``). Once ``enqueue`` has returned, nothing of the workflow depends on
its producer: it may die. An ``enqueue`` that failed part-way can be repeated with the same
``workflow_id``: the plan is found stored and the first steps are stored once (their ids repeat).

:class:`WorkflowView` is a workflow as a reader sees it (``keyqueue workflow show``, the dashboard,
``App.status``): every step with its task, key, state, times, and for a step that will not run, why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from keyqueue.errors import (
    ConfigError,
    KeyqueueError,
    KeyqueueTimeout,
    PayloadTooLarge,
    WorkflowCancelled,
    WorkflowFailed,
    WrongLastSequence,
)
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.subjects import validate_queue_name
from keyqueue.jetstream.workflows import WorkflowStore, decode_record, find_workflow_queue
from keyqueue.tasks.canvas import (
    Target,
    WorkflowPlan,
    WorkflowReceipt,
    decode_shape,
    revive,
    step_request_id,
    validate_workflow_id,
)
from keyqueue.wire import CBOR, dumps, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.app.application import App
    from keyqueue.jetstream.records import RequestRecords
    from keyqueue.tasks.task import Receipt, Task, TaskRequest

__all__ = [
    "END_STATES",
    "StepRef",
    "StepView",
    "WorkflowView",
    "cancel_workflow",
    "enqueue_steps",
    "locate_workflow",
    "mark_resumed",
    "read_workflow",
    "start_workflow",
    "step_headers",
    "step_of",
    "workflow_result",
    "workflow_status",
]

END_STATES: Final = ("done", "failed", "cancelled")
"""What a workflow's ``end`` record says when its result (or why there is none) is known."""

log = logging.getLogger("keyqueue.workflow")

StatusOf = Callable[["StepView"], Awaitable[str]]
"""Asks where a step's request is (``App.status``'s answer for its id, seq and key)."""

_LIVE_LOOKUPS: Final = 8
"""Enqueued steps ``status`` asks the workers about, to tell ``running`` from ``pending``."""


class StepRef(NamedTuple):
    """Which step of which workflow a request is, from its headers."""

    queue: str
    """Where the workflow's records are."""
    workflow_id: str
    step: int


def step_of(headers: Mapping[str, str]) -> StepRef | None:
    """The step a request is, or None when it is not one. Headers that say so but cannot be
    (they become subjects) are logged and ignored: nothing read from the wire is published to
    before it is checked."""
    workflow_id = headers.get(H.WORKFLOW_ID)
    if workflow_id is None:
        return None
    try:
        return StepRef(validate_queue_name(headers.get(H.WORKFLOW_QUEUE, "")), validate_workflow_id(workflow_id),
                       int(headers.get(H.WORKFLOW_STEP, "")))
    except (KeyqueueError, ValueError) as exc:
        log.warning("request %s names workflow %r with headers that cannot be one (%s): handled as a lone request",
                    headers.get(H.MSG_ID, "?")[:64], workflow_id[:64], exc)
        return None


def step_headers(plan: WorkflowPlan, step: int) -> dict[str, str]:
    """The headers that make a request step ``step`` of ``plan``."""
    return {H.WORKFLOW_ID: plan.workflow_id, H.WORKFLOW_STEP: str(step), H.WORKFLOW_QUEUE: plan.queue}


def step_queue(plan: WorkflowPlan, step: int, task: Task[Any] | None) -> str | None:
    """The queue step ``step`` runs in (its ``set(queue=...)``, else its task's), if known."""
    own = plan.steps[step].queue
    return own or (task.queue if task is not None else None)


def build_step(plan: WorkflowPlan, step: int, task: Task[Any], first: tuple[Any, ...] = ()) -> TaskRequest:
    """The request of step ``step``: its stored arguments, with ``first`` in front unless it is
    immutable. ``TypeError`` / ``MalformedBody`` / ``InvalidKey`` if they do not fit the task."""
    spec = plan.steps[step]
    args, kwargs = revive(task, (*(() if spec.immutable else first), *spec.args), spec.kwargs)
    return task.step_request(args, kwargs, request_id=step_request_id(plan.workflow_id, step),
                             headers=step_headers(plan, step), queue=spec.queue, countdown=spec.countdown,
                             expires=spec.expires)


async def enqueue_steps(app: App, requests: Sequence[TaskRequest]) -> list[Receipt]:
    """Store step requests, each queue's in one pipelined publish, in the order given within a queue."""
    by_queue: dict[str, list[TaskRequest]] = {}
    for request in requests:
        by_queue.setdefault(request.queue, []).append(request)
    receipts: dict[str, Receipt] = {}
    for batch in by_queue.values():
        for receipt in await app.publish(batch):
            receipts[receipt.request_id] = receipt
    return [receipts[r.request_id] for r in requests]


async def store_of(app: App, queue: str) -> WorkflowStore:
    """The workflows stream of ``queue`` on the app's connection (``ConfigError`` in the eager mode)."""
    from keyqueue.app.transport import NatsTransport

    transport = app.transport()
    if not isinstance(transport, NatsTransport):
        raise ConfigError("workflows keep their state on the NATS server: the eager test mode runs single tasks "
                          "(test a workflow's tasks one by one there, or the workflow against a dev-server)")
    return await transport.workflows(queue)


async def start_workflow(app: App, plan: WorkflowPlan, tasks: Mapping[str, Task[Any]]) -> WorkflowReceipt:
    """Store ``plan`` and enqueue its first steps (see the module docstring)."""
    store = await store_of(app, plan.queue)
    body = dumps(plan.to_record(), CBOR)
    limit = store.nc.max_payload
    if len(body) > limit - 1024:
        raise PayloadTooLarge(len(body), limit, 1024)
    subject = store.subject(plan.workflow_id, "plan")
    duplicate = False
    try:
        await store.put(subject, body, expected_last=0)
    except WrongLastSequence:
        stored = await store.last(subject)
        if stored is None or stored.data != body:
            raise ConfigError(f"workflow id {plan.workflow_id} names another workflow already; give this one "
                              "an id of its own") from None
        duplicate = True
    requests = [build_step(plan, n, tasks[plan.steps[n].task]) for n in plan.entries]
    receipts = await enqueue_steps(app, requests)
    where = {str(n): [r.queue, r.key, r.seq] for n, r in zip(plan.entries, receipts, strict=True)}
    try:
        await store.put_record(store.subject(plan.workflow_id, "start"), {"steps": where, "at": time.time()})
    except KeyqueueError as exc:  # only the view of where the first steps wait is missing: the workflow runs
        log.warning("workflow %s started, but where its first steps were stored was not recorded: %s",
                             plan.workflow_id, exc)
    if not duplicate:
        await app.plugins.lifecycle.workflow_changed(app=app, queue=plan.queue, workflow_id=plan.workflow_id,
                                                     change="started")
    return WorkflowReceipt(plan.workflow_id, plan.queue, tuple(receipts), duplicate, source=app)


async def locate_workflow(app: App, workflow_id: str, queue: str | None = None) -> WorkflowStore | None:
    """The workflows stream holding ``workflow_id``: in ``queue`` if given, else wherever it is; None if none."""
    from keyqueue.app.transport import NatsTransport

    transport = app.transport()
    if not isinstance(transport, NatsTransport):
        return None
    if queue is None:
        queue = await find_workflow_queue(JetStreamApi(await app.connection()), workflow_id)
        if queue is None:
            return None
    store = await transport.workflows(queue, create=False)
    if store is None or await store.last(store.subject(workflow_id, "plan")) is None:
        return None
    return store


async def mark_resumed(store: WorkflowStore, workflow_id: str, step: int) -> bool:
    """Turn the workflow's end from ``failed`` at ``step`` back to ``running`` (its dead-letter replay
    was stored, or succeeded); False if the end said something else."""
    subject = store.subject(workflow_id, "end")
    for _ in range(10):
        stored = await store.last(subject)
        end = decode_record(stored)
        if stored is None or end is None or end.get("state") != "failed" or end.get("step") != step:
            return False
        try:
            await store.put_record(subject, {"state": "running", "at": time.time(), "resumed": step},
                                   expected_last=stored.seq)
            return True
        except WrongLastSequence:
            continue
    return False


# --- reading a workflow ---------------------------------------------------------------------------


@dataclass
class StepView:
    """One step as a reader sees it."""

    step: int
    task: str
    role: str
    """``step``, ``link`` (a callback beside the flow) or ``errback``."""
    state: str
    """``waiting`` (what comes before it has not finished), ``pending`` (enqueued, not finished:
    waiting for its key or running), ``running`` (where the workers were asked), ``done``, ``failed``,
    ``cancelled``, ``not-run`` (it will not run: see ``reason``)."""
    request_id: str
    queue: str | None = None
    key: str | None = None
    seq: int | None = None
    reason: str | None = None
    attempt: int | None = None
    started: float | None = None
    finished: float | None = None
    error_type: str | None = None
    message: str | None = None


@dataclass
class WorkflowView:
    """A workflow as its records say it is."""

    workflow_id: str
    queue: str
    plan: WorkflowPlan
    state: str
    """``pending``, ``running``, ``done``, ``failed`` or ``cancelled``."""
    steps: list[StepView]
    end: dict[str, Any] | None = None
    stopped_at: int | None = None
    """The step it stopped at (failed), if it did."""
    started: float | None = None
    finished: float | None = None
    records: dict[str, StoredMsg] = field(default_factory=dict, repr=False)

    @property
    def counts(self) -> dict[str, int]:
        """How many steps are in each state."""
        found: dict[str, int] = {}
        for step in self.steps:
            found[step.state] = found.get(step.state, 0) + 1
        return found

    def fields(self) -> dict[str, Any]:
        """The view as plain values (``keyqueue workflow show --json``, the dashboard's JSON)."""
        return {
            "workflow_id": self.workflow_id, "queue": self.queue, "state": self.state, "stopped_at": self.stopped_at,
            "started": self.started, "finished": self.finished, "counts": self.counts,
            "steps": [dataclasses.asdict(step) for step in self.steps],
        }


async def read_workflow(store: WorkflowStore, workflow_id: str) -> WorkflowView | None:
    """The workflow's view from its records (one paged read), or None if it has no plan stored."""
    records = await store.records(workflow_id)
    plan_record = decode_record(records.get("plan"))
    if plan_record is None:
        return None
    return view_of(store.queue, WorkflowPlan.from_record(plan_record), records)


def view_of(queue: str, plan: WorkflowPlan, records: Mapping[str, StoredMsg]) -> WorkflowView:
    """What ``read_workflow`` builds from the records it read."""
    wf = plan.workflow_id
    own = {n: r for n in range(len(plan.steps)) if (r := decode_record(records.get(f"step.{n}"))) is not None}
    end = decode_record(records.get("end"))
    start = decode_record(records.get("start")) or {}
    where: dict[int, list[Any]] = {int(n): w for n, w in (start.get("steps") or {}).items()}
    handed = [*own.values(), *(decode_record(r) or {} for s, r in records.items() if s.startswith("join."))]
    for record in handed:
        where.update((int(n), w) for n, w in (record.get("next") or {}).items())
    sources = plan.sources()
    cancelled = end is not None and end.get("state") == "cancelled"
    why: dict[Target, str | None] = {}

    def blocked(target: Target) -> str | None:
        """Why what delivers to ``target`` never will (None: it did, or still may)."""
        if target in why:
            return why[target]
        why[target] = None  # no cycles in a plan; guards against a damaged one
        source = sources.get(target, ("start",))
        reason: str | None = None
        if source[0] == "step":
            reason = step_blocked(source[1])
        elif source[0] == "error":
            record = own.get(source[1])
            if record is not None and record.get("state") == "done":
                reason = f"not needed: step {source[1]} succeeded"
            elif record is None:
                reason = step_blocked(source[1])
        elif source[0] == "join":
            size = plan.joins[source[1]].size
            reason = next((r for i in range(size) if (r := blocked(("join", source[1], i))) is not None), None)
        why[target] = reason
        return reason

    def step_blocked(n: int) -> str | None:
        record = own.get(n)
        if record is not None:
            state = record.get("state")
            if state == "failed":
                return (f"step {n} ({plan.steps[n].task}) failed: {record.get('error_type')}: "
                        f"{record.get('message')}")
            if state == "cancelled":
                return "the workflow was cancelled"
            return None
        return blocked(("step", n))

    steps: list[StepView] = []
    for n, spec in enumerate(plan.steps):
        step_record = own.get(n)
        placed = where.get(n)
        view = StepView(n, spec.task, spec.role, "waiting", step_request_id(wf, n), queue=spec.queue)
        if placed is not None:
            view.queue, view.key, view.seq = placed[0], placed[1], int(placed[2])
        if step_record is not None:
            view.state = str(step_record.get("state"))
            view.request_id = str(step_record.get("request_id") or view.request_id)
            view.queue, view.key = step_record.get("queue") or view.queue, step_record.get("key") or view.key
            view.attempt, view.started = step_record.get("attempt"), step_record.get("started")
            view.finished, view.reason = step_record.get("finished"), step_record.get("reason")
            view.error_type, view.message = step_record.get("error_type"), step_record.get("message")
        elif placed is not None:
            view.state = "cancelled" if cancelled else "pending"
            if cancelled:
                view.reason = "cancelled before it started (its key's holder skips it)"
        else:
            reason = blocked(("step", n))
            if reason is not None:
                view.state, view.reason = "not-run", reason
            elif cancelled:
                view.state, view.reason = "not-run", "the workflow was cancelled"
        steps.append(view)
    failed = [s for s in steps if s.state == "failed"]
    end_state = end.get("state") if end is not None else None
    if end_state in ("done", "cancelled"):
        state = str(end_state)
    elif failed:
        state = "failed"
    elif own or any(s.state == "pending" and s.step not in plan.entries for s in steps):
        state = "running"
    else:
        state = "pending"
    stopped = end.get("step") if end is not None and end_state == "failed" else (failed[0].step if failed else None)
    started = start.get("at")
    finished = end.get("at") if end is not None and end_state in END_STATES else None
    return WorkflowView(wf, queue, plan, state, steps, end, stopped, started, finished, dict(records))


async def workflow_status(view: WorkflowView, status_of: StatusOf) -> str:
    """``pending``, ``running``, ``done``, ``failed`` or ``cancelled``: ``running`` once a step has
    finished, or a live worker runs one of its first steps (``status_of`` asks, as ``App.status`` does)."""
    if view.state != "pending":
        return view.state
    pending = [s for s in view.steps if s.state == "pending" and s.queue is not None][:_LIVE_LOOKUPS]
    answers = await asyncio.gather(*(status_of(s) for s in pending), return_exceptions=True)
    return "running" if "running" in answers else "pending"


async def workflow_result(store: WorkflowStore, workflow_id: str, timeout: float,
                          result_type: Callable[[str], type | None] = lambda task: None) -> Any:
    """The workflow's result, waiting up to ``timeout`` seconds (see ``Canvas.call`` for what it raises);
    ``result_type(task name)``: the dataclass a task returns, to make its result whole again."""
    plan_record = decode_record(await store.last(store.subject(workflow_id, "plan")))
    if plan_record is None:
        raise KeyqueueTimeout(f"no workflow {workflow_id} in queue {store.queue!r}")
    plan = WorkflowPlan.from_record(plan_record)

    def final(stored: StoredMsg) -> bool:
        record = decode_record(stored)
        return record is not None and record.get("state") in END_STATES

    stored = await store.wait(store.subject(workflow_id, "end"), timeout, final)
    record = decode_record(stored) if stored is not None else None
    if record is None:
        raise KeyqueueTimeout(f"workflow {workflow_id} did not finish within {timeout}s; it is stored and goes on "
                              f"(keyqueue workflow show {workflow_id})")
    state = record.get("state")
    if state == "cancelled":
        raise WorkflowCancelled(workflow_id)
    if state == "failed":
        step = int(record.get("step", -1))
        raise WorkflowFailed(workflow_id, step, str(record.get("task", "")), str(record.get("error_type", "")),
                             str(record.get("message", "")), str(record.get("request_id", "")),
                             str(record.get("reason", "")))
    value = loads(record["value"], CBOR) if record.get("value") is not None else None
    return decode_shape(plan.shape, value, lambda n: result_type(plan.steps[n].task))


async def cancel_workflow(store: WorkflowStore, workflow_id: str,
                          records_of: Callable[[str], Awaitable[RequestRecords]]) -> tuple[str, int]:
    """Cancel every step that has not started: ``(state, steps cancelled)``; state ``cancelled``,
    ``done`` (it had finished: nothing to cancel) or ``unknown``. A step running now is not
    interrupted; what would follow it does not run. ``records_of(queue)``: that queue's records."""
    for _ in range(10):
        view = await read_workflow(store, workflow_id)
        if view is None:
            return "unknown", 0
        end = view.records.get("end")
        if view.state in ("done", "cancelled"):
            return view.state, 0
        try:
            await store.put_record(store.subject(workflow_id, "end"), {"state": "cancelled", "at": time.time()},
                                   expected_last=end.seq if end is not None else 0)
        except WrongLastSequence:
            continue  # a step changed it meanwhile: read again
        break
    else:
        raise KeyqueueError(f"the end record of workflow {workflow_id} kept changing while it was being cancelled")
    open_steps = [s for s in view.steps if s.state not in ("done", "failed", "cancelled") and s.queue is not None]
    by_queue: dict[str, list[StepView]] = {}
    for step in open_steps:
        assert step.queue is not None
        by_queue.setdefault(step.queue, []).append(step)
    for queue, steps in by_queue.items():
        records = await records_of(queue)
        # Every step not finished: those enqueued are skipped by their key's holder, and so are
        # those a step running now enqueues before it sees the workflow cancelled (a worker that
        # sees it hands nothing on).
        await asyncio.gather(*(records.request_cancel(s.request_id) for s in steps))
    return "cancelled", len(open_steps)
