"""Workflows: signatures and the canvas (``chain``, ``group``, ``chord``), and the plan they compile to.

::

    await (add.s(4, 4) | mul.s(8)).call(timeout=10)                       # mul(add(4, 4), 8) = 64
    await group(add.s(i, i) for i in range(10)).call()                    # [0, 2, 4, ..., 18]
    await chord((add.s(i, i) for i in range(10)), xsum.s()).call()        # xsum([0, 2, ..., 18]) = 90

A **signature** (``task.s(*args, **kwargs)``) is a task with some of its arguments: when it runs
in a workflow, the result of what came before it is put in front of its arguments, as in Celery
(``mul.s(8)`` after a step that returned 8 runs ``mul(8, 8)``). ``task.si(...)`` is immutable: it
takes nothing from before it. A **chain** runs its parts one after the other, each getting the
previous result; a **group** runs its parts side by side and its result is the list of theirs, in
order; a **chord** is a group whose list goes to a callback (``group | callback`` is the same).
They nest: a chain of groups, a chord in a chain, a group of chains. ``link(callback)`` runs a
callback with a part's result beside whatever follows it, ``link_error(errback)`` runs an
errback with a :class:`StepFailure` when a step of the part fails for good.

Every part is one request of its task, under the key its arguments give, in that key's order
beside the key's other requests. The canvas compiles (:meth:`Canvas.plan`) to a
:class:`WorkflowPlan`: numbered steps, the joins of groups, and where each one's result goes
next (:data:`Target`). The app stores the plan once, under the workflow's id, and enqueues the
first steps; the worker that finishes a step enqueues what follows (``keyqueue.builtins.workflows``).
A step's request id is derived from the workflow id and the step's number (:func:`step_request_id`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from keyqueue.errors import ConfigError, InvalidRequestId
from keyqueue.jetstream.subjects import validate_queue_name
from keyqueue.wire import CBOR, check_plain, from_fields, new_request_id, to_fields

if TYPE_CHECKING:
    from keyqueue.tasks.task import AnyTask, Dispatcher, Receipt, Task

__all__ = [
    "PLAN_VERSION",
    "Canvas",
    "Chain",
    "Chord",
    "Group",
    "PlanJoin",
    "PlanStep",
    "Signature",
    "StepFailure",
    "Target",
    "WorkflowPlan",
    "WorkflowReceipt",
    "WorkflowStarter",
    "chain",
    "chord",
    "group",
    "is_workflow_id",
    "parse_step_request_id",
    "step_request_id",
    "validate_workflow_id",
]

PLAN_VERSION: Final = 1
"""The version of the stored plan's layout."""

WORKFLOW_ID_PREFIX: Final = "wf-"
"""Every workflow id starts with this, so ``App.result`` / ``status`` / ``cancel`` tell it from a request id."""

MAX_WORKFLOW_ID_LENGTH: Final = 128

_WORKFLOW_ID: Final = re.compile(r"wf-[A-Za-z0-9-]+")
_STEP_ID: Final = re.compile(r"(wf-[A-Za-z0-9-]+)_(\d+)")
_REPLAY_SUFFIX: Final = re.compile(r"\.replay-\d+$")

Target = tuple[Any, ...]
"""Where a value goes next: ``("step", n)`` (step ``n`` runs with it in front of its arguments),
``("join", j, slot)`` (slot ``slot`` of join ``j``) or ``("end",)`` (the workflow's result)."""


def validate_workflow_id(workflow_id: str) -> str:
    """``workflow_id`` if it can name a workflow (``wf-`` then letters, digits and ``-``), else ``InvalidRequestId``."""
    if not isinstance(workflow_id, str) or not _WORKFLOW_ID.fullmatch(workflow_id) \
            or len(workflow_id) > MAX_WORKFLOW_ID_LENGTH:
        raise InvalidRequestId(
            f"workflow id {workflow_id!r} must be 'wf-' followed by letters, digits and '-', at most "
            f"{MAX_WORKFLOW_ID_LENGTH} characters (it is part of subjects, and its steps' request ids are "
            "'<workflow id>_<step>'), e.g. 'wf-order-17'")
    return workflow_id


