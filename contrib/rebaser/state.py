"""What is stored per change set, and its transitions: apply a request, plan a DVU, commit a DVU.

Everything the Rebaser needs to carry on after a crash is in :class:`ChangeSetState`, written
as one value per change set (CBOR) with revision-checked writes. In particular a DVU is *owed*
exactly when the state says so (pending roots, or callers waiting for a DVU), never because of
something held in memory: a new holder reads the state and runs the DVU a dead one owed.

The transitions are pure functions of the state, which makes the tricky one testable alone: a
DVU computes from a snapshot while requests keep changing the graph, and its commit must keep
every change applied meanwhile (see :meth:`ChangeSetState.commit_dvu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Final

import cbor2

from keyqueue import WireError
from keyqueue.wire import CBOR, from_fields, loads_map

from .errors import UnreadableSnapshot
from .functions import FunctionRegistry
from .graph import Node, Recomputed, UpdateError, apply_updates
from .messages import (
    STATUS_ERROR,
    STATUS_SUCCESS,
    EnqueueUpdatesRequest,
    EnqueueUpdatesResponse,
)

__all__ = ["FORMAT", "ChangeSetState", "DvuPlan", "DvuRun", "Waiter", "decode_state", "encode_state"]

FORMAT: Final = 1
"""Version of the stored state's layout."""

HISTORY: Final = 16
"""DVU runs kept in the state's history."""

EVENT_SESSIONS: Final = 32
"""Event session ids kept per pending DVU."""


@dataclass(frozen=True)
class DvuRun:
    """One committed DVU run."""

    run: int
    """1 for the change set's first run, then 2, 3, ..."""
    covered: int
    """Values are current through this change number after the run."""
    triggers: int
    """Applied requests with dependent-value roots that this run absorbed."""
    roots: int
    recomputed: int
    """Computed nodes the run recomputed."""
    errors: list[str]
    started: float
    """Wall-clock (Unix) time the run took its snapshot."""
    finished: float
    fencing: tuple[int, int]
    worker: str
    event_sessions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Waiter:
    """A caller waiting for the DVU that covers its request (the ``X-Rebaser-Await-Dvu`` header)."""

    inbox: str
    request_id: str
    change: int
    updates_performed: int


@dataclass(frozen=True)
class DvuPlan:
    """What a DVU run computes from: the graph and roots as of change ``covered``."""

    nodes: dict[str, Node]
    roots: set[str]
    covered: int
    triggers: int
    triggers_total: int
    event_sessions: list[str]