def is_workflow_id(value: str) -> bool:
    """Whether ``value`` has the form of a workflow id (not whether one exists)."""
    return bool(_WORKFLOW_ID.fullmatch(value)) and len(value) <= MAX_WORKFLOW_ID_LENGTH


def step_request_id(workflow_id: str, step: int) -> str:
    """The request id of step ``step`` of a workflow: ``<workflow id>_<step>``; the same whoever enqueues
    it, so an enqueue repeated after a crash stores it once (JetStream's duplicate window)."""
    return f"{workflow_id}_{step}"


def parse_step_request_id(request_id: str) -> tuple[str, int] | None:
    """``(workflow id, step)`` of a step's request id (also of its dead-letter replay's), else None."""
    match = _STEP_ID.fullmatch(_REPLAY_SUFFIX.sub("", request_id))
    return (match[1], int(match[2])) if match else None


@dataclass(frozen=True)
class StepFailure:
    """What an errback (``link_error``) receives, in front of its own arguments: the step that failed."""

    workflow_id: str
    step: int
    task: str
    request_id: str
    key: str
    queue: str
    error_type: str
    message: str
    reason: str
    """``rejected``, ``not-retried``, ``max-attempts``, ``crash-loop`` or ``expired``."""


# --- the plan ------------------------------------------------------------------------------------


@dataclass
class PlanStep:
    """One step: a task with its stored arguments, and where its result goes."""

    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    immutable: bool = False
    queue: str | None = None
    """The queue it runs in: its task's, or another (``set(queue=...)``)."""
    countdown: float | None = None
    expires: float | None = None
    then: list[Target] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)
    """The steps (errbacks) that run with a :class:`StepFailure` if this one fails for good."""
    role: str = "step"
    """``step``, ``link`` (a callback beside the flow) or ``errback``: a link's or an errback's result
    is not part of the workflow's."""


@dataclass
class PlanJoin:
    """The join of a group: ``size`` slots; once all hold a value their list goes to ``then``."""

    size: int
    then: list[Target] = field(default_factory=list)


@dataclass
class WorkflowPlan:
    """A compiled canvas: what the app stores once under the workflow id (see the module docstring)."""

    workflow_id: str
    steps: list[PlanStep]
    joins: list[PlanJoin]
    entries: list[int]
    """The steps enqueued when the workflow starts."""
    shape: Any
    """The result's shape, to decode it: ``["step", n]``, ``["list", [shapes]]``."""
    queue: str = ""
    """Where the workflow's records live: the queue of its first step."""

    def to_record(self) -> dict[str, Any]:
        """The plan as plain values (stored as CBOR)."""
        return {
            "v": PLAN_VERSION, "id": self.workflow_id, "queue": self.queue, "entries": self.entries,
            "shape": self.shape, "joins": [{"size": j.size, "then": [list(t) for t in j.then]} for j in self.joins],
            "steps": [{"task": s.task, "args": s.args, "kwargs": s.kwargs, "immutable": s.immutable,
                       "queue": s.queue, "countdown": s.countdown, "expires": s.expires,
                       "then": [list(t) for t in s.then], "errors": s.errors, "role": s.role} for s in self.steps],
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> WorkflowPlan:
        """A plan read back (``ConfigError`` for a layout this version does not know)."""
        if record.get("v") != PLAN_VERSION:
            raise ConfigError(f"workflow plan of version {record.get('v')!r}; this keyqueue reads version "
                              f"{PLAN_VERSION}: upgrade keyqueue")
        steps = [PlanStep(s["task"], list(s["args"]), dict(s["kwargs"]), bool(s["immutable"]), s.get("queue"),
                          s.get("countdown"), s.get("expires"), [tuple(t) for t in s["then"]], list(s["errors"]),
                          s.get("role", "step")) for s in record["steps"]]
        joins = [PlanJoin(int(j["size"]), [tuple(t) for t in j["then"]]) for j in record["joins"]]
        return cls(str(record["id"]), steps, joins, [int(e) for e in record["entries"]], record["shape"],
                   str(record.get("queue", "")))

    # --- reading it ---

    def sources(self) -> dict[Target, Target]:
        """What delivers to each step and each join slot: ``("start",)``, ``("step", n)``,
        ``("error", n)`` (an errback of step ``n``) or ``("join", j)``."""
        found: dict[Target, Target] = {("step", n): ("start",) for n in self.entries}
        for n, step in enumerate(self.steps):
            for target in step.then:
                found[_slot_of(target)] = ("step", n)
            for e in step.errors:
                found[("step", e)] = ("error", n)
        for j, join in enumerate(self.joins):
            for target in join.then:
                found[_slot_of(target)] = ("join", j)
        return found


def _slot_of(target: Target) -> Target:
    return ("step", target[1]) if target[0] == "step" else tuple(target)


# --- the canvas ----------------------------------------------------------------------------------


class WorkflowStarter(Protocol):
    """What a canvas starts through: its tasks' app (``keyqueue.App`` implements this)."""

    async def start_workflow(self, plan: WorkflowPlan, tasks: Mapping[str, Task[Any]]) -> WorkflowReceipt:
        """Store ``plan`` and enqueue its first steps (``tasks``: the plan's tasks by name)."""


@dataclass(frozen=True)
class WorkflowReceipt:
    """A started workflow: its id, where its records are, and its first steps as stored."""

    workflow_id: str
    queue: str
    """The queue whose ``KQ_<queue>_WORKFLOWS`` stream holds its records (its first step's queue)."""
    steps: tuple[Receipt, ...]
    """The receipts of its first steps."""
    duplicate: bool
    """True if a workflow with this id had been started already: nothing new was started."""
    source: Any = field(default=None, repr=False, compare=False)
    """The app that started it (``result``, ``status``, ``cancel``)."""

    def _app(self) -> Any:
        if self.source is None:
            raise ConfigError("this receipt was not returned by an app; use App.result / App.status / App.cancel")
        return self.source

    async def result(self, timeout: float = 30.0) -> Any:
        """The workflow's result, waiting up to ``timeout`` seconds (``App.result`` with its id)."""
        return await self._app().result(self.workflow_id, queue=self.queue, timeout=timeout)

    async def status(self) -> str:
        """``pending``, ``running``, ``done``, ``failed`` or ``cancelled`` (``App.status`` with its id)."""
        result: str = await self._app().status(self.workflow_id, queue=self.queue)
        return result

    async def cancel(self) -> str:
        """Cancel every step that has not started (``App.cancel`` with its id)."""
        result: str = await self._app().cancel(self.workflow_id, queue=self.queue)
        return result

    def result_sync(self, timeout: float = 30.0) -> Any:
        """``result`` for code without a running event loop."""
        return self._app().result_sync(self.workflow_id, queue=self.queue, timeout=timeout)

    def status_sync(self) -> str:
        """``status`` for code without a running event loop."""
        result: str = self._app().status_sync(self.workflow_id, queue=self.queue)
        return result

    def cancel_sync(self) -> str:
        """``cancel`` for code without a running event loop."""
        result: str = self._app().cancel_sync(self.workflow_id, queue=self.queue)
        return result


class Canvas:
    """A part of a workflow: a :class:`Signature`, :class:`Chain`, :class:`Group` or :class:`Chord`.

    ``|`` chains parts; ``link`` / ``link_error`` add callbacks; ``enqueue`` / ``call`` / ``delay``
    / ``call_sync`` start it as a workflow, with arguments put in front of its first steps' own
    (``(add.s(4) | mul.s(8)).call(16)`` is ``mul(add(16, 4), 8)``).
    """

    def __init__(self) -> None:
        self.links: list[Canvas] = []
        self.errbacks: list[Canvas] = []

    def __or__(self, other: Canvas) -> Chain:
        if not isinstance(other, Canvas):
            return NotImplemented
        return Chain(self, other)

    def link(self, callback: Canvas) -> Canvas:
        """Also run ``callback`` with this part's result (beside what follows it); returns this part.

        (Celery's ``link`` returns the callback; this returns the part, so calls chain.)
        """
        self.links.append(_canvas(callback, "link"))
        return self

    def link_error(self, errback: Canvas) -> Canvas:
        """Run ``errback`` with a :class:`StepFailure` in front of its arguments for each step of this
        part that fails for good (after its retries, dead-lettered); returns this part."""
        self.errbacks.append(_canvas(errback, "link_error"))
        return self

    # --- what it is made of ---

    def signatures(self) -> Iterable[Signature]:
        """Every signature in this part, links and errbacks included."""
        yield from self._own_signatures()
        for extra in (*self.links, *self.errbacks):
            yield from extra.signatures()

    def _own_signatures(self) -> Iterable[Signature]:
        raise NotImplementedError

    def _starter(self) -> Dispatcher:
        first = next(iter(self.signatures()), None)
        if first is None:
            raise ConfigError("an empty workflow has nothing to run")
        return first.task.app

    # --- compiling ---

    def plan(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
             workflow_id: str | None = None) -> WorkflowPlan:
        """Compile into a :class:`WorkflowPlan`, checking every step's arguments as far as they are
        known (``TypeError``, ``MalformedBody``); ``args`` / ``kwargs`` go in front of (into) the first
        steps' own, which must then fit their task's signature."""
        workflow_id = validate_workflow_id(workflow_id) if workflow_id is not None else (
            WORKFLOW_ID_PREFIX + new_request_id())
        compiler = _Compiler()
        entries, shape = compiler.compile_all(self, _Targets(extra=[("end",)]))
        plan = compiler.finish(workflow_id, entries, shape)
        for n, sig in enumerate(compiler.signatures):
            if n not in entries:
                _check_partial(sig, n)
        for n in entries:
            step, sig = plan.steps[n], compiler.signatures[n]
            if not step.immutable:
                step.args = [*(_plain(a, sig, n) for a in args), *step.args]
                step.kwargs = {**step.kwargs, **{k: _plain(v, sig, n) for k, v in (kwargs or {}).items()}}
            sig.task.fields_for(*revive(sig.task, step.args, step.kwargs))  # TypeError now, before anything is stored
        plan.queue = plan.steps[0].queue or compiler.signatures[0].task.queue
        return plan

    def step_tasks(self) -> dict[str, Task[Any]]:
        """The tasks of this part's steps, by name (``ConfigError`` if two differ under one name)."""
        found: dict[str, Task[Any]] = {}
        for sig in self.signatures():
            other = found.setdefault(sig.task.name, sig.task)
            if other is not sig.task:
                raise ConfigError(f"two different tasks are named {sig.task.name!r} in one workflow")
        return found

    # --- starting it ---

    async def enqueue(self, *args: Any, workflow_id: str | None = None, **kwargs: Any) -> WorkflowReceipt:
        """Start the workflow: store its plan and enqueue its first steps; returns once they are stored.

        ``workflow_id``: ``wf-`` then letters, digits and ``-`` (default: ``wf-`` and a ULID); the same
        id again starts nothing new (``duplicate``), so an enqueue that failed part-way can be repeated.
        """
        plan = self.plan(args, kwargs, workflow_id)
        starter: WorkflowStarter = self._starter()  # type: ignore[assignment]
        return await starter.start_workflow(plan, self.step_tasks())

    async def call(self, *args: Any, timeout: float = 30.0, workflow_id: str | None = None, **kwargs: Any) -> Any:
        """``enqueue``, then wait up to ``timeout`` seconds for the workflow's result.

        A step that failed for good raises ``WorkflowFailed`` (a ``DeadLettered``) naming it; a
        cancelled workflow ``WorkflowCancelled``; ``KeyqueueTimeout`` if it did not finish in time
        (it is stored and goes on).
        """
        receipt = await self.enqueue(*args, workflow_id=workflow_id, **kwargs)
        return await receipt.result(timeout)

    def delay(self, *args: Any, workflow_id: str | None = None, **kwargs: Any) -> WorkflowReceipt:
        """``enqueue`` for code without a running event loop."""
        starter = self._starter()
        return starter.run_sync(lambda: self.enqueue(*args, workflow_id=workflow_id, **kwargs),
                                what="starting a workflow")

    def call_sync(self, *args: Any, timeout: float = 30.0, workflow_id: str | None = None, **kwargs: Any) -> Any:
        """``call`` for code without a running event loop."""
        starter = self._starter()
        from keyqueue.tasks.task import SYNC_BOUND

        return starter.run_sync(lambda: self.call(*args, timeout=timeout, workflow_id=workflow_id, **kwargs),
                                bound=timeout + SYNC_BOUND, what="a workflow's call_sync()")


class Signature(Canvas):
    """A task with some of its arguments (``task.s(...)``; ``task.si(...)``: immutable)."""

    def __init__(self, task: AnyTask, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                 immutable: bool = False, queue: str | None = None, countdown: float | None = None,
                 expires: float | None = None) -> None:
        super().__init__()
        from keyqueue.tasks.task import Task

        if not isinstance(task, Task) or task.spec.policy != "serial":
            policy = task.spec.policy if hasattr(task, "spec") else "?"
            raise ConfigError(f"task {getattr(task, 'name', task)!r} (policy {policy!r}) cannot be a workflow step: "
                              "a step is one request and its result, so its task must have policy 'serial'")
        self.task: Task[Any] = task
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.immutable = immutable
        self.options: dict[str, Any] = {}
        self.set(queue=queue, countdown=countdown, expires=expires)

    def __repr__(self) -> str:
        shown = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.task.name}.{'si' if self.immutable else 's'}({', '.join(shown)})"

    def set(self, *, queue: str | None = None, countdown: float | None = None,
            expires: float | None = None) -> Signature:
        """Options of this step: another ``queue`` than its task's; ``countdown`` (seconds after the
        step before it is enqueued); ``expires`` (seconds after it is enqueued; it is then dropped
        and the workflow stops). Returns this signature."""
        if queue is not None:
            validate_queue_name(queue)
            self.options["queue"] = queue
        for name, value in (("countdown", countdown), ("expires", expires)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{self.task.name}: {name} must be a number of seconds > 0, not {value!r}")
            self.options[name] = float(value)
        return self

    def clone(self, *args: Any, **kwargs: Any) -> Signature:
        """A copy with ``args`` put in front of its arguments and ``kwargs`` merged into them (Celery's partial)."""
        copy = Signature(self.task, (*args, *self.args), {**self.kwargs, **kwargs}, immutable=self.immutable)
        copy.options = dict(self.options)
        copy.links, copy.errbacks = list(self.links), list(self.errbacks)
        return copy

    def _own_signatures(self) -> Iterable[Signature]:
        yield self


class Chain(Canvas):
    """Parts run one after the other, each with the previous one's result in front of its arguments."""

    def __init__(self, *tasks: Canvas | Iterable[Canvas]) -> None:
        super().__init__()
        flat: list[Canvas] = []
        for task in _listed(tasks, "chain"):
            # A plain chain inside a chain is the same chain: flattened, as Celery does.
            if isinstance(task, Chain) and not task.links and not task.errbacks:
                flat.extend(task.tasks)
            else:
                flat.append(task)
        if not flat:
            raise ConfigError("chain() needs at least one part")
        self.tasks: tuple[Canvas, ...] = tuple(flat)

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.tasks)

    def _own_signatures(self) -> Iterable[Signature]:
        for task in self.tasks:
            yield from task.signatures()