@dataclass(frozen=True)
class ChangeSetState:
    """A change set's snapshot (its graph) and the bookkeeping around it."""

    format: int = FORMAT
    nodes: dict[str, Node] = field(default_factory=dict)
    roots: dict[str, int] = field(default_factory=dict)
    """Dependent-value roots: nodes changed since the last DVU, each with the change that last marked it."""
    change: int = 0
    """Change number of the last applied request (requests applied so far)."""
    applied_seq: int = 0
    """Inbox sequence of the last applied request: a re-run of it (after a crash) is not applied twice."""
    last_request_id: str = ""
    last_response: EnqueueUpdatesResponse | None = None
    triggers: int = 0
    """Applied requests that left dependent-value roots (each one signals the DVU)."""
    dvu_runs: int = 0
    dvu_covered: int = 0
    dvu_triggers_covered: int = 0
    dvu_history: list[DvuRun] = field(default_factory=list)
    waiters: list[Waiter] = field(default_factory=list)
    pending_event_sessions: list[str] = field(default_factory=list)
    rebased_from: str | None = None
    """``from_change_set_id`` of the last request that named one (v2+)."""
    fencing: tuple[int, int] = (0, 0)
    """Fencing token of the holder that wrote this state."""

    @property
    def dvu_owed(self) -> bool:
        """A DVU must run: values are behind the graph, or a caller waits for one."""
        return bool(self.roots) or bool(self.waiters)

    def values(self) -> dict[str, Any]:
        return {name: node.value for name, node in sorted(self.nodes.items())}

    # --- requests --------------------------------------------------------------------------------

    def apply(self, request: EnqueueUpdatesRequest, *, seq: int, request_id: str, functions: FunctionRegistry,
              fencing: tuple[int, int], await_dvu_inbox: str | None = None
              ) -> tuple[ChangeSetState | None, EnqueueUpdatesResponse]:
        """Apply a request stored at inbox ``seq``: the new state (None if nothing changed) and the response."""
        if seq <= self.applied_seq:
            # The previous holder stored the change but died before deleting the request.
            if request_id == self.last_request_id and self.last_response is not None:
                return None, self.last_response
            return None, EnqueueUpdatesResponse(STATUS_SUCCESS, message=f"already applied (inbox seq {seq})")
        change = self.change + 1
        try:
            nodes, roots = apply_updates(self.nodes, request.updates, change, functions)
        except UpdateError as e:
            return None, EnqueueUpdatesResponse(STATUS_ERROR, message=str(e))
        marked = {name: mark for name, mark in self.roots.items() if name in nodes}
        marked.update(dict.fromkeys(roots, change))
        waiters = self.waiters
        if await_dvu_inbox and roots:
            waiters = [*waiters, Waiter(await_dvu_inbox, request_id, change, len(request.updates))]
        sessions = self.pending_event_sessions
        if request.event_session_id and roots and request.event_session_id not in sessions:
            sessions = [*sessions, request.event_session_id][-EVENT_SESSIONS:]
        response = EnqueueUpdatesResponse(STATUS_SUCCESS, updates_performed=len(request.updates), change=change,
                                          dvu_owed=bool(roots))
        state = replace(
            self,
            nodes=nodes,
            roots=marked,
            change=change,
            applied_seq=seq,
            last_request_id=request_id,
            last_response=response,
            triggers=self.triggers + (1 if roots else 0),
            waiters=waiters,
            pending_event_sessions=sessions,
            rebased_from=request.from_change_set_id or self.rebased_from,
            fencing=fencing,
        )
        return state, response

    # --- DVU -------------------------------------------------------------------------------------

    def plan_dvu(self) -> DvuPlan:
        """The snapshot a DVU computes from (the state's graph is never changed in place, so no copy)."""
        return DvuPlan(self.nodes, set(self.roots), self.change, self.triggers - self.dvu_triggers_covered,
                       self.triggers, list(self.pending_event_sessions))

    def commit_dvu(self, plan: DvuPlan, result: Recomputed, *, started: float, finished: float,
                   fencing: tuple[int, int], worker: str) -> tuple[ChangeSetState, DvuRun, list[Waiter]]:
        """Fold a DVU computed from ``plan`` into this (possibly newer) state.

        Requests applied while the DVU ran are kept: a node touched by one of them (its stamp is
        newer than the plan) keeps its state, and their roots stay pending for the next run,
        which recomputes everything downstream of them. Every other computed node the DVU reached
        takes its new value, which is exact, because all of its inputs are as the DVU saw them.
        Returns the new state, the run's record, and the waiters it satisfied.
        """
        nodes = dict(self.nodes)
        for name, (value, error) in result.values.items():
            node = nodes.get(name)
            if node is not None and node.computed and node.stamp <= plan.covered:
                nodes[name] = replace(node, value=value, error=error)
        roots = {name: mark for name, mark in self.roots.items() if mark > plan.covered and name in nodes}
        served = [w for w in self.waiters if w.change <= plan.covered]
        waiting = [w for w in self.waiters if w.change > plan.covered]
        run = DvuRun(
            run=self.dvu_runs + 1,
            covered=plan.covered,
            triggers=plan.triggers,
            roots=len(plan.roots),
            recomputed=len(result.values),
            errors=list(result.errors),
            started=started,
            finished=finished,
            fencing=fencing,
            worker=worker,
            event_sessions=list(plan.event_sessions),
        )
        state = replace(
            self,
            nodes=nodes,
            roots=roots,
            dvu_runs=run.run,
            dvu_covered=max(self.dvu_covered, plan.covered),
            dvu_triggers_covered=plan.triggers_total,
            dvu_history=[*self.dvu_history, run][-HISTORY:],
            waiters=waiting,
            pending_event_sessions=[s for s in self.pending_event_sessions if s not in plan.event_sessions],
            fencing=fencing,
        )
        return state, run, served

    def run_covering(self, change: int) -> DvuRun | None:
        """The first kept DVU run whose values include change number ``change``."""
        return next((run for run in self.dvu_history if run.covered >= change), None)


# --- the stored form ------------------------------------------------------------------------------
#
# The state is written on every request and every DVU, so its codec is on the hot path. keyqueue's
# generic dataclass codec checks every value against its annotation (milliseconds for a state with
# a history); here the layout is fixed and the values are already plain (they came in through
# decoded requests), so the state is flattened by hand and written with cbor2 directly. The result
# is exactly what ``keyqueue.wire.to_fields`` would produce (a test checks it), and reading goes
# through keyqueue's strict decoder, so a damaged or foreign value is refused, never trusted.


_FIELD_NAMES: Final[Mapping[type, tuple[str, ...]]] = MappingProxyType({
    cls: tuple(f.name for f in fields(cls)) for cls in (ChangeSetState, DvuRun, Waiter, EnqueueUpdatesResponse)
})


def _flat(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in _FIELD_NAMES[type(obj)]}


def _node(node: Node) -> dict[str, Any]:
    return {"value": node.value, "function": node.function, "inputs": node.inputs, "args": node.args,
            "stamp": node.stamp, "error": node.error}


def _plain(state: ChangeSetState) -> dict[str, Any]:
    out = _flat(state)
    out["nodes"] = {name: _node(node) for name, node in state.nodes.items()}
    out["last_response"] = None if state.last_response is None else _flat(state.last_response)
    out["dvu_history"] = [{**_flat(run), "fencing": list(run.fencing)} for run in state.dvu_history]
    out["waiters"] = [_flat(waiter) for waiter in state.waiters]
    out["fencing"] = list(state.fencing)
    return out


def encode_state(state: ChangeSetState) -> bytes:
    """The stored form: CBOR of plain values, laid out as ``keyqueue.wire.to_fields`` lays out the state."""
    return cbor2.dumps(_plain(state))


def decode_state(data: bytes) -> ChangeSetState:
    """Read a stored state; :class:`UnreadableSnapshot` if it is not one this Rebaser can read."""
    try:
        stored = loads_map(data, CBOR)
    except WireError as e:
        raise UnreadableSnapshot(f"the stored snapshot does not decode: {e}") from e
    if stored.get("format") != FORMAT:
        raise UnreadableSnapshot(
            f"the stored snapshot has format {stored.get('format')!r}; this Rebaser reads format {FORMAT}"
        )
    try:
        return from_fields(ChangeSetState, stored)
    except WireError as e:
        raise UnreadableSnapshot(f"the stored snapshot does not fit format {FORMAT}: {e}") from e