class Group(Canvas):
    """Parts run side by side; the result is the list of their results, in the group's order."""

    def __init__(self, *tasks: Canvas | Iterable[Canvas]) -> None:
        super().__init__()
        self.tasks: tuple[Canvas, ...] = tuple(_listed(tasks, "group"))
        if not self.tasks:
            raise ConfigError("group() needs at least one part (an empty group has no result to wait for)")

    def __repr__(self) -> str:
        return f"group({', '.join(repr(t) for t in self.tasks)})"

    def _own_signatures(self) -> Iterable[Signature]:
        for task in self.tasks:
            yield from task.signatures()


class Chord(Canvas):
    """A group whose list of results goes to ``body`` once every part is done; the result is the body's."""

    def __init__(self, header: Group | Iterable[Canvas], body: Canvas) -> None:
        super().__init__()
        self.header = header if isinstance(header, Group) else Group(*header)
        self.body = _canvas(body, "chord's body")

    def __repr__(self) -> str:
        return f"chord({self.header!r}, {self.body!r})"

    def _own_signatures(self) -> Iterable[Signature]:
        yield from self.header.signatures()
        yield from self.body.signatures()


def chain(*tasks: Canvas | Iterable[Canvas]) -> Chain:
    """Parts run one after the other: ``chain(add.s(4, 4), mul.s(8))`` (also ``add.s(4, 4) | mul.s(8)``)."""
    return Chain(*tasks)


def group(*tasks: Canvas | Iterable[Canvas]) -> Group:
    """Parts run side by side: ``group(add.s(i, i) for i in range(10))`` (or ``group(a.s(), b.s())``)."""
    return Group(*tasks)


def chord(header: Group | Iterable[Canvas], body: Canvas) -> Chord:
    """A group whose results' list goes to ``body``: ``chord((add.s(i, i) for i in range(10)), xsum.s())``."""
    return Chord(header, body)


def _canvas(value: Any, what: str) -> Canvas:
    if not isinstance(value, Canvas):
        raise ConfigError(f"{what} takes a signature (task.s(...)) or a chain, group or chord, not {value!r}")
    return value


def _listed(tasks: tuple[Canvas | Iterable[Canvas], ...], what: str) -> list[Canvas]:
    """The parts given as arguments (``group(a, b)``) or as one iterable (``group(gen)``, ``group([a, b])``)."""
    if len(tasks) == 1 and not isinstance(tasks[0], Canvas):
        tasks = tuple(tasks[0])
    return [_canvas(t, f"{what}()") for t in tasks]


# --- compiling -----------------------------------------------------------------------------------


class _Targets:
    """Where a part's result goes: targets of its own, and (by reference) those of what contains it,
    which may still be filled in (a chain links a part to the next once the next is compiled)."""

    def __init__(self, parent: _Targets | None = None, extra: list[Target] | None = None) -> None:
        self.items: list[Target] = []
        self.parent = parent
        self.extra: list[Target] = list(extra or [])

    def resolve(self) -> list[Target]:
        return [*self.items, *(self.parent.resolve() if self.parent is not None else []), *self.extra]


class _Compiler:
    """Numbers the steps in the order they appear and records where each result goes."""

    def __init__(self) -> None:
        self.steps: list[tuple[PlanStep, _Targets]] = []
        self.signatures: list[Signature] = []
        self.joins: list[tuple[PlanJoin, _Targets]] = []
        self.later: list[Callable[[], None]] = []
        """Links and errbacks, compiled once the flow is (:meth:`compile_all`)."""

    def compile(self, part: Canvas, targets: _Targets, errbacks: tuple[Canvas, ...],
                role: str = "step") -> tuple[list[int], Any]:
        """Add ``part``'s steps; its result goes to ``targets``. Returns its first steps and the
        shape of its result (see ``WorkflowPlan.shape``)."""
        own = _Targets(parent=targets)
        errbacks = (*errbacks, *part.errbacks)
        entries, shape = self._compile(part, own, errbacks, role)
        for link in part.links:
            self.later.append(functools.partial(self._link, own, link))
        return entries, shape

    def _link(self, targets: _Targets, link: Canvas) -> None:
        targets.extra.extend(("step", n) for n in self.compile(link, _Targets(), (), "link")[0])

    def _errback(self, step: PlanStep, errback: Canvas) -> None:
        step.errors.extend(self.compile(errback, _Targets(), (), "errback")[0])

    def compile_all(self, part: Canvas, targets: _Targets) -> tuple[list[int], Any]:
        """``compile`` the whole canvas: its flow first, then the links and errbacks, so that the
        flow's steps are numbered in the order they appear and the callbacks after them."""
        found = self.compile(part, targets, ())
        while self.later:
            self.later.pop(0)()
        return found

    def _compile(self, part: Canvas, targets: _Targets, errbacks: tuple[Canvas, ...],
                 role: str) -> tuple[list[int], Any]:
        if isinstance(part, Signature):
            n = len(self.steps)
            args = [_plain(a, part, n) for a in part.args]
            kwargs = {k: _plain(v, part, n) for k, v in part.kwargs.items()}
            step = PlanStep(part.task.name, args, kwargs, immutable=part.immutable,
                            queue=part.options.get("queue") or part.task.queue, countdown=part.options.get("countdown"),
                            expires=part.options.get("expires"), role=role)
            self.steps.append((step, targets))
            self.signatures.append(part)
            for errback in errbacks:
                self.later.append(functools.partial(self._errback, step, errback))
            return [n], ["step", n]
        if isinstance(part, Chain):
            entries: list[int] = []
            shape: Any = None
            previous: _Targets | None = None
            for index, task in enumerate(part.tasks):
                here = targets if index == len(part.tasks) - 1 else _Targets()
                first, shape = self.compile(task, here, errbacks, role)
                if previous is not None:
                    previous.items.extend(("step", n) for n in first)
                previous = here
                entries = entries or first
            return entries, shape
        if isinstance(part, Group):
            j = len(self.joins)
            self.joins.append((PlanJoin(len(part.tasks)), targets))
            found: list[int] = []
            shapes = []
            for slot, task in enumerate(part.tasks):
                first, shape = self.compile(task, _Targets(extra=[("join", j, slot)]), errbacks, role)
                found.extend(first)
                shapes.append(shape)
            return found, ["list", shapes]
        if isinstance(part, Chord):
            return self._compile(Chain(part.header, part.body), targets, errbacks, role)
        raise ConfigError(f"not a workflow part: {part!r}")

    def finish(self, workflow_id: str, entries: list[int], shape: Any) -> WorkflowPlan:
        steps = []
        for step, targets in self.steps:
            step.then = targets.resolve()
            steps.append(step)
        joins = []
        for join, targets in self.joins:
            join.then = targets.resolve()
            joins.append(join)
        return WorkflowPlan(workflow_id, steps, joins, entries, shape)


def _check_partial(sig: Signature, step: int) -> None:
    """``TypeError`` if a later step's arguments cannot fit its task: a mutable step's first parameter
    is left for the value that comes before it."""
    codec = sig.task.codec
    hole = () if sig.immutable else (_HOLE,)
    try:
        bound = codec.signature.bind_partial(*hole, *sig.args, **sig.kwargs)
    except TypeError as exc:
        before = "" if sig.immutable else " (its first parameter takes the result before it)"
        raise TypeError(f"workflow step {step}: {sig.task.name}(){before}: {exc}") from None
    codec.types.check({name: value for name, value in bound.arguments.items() if value is not _HOLE})


def _plain(value: Any, sig: Signature, step: int) -> Any:
    plain = to_fields(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value
    check_plain(plain, CBOR, path=f"workflow step {step}: {sig.task.name}: argument")
    return plain


class _Hole:
    """The place of a step's first argument, filled by the result before it."""

    def __repr__(self) -> str:
        return "<the result before it>"


_HOLE: Final = _Hole()


def revive(task: Task[Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Stored (plain) arguments made whole again: a map for a dataclass parameter becomes the
    dataclass, so key templates over its fields work as they do for a direct enqueue."""
    codec = task.codec
    if not codec.dataclass_params:
        return tuple(args), dict(kwargs)
    try:
        bound = codec.signature.bind_partial(*args, **kwargs)
    except TypeError:
        return tuple(args), dict(kwargs)  # fields_for raises the clear error
    for name, value in list(bound.arguments.items()):
        cls = codec.dataclass_params.get(name)
        if cls is not None and isinstance(value, dict):
            bound.arguments[name] = from_fields(cls, value)
    return tuple(bound.args), dict(bound.kwargs)


def decode_shape(shape: Any, value: Any, result_type: Callable[[int], type | None]) -> Any:
    """A stored result (plain) as the workflow's result: a step's dataclass result made whole again,
    a group's list decoded part by part."""
    if not isinstance(shape, list) or not shape:
        return value
    if shape[0] == "step":
        cls = result_type(int(shape[1]))
        return from_fields(cls, value) if cls is not None and isinstance(value, dict) else value
    if shape[0] == "list" and isinstance(value, list) and len(value) == len(shape[1]):
        return [decode_shape(s, v, result_type) for s, v in zip(shape[1], value, strict=True)]
    return value

