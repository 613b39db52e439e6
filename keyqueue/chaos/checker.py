"""The verdict on a chaos run: exclusivity, order, loss, duplicates, fencing and liveness, from its log.

Pure functions over a JSON-lines run log that workers and the soak append to (one object per
line, ``t`` is wall-clock ``time.time()``)::

    {"w": "w1", "kind": "start", "t": ..., "key": "k", "tag": "k-3"}    a processor run began
    {"w": "w1", "kind": "end", "t": ..., "key": "k", "tag": "k-3"}      it finished; "ok": false if it failed
    {"w": "w1", "kind": "write", "t": ..., "key": "k", "tag": "k-3", "fencing": [7, 1],
     "accepted": true, "seq": 12}                                     a fenced-store write and its outcome
    {"w": "w1", "kind": "ready", "t": ...}                            a worker process is up
    {"w": "w1", "kind": "killed", "t": ...}                           soak: w1 was SIGKILLed (and reaped)
    {"w": "w1", "kind": "exited", "t": ...}                           soak: w1's process died (any cause)
    {"w": "w1", "kind": "paused", "t": ...}                           soak: w1 was SIGSTOPped
    {"w": "w1", "kind": "resumed", "t": ...}                          soak: w1 is about to get SIGCONT
    {"w": "w1", "kind": "enter", "t": ..., "key": "k", "tag": "k-3", "pid": 41, "child": false}
                                    a sync handler's body began, in a thread (or, "child": true, a pool child)
    {"w": "w1", "kind": "leave", "t": ..., "key": "k", "tag": "k-3", "pid": 41}    ... and ended, logged by itself
    {"w": "w1", "kind": "reaped", "t": ..., "key": "k", "tag": "k-3"}   w1's pool answered or killed and joined
                                                                        the child running it
    {"w": "producer", "kind": "bad_input", "t": ..., "key": "k", "tag": "k-bad-0", "request_id": "7-k-bad-0",
     "bad": "malformed-body"}                                         a bad request was stored

Other kinds are ignored here; liveness (strands and hand-offs) reads more of them, and its rules
are :mod:`keyqueue.chaos.liveness`'s docstring. The soak writes ``paused`` after sending SIGSTOP and ``resumed`` before
sending SIGCONT, so a logged pause never covers time in which the process ran.

The rules, exactly:

*Runs.* Records are taken in ``t`` order. A ``start`` opens a run of ``(w, key, tag)``; the next
``end`` of the same triple closes the earliest open one. A run left open (its end was never
logged) ends at its worker's first ``killed``, ``exited`` or ``exit`` record after its start (the
process was dead by then), else at its worker's next ``ready`` (a new process under the same name: the soak never
reuses a name while the old process lives), else at the end of the log (the last ``t``). It is
*not* ended by the worker's next record of another kind: a worker runs many keys at once, so
its other records say nothing about this run. Processors should log ``end`` in a ``finally``
(``"ok": false`` on failure or cancellation) so that only a dead process leaves a run open.

*Bodies.* A sync handler (a ``def`` in a thread or a pool child) logs ``enter`` and ``leave``
from inside the thread or child, so its run is measured by the handler's own clock, not the
session's. A body is identified by ``(w, pid, key, tag)``; an ``enter`` opens one, the next
``leave`` of the same identity closes the earliest open one, and a child's body (``"child":
true``) is closed by its worker's next ``reaped`` of ``(key, tag)`` as well, whichever comes
first (the pool has its answer, or has killed and joined it). A body never closed ended when the
process that ran it died: a thread with its worker (the worker's first ``killed``, ``exited``,
``exit`` or new ``ready`` after the body began), a child, which a dead worker's child does not
outlive (its parent-death signal; a child that does outlive it runs on and logs its own ``leave``,
which then counts), at the same moment; else at the end of the log. A run's end is the later of
its own end and the end of every body of its ``(w, key, tag)`` that began within it: a thread
or child that outlives its session's ``end`` extends the run. A run takes its ``shape`` from its
``start`` record (``async`` if none).

*Pauses.* A ``paused`` record stops its worker until its next ``resumed``, ``killed``,
``exited``, ``exit``, or the end of the log. A run's *active time* is its ``[start, end]`` minus its worker's pauses,
plus its pool children's bodies whole (a SIGSTOP of the worker does not stop its children).

*Overlaps.* Two runs X, Y of one key, X starting first, *intersect* when Y starts before X ends.
An intersection is *fenced* (a zombie, reported but not a failure) when X's worker was paused
after X started and before (or when) Y started, for at least ``handover_after`` seconds, and Y
started at least ``handover_after`` seconds after that pause began. X then lost its hold while
stopped, and anything it does after resuming is a zombie's, which the fenced store must refuse
(checked by the fencing rule below). It is fenced too when X's worker was paused when Y started,
the two never ran at the same moment (no shared active time), and X did not finish its work
after resuming (its ``end`` says ``"ok": false``, or never came): a holder whose renewals failed
before the pause (the server was down) loses its hold sooner than ``handover_after``, and gave
its work up. Every other intersection is an *overlap* and fails the run: Y acquired the key while
X's process was running, or too soon after it stopped and X then went on as if it held it.
Neither excuse applies when a pool child's body of X still ran when Y started: the child was not
stopped. ``handover_after`` should be the shortest time in which a stopped holder can lose a key
(``ack_wait`` minus the keepalive interval); the default 0 excuses every handover after a pause
began, so a short pause that should not have cost the hold is only caught with a real value.

*Bad input.* Each ``bad_input`` request must be settled: dead-lettered with a reason (an
``event`` record ``dead_lettered`` with its ``request_id`` and a non-empty ``reason``, or a
``dlq`` record the soak wrote after the run for each copy stored in the queue's dead-letter
stream: a worker that dead-lettered a request and died before it logged so leaves only the
stored copy), or, for a
``long-inbox`` request (whose body is good), done (a ``succeeded`` event: the worker ran it and
could not reply, which it records rather than sends). One never settled is *unsettled* and fails
the run (it was lost, or its key blocked). Bad requests never count for completions, order or
``unexpected``; their runs count for overlaps like any other. A ``foreign-subject`` record (lines
no client library writes, sent on the queue's subjects over a bare connection: its ``key`` is the
one a worker reads from the token it stored on a subject that is not UTF-8) is settled once a
worker gave that key back (a ``released`` or ``handed-off`` event for it after the record), or by
a ``token_gone`` record the soak wrote for its key after the run: the token was no longer in the
token stream, so a worker read it and released it (the first step of a give-back; a worker that
died before the rest of it never logged ``released``, and the key's lease record ends by its TTL).

*Completions and order.* An ``end`` not marked ``"ok": false`` completes its ``(key, tag)``. Per
key, each request's *first* completion must come in enqueue order (the ``expected`` list); an
order violation names a request whose first completion came after that of a later-enqueued
one. Expected requests never completed are *lost*; a request completed more than once is a
*duplicate* (allowed under at-least-once delivery, reported); a completion of a request not in
``expected`` is *unexpected* (and fails the run).

*Fencing.* Per key, accepted writes are taken in commit order: by their store ``seq`` when every
accepted write of the key logged one, else by ``t``. An accepted write whose fencing (compared
as a tuple) is lower than that of an earlier accepted write is *stale* and fails the run; refused
writes are counted. ``store_history`` (the store's own per-key commit order of accepted fencing,
:meth:`~keyqueue.chaos.fenced.FenceSnapshot.history`) is checked by the same rule.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from keyqueue.chaos.liveness import SERVER_SIDE, Liveness, LivenessBounds, measure_liveness

__all__ = ["BadInput", "Liveness", "LivenessBounds", "OrderViolation", "Overlap", "Run", "StaleWrite", "Verdict",
           "build_runs", "check", "read_log"]

Record = Mapping[str, Any]
Interval = tuple[float, float]

_SHOWN: Final = 5
"""How many items of each kind of problem the summary lists."""


@dataclass(frozen=True, slots=True)
class Run:
    """One processor run of ``tag`` on ``key`` by worker ``w``; ``open``: its end was never logged."""

    w: str
    key: str
    tag: str
    start: float
    end: float
    open: bool = False
    completed: bool = True
    """False when its end says ``"ok": false`` or was never logged: the run did not finish its work."""
    shape: str = "async"
    """The handler shape its ``start`` names (:mod:`keyqueue.chaos.handlers`)."""
    children: tuple[tuple[float, float], ...] = ()
    """The bodies of pool children that ran it (never paused with the worker)."""


@dataclass(frozen=True, slots=True)
class Overlap:
    """Two runs of one key that intersect; ``active`` is the seconds both processes ran together."""

    key: str
    first: Run
    second: Run
    active: float


@dataclass(frozen=True, slots=True)
class OrderViolation:
    """``tag`` was first completed after ``after``, though it was enqueued before it."""

    key: str
    tag: str
    after: str


@dataclass(frozen=True, slots=True)
class StaleWrite:
    """An accepted write whose fencing is lower than an earlier accepted write's (``highest``)."""

    key: str
    fencing: tuple[int, ...]
    highest: tuple[int, ...]
    source: Literal["log", "store"]
    tag: str = ""
    w: str = ""


@dataclass(frozen=True, slots=True)
class BadInput:
    """A bad request the producer stored, and how it was settled (``""``: never)."""

    key: str
    tag: str
    request_id: str
    bad: str
    settled: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Verdict:
    """Everything the checker found; ``ok`` when nothing that breaks the promises was."""

    runs: int
    open_runs: int
    requests: int
    completed: int
    overlaps: tuple[Overlap, ...]
    fenced_overlaps: tuple[Overlap, ...]
    order_violations: tuple[OrderViolation, ...]
    lost: tuple[tuple[str, str], ...]
    duplicates: Mapping[tuple[str, str], int]
    unexpected: tuple[tuple[str, str], ...]
    writes_accepted: int
    writes_refused: int
    writes_unknown: int
    stale_accepted: tuple[StaleWrite, ...]
    liveness: Liveness | None = None
    """Strands and hand-offs (:mod:`keyqueue.chaos.liveness`); they fail the run only with bounds."""
    shapes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Per handler shape: (runs, overlaps whose first run had that shape)."""
    bad_inputs: tuple[BadInput, ...] = ()

    @property
    def unsettled(self) -> tuple[BadInput, ...]:
        """Bad requests neither dead-lettered with a reason nor (a long inbox) done."""
        return tuple(b for b in self.bad_inputs if not b.settled)

    @property
    def ok(self) -> bool:
        """No overlap, order violation, lost or unexpected request, unsettled bad request,
        accepted stale write, or strand or hand-off past its bound."""
        return not (self.overlaps or self.order_violations or self.lost or self.unexpected
                    or self.stale_accepted or self.unsettled) and (self.liveness is None or self.liveness.ok)

    def summary(self) -> str:
        """A one-screen report: the counts, then the first few of each problem."""
        lines = [
            f"verdict: {'OK' if self.ok else 'FAILED'}",
            f"runs {self.runs} (open {self.open_runs}); requests completed {self.completed}/{self.requests}, "
            f"lost {len(self.lost)}, duplicated {len(self.duplicates)}, unexpected {len(self.unexpected)}",
            f"overlaps {len(self.overlaps)}, fenced (zombie after a pause) {len(self.fenced_overlaps)}, "
            f"order violations {len(self.order_violations)}",
            f"writes accepted {self.writes_accepted}, refused {self.writes_refused}, unknown {self.writes_unknown}, "
            f"accepted stale {len(self.stale_accepted)}",
        ]
        if set(self.shapes) - {"async"}:
            shapes = sorted(self.shapes.items())
            lines.append("handler shapes: " + ", ".join(
                f"{shape} {runs} runs ({overlaps} overlaps)" for shape, (runs, overlaps) in shapes))
        if self.bad_inputs:
            kinds = Counter(b.bad for b in self.bad_inputs)
            outcomes = Counter(b.settled or "unsettled" for b in self.bad_inputs)
            lines.append(f"bad input: {len(self.bad_inputs)} ("
                         + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) + "); "
                         + ", ".join(f"{outcome} {n}" for outcome, n in sorted(outcomes.items())))
        for o in self.overlaps[:_SHOWN]:
            lines.append(f"  overlap {o.key}: {_show(o.first)} and {_show(o.second)}, both running {o.active:.3f}s")
        for v in self.order_violations[:_SHOWN]:
            lines.append(f"  order {v.key}: {v.tag} completed after {v.after}, enqueued before it")
        lines.extend(f"  lost {key}: {tag}" for key, tag in self.lost[:_SHOWN])
        lines.extend(f"  unexpected {key}: {tag}" for key, tag in self.unexpected[:_SHOWN])
        lines.extend(f"  unsettled bad input {b.key}: {b.tag} ({b.bad}, request {b.request_id})"
                     for b in self.unsettled[:_SHOWN])
        for s in self.stale_accepted[:_SHOWN]:
            lines.append(f"  stale write {s.key} ({s.source}): fencing {list(s.fencing)} accepted after "
                         f"{list(s.highest)} {s.w} {s.tag}".rstrip())
        if self.liveness is not None:
            lines.extend(self.liveness.summary(_SHOWN))
        return "\n".join(lines)


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log; a half-written last line (a killed writer's) is skipped."""
    text = Path(path).read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def check(records: Iterable[Record], expected: Mapping[str, Sequence[str]], *,
          store_history: Mapping[str, Sequence[Sequence[int]]] | None = None,
          handover_after: float = 0.0, bounds: LivenessBounds | None = None) -> Verdict:
    """The verdict on a run log, given each key's request tags in enqueue order. Liveness is
    measured too; with ``bounds`` a strand or hand-off past them fails the verdict."""
    ordered = sorted(records, key=lambda r: float(r["t"]))
    bodies = _bodies(ordered)
    runs = sorted(_with_bodies(_runs(ordered), bodies), key=lambda run: run.start)
    busy: dict[str, list[Interval]] = defaultdict(list)
    starts: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for run in runs:
        starts[(run.w, run.key, run.tag)].append(run.start)
    for b in bodies:
        # From its run's start: a body that waited for a free thread or pool child (all busy
        # with other keys' slow bodies) was the handler's time as much as its running was.
        began = [t for t in starts.get((b.w, b.key, b.tag), ()) if t <= b.start]
        busy[b.key].append((max(began) if began else b.start, b.end))
    overlaps, fenced = _overlaps(runs, _pauses(ordered), handover_after, _renewal_faults(ordered))
    bad_inputs = _bad_inputs(ordered)
    bad_tags = {(b.key, b.tag) for b in bad_inputs}
    completions = _completions(ordered, bad_tags)
    shape_runs = Counter(run.shape for run in runs)
    shape_overlaps = Counter(o.first.shape for o in overlaps)
    writes = [r for r in ordered if r.get("kind") == "write"]
    stale = _stale_in_log(writes)
    if store_history is not None:
        stale += [StaleWrite(key, tuple(history[i]), highest, "store")
                  for key, history in store_history.items() for i, highest in _stale(history)]
    firsts = {key: list(dict.fromkeys(tags)) for key, tags in completions.items()}
    wanted = {(key, tag) for key, tags in expected.items() for tag in tags}
    return Verdict(
        runs=len(runs),
        open_runs=sum(run.open for run in runs),
        requests=len(wanted),
        completed=sum((key, tag) in wanted for key, tags in firsts.items() for tag in tags),
        overlaps=tuple(overlaps),
        fenced_overlaps=tuple(fenced),
        order_violations=tuple(_order_violations(firsts, expected)),
        lost=tuple((key, tag) for key, tags in expected.items() for tag in tags if tag not in firsts.get(key, ())),
        duplicates={(key, tag): n for key, tags in completions.items() for tag, n in Counter(tags).items() if n > 1},
        unexpected=tuple((key, tag) for key, tags in firsts.items() for tag in tags if (key, tag) not in wanted),
        writes_accepted=sum(r.get("accepted") is True for r in writes),
        writes_refused=sum(r.get("accepted") is False for r in writes),
        writes_unknown=sum(not isinstance(r.get("accepted"), bool) for r in writes),
        stale_accepted=tuple(stale),
        liveness=measure_liveness(ordered, bounds, busy),
        shapes={shape: (n, shape_overlaps[shape]) for shape, n in shape_runs.items()},
        bad_inputs=tuple(bad_inputs),
    )


# --- runs and overlaps -------------------------------------------------------------------------


def build_runs(records: Iterable[Record]) -> list[Run]:
    """Every run in the log, open ones ended by the module's rule and extended by their bodies,
    in order of their start."""
    ordered = sorted(records, key=lambda r: float(r["t"]))
    return sorted(_with_bodies(_runs(ordered), _bodies(ordered)), key=lambda run: run.start)


def _runs(ordered: Sequence[Record]) -> list[Run]:
    """The runs of ``start`` / ``end`` records (in ``t`` order), open ones ended by the module's rule."""
    end_of_log = float(ordered[-1]["t"]) if ordered else 0.0
    open_: dict[str, dict[tuple[str, str], list[tuple[float, str]]]] = defaultdict(lambda: defaultdict(list))
    runs: list[Run] = []

    def end_open(w: str, t: float) -> None:
        for (key, tag), starts in open_.pop(w, {}).items():
            runs.extend(Run(w, key, tag, start, t, open=True, completed=False, shape=shape) for start, shape in starts)

    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "start":
            open_[w][(r["key"], r["tag"])].append((t, str(r.get("shape", "async"))))
        elif kind == "end":
            starts = open_[w].get((r["key"], r["tag"]))
            if starts:
                start, shape = starts.pop(0)
                runs.append(Run(w, r["key"], r["tag"], start, t, completed=r.get("ok", True) is not False,
                                shape=shape))
        elif kind in ("killed", "exited", "exit", "ready"):
            end_open(w, t)
    for w in list(open_):
        end_open(w, end_of_log)
    return runs


@dataclass(frozen=True, slots=True)
class _Body:
    w: str
    key: str
    tag: str
    start: float
    end: float
    child: bool


def _bodies(ordered: Sequence[Record]) -> list[_Body]:
    """Every sync handler body in the log, ended by the module's rule."""
    end_of_log = float(ordered[-1]["t"]) if ordered else 0.0
    # Per (w, pid, key, tag): the open bodies, each [start, child, when its worker died or None].
    open_: dict[tuple[str, object, str, str], list[list[Any]]] = defaultdict(list)
    bodies: list[_Body] = []

    def close(ident: tuple[str, object, str, str], body: list[Any], t: float) -> None:
        open_[ident].remove(body)
        bodies.append(_Body(ident[0], ident[2], ident[3], body[0], t, body[1]))

    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "enter":
            open_[(w, r.get("pid"), r["key"], r["tag"])].append([t, bool(r.get("child")), None])
        elif kind == "leave":
            ident = (w, r.get("pid"), r["key"], r["tag"])
            if open_.get(ident):
                close(ident, open_[ident][0], t)
        elif kind == "reaped":
            found = next(((ident, body) for ident, opened in open_.items() for body in opened
                          if ident[0] == w and ident[2:] == (r["key"], r["tag"]) and body[1] and body[2] is None),
                         None)
            if found is not None:
                close(*found, t)
        elif kind in ("killed", "exited", "exit", "ready"):
            for ident, opened in list(open_.items()):
                if ident[0] != w:
                    continue
                for body in list(opened):
                    if not body[1]:
                        close(ident, body, t)  # a thread dies with its process
                    elif body[2] is None:
                        body[2] = t  # a child ends with it too, unless it logs its own leave later
    for ident, opened in list(open_.items()):
        for body in list(opened):
            close(ident, body, end_of_log if body[2] is None else body[2])
    return bodies


def _with_bodies(runs: Sequence[Run], bodies: Sequence[_Body]) -> list[Run]:
    """Each run, ending no sooner than the bodies of its ``(w, key, tag)`` that began within it."""
    by_run: dict[tuple[str, str, str], list[_Body]] = defaultdict(list)
    for body in bodies:
        by_run[(body.w, body.key, body.tag)].append(body)
    extended: list[Run] = []
    for run in runs:
        mine = [b for b in by_run.get((run.w, run.key, run.tag), ()) if run.start <= b.start <= run.end]
        if not mine:
            extended.append(run)
            continue
        extended.append(replace(run, end=max(run.end, *(b.end for b in mine)),
                                children=tuple((b.start, b.end) for b in mine if b.child)))
    return extended


def _pauses(ordered: Sequence[Record]) -> dict[str, list[Interval]]:
    end_of_log = float(ordered[-1]["t"]) if ordered else 0.0
    paused_at: dict[str, float] = {}
    pauses: dict[str, list[Interval]] = defaultdict(list)
    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "paused":
            paused_at.setdefault(w, t)
        elif kind in ("resumed", "killed", "exited", "exit") and w in paused_at:
            pauses[w].append((paused_at.pop(w), t))
    for w, t in paused_at.items():
        pauses[w].append((t, end_of_log))
    return pauses


def _overlaps(runs: Sequence[Run], pauses: Mapping[str, Sequence[Interval]], handover_after: float,
              renewal_faults: Mapping[str, Sequence[float]] | None = None) -> tuple[list[Overlap], list[Overlap]]:
    renewal_faults = renewal_faults or {}
    by_key: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_key[run.key].append(run)
    overlaps: list[Overlap] = []
    fenced: list[Overlap] = []
    for key, key_runs in by_key.items():
        key_runs.sort(key=lambda run: run.start)
        for i, x in enumerate(key_runs):
            for y in key_runs[i + 1:]:
                if y.start >= x.end:
                    break
                shared = _length(_intersect(_active(x, pauses.get(x.w, ())), _active(y, pauses.get(y.w, ()))))
                found = Overlap(key, x, y, shared)
                child_ran_on = any(c1 > y.start for _, c1 in x.children)
                if not child_ran_on and (_handed_over(x, y, pauses.get(x.w, ()), handover_after) or _gave_up(
                        x, y, shared, pauses.get(x.w, ()), renewal_faults.get(x.w, ()))):
                    fenced.append(found)
                else:
                    overlaps.append(found)
    return overlaps, fenced


def _handed_over(x: Run, y: Run, pauses: Sequence[Interval], handover_after: float) -> bool:
    """Whether x's worker stopped long enough, before y started, for x's hold to have passed to y."""
    return any(x.start <= p0 <= y.start and p1 - p0 >= handover_after and y.start >= p0 + handover_after
               for p0, p1 in pauses)


def _gave_up(x: Run, y: Run, shared: float, pauses: Sequence[Interval], faults: Sequence[float]) -> bool:
    """Whether x's hold may have lapsed early and x gave its work up: a fault that can fail its
    renewals (the server down, its own connection cut or slowed) began while x ran and before y
    started, x's worker was stopped when y started, the two never ran at the same moment, and x did
    not finish after it resumed. (Anything it wrote after resuming is judged by the fencing rule.)"""
    return (shared == 0 and not x.completed and any(p0 <= y.start < p1 for p0, p1 in pauses)
            and any(x.start <= f <= y.start for f in faults))


def _renewal_faults(ordered: Sequence[Record]) -> dict[str, list[float]]:
    """Per worker, when a fault began that can fail its lease renewals: every server-side fault (all
    workers: a server restart or kill, a leader kill or stepdown, a node cut off, a rolling restart),
    network faults on its own connection, and a handler of its own blocking its event loop (its
    ``blocked`` record: nothing renews until the loop runs again, and a SIGSTOP that follows stops
    the loop watchdog before it can end the process). Keyed ``"*"`` for every worker."""
    faults: dict[str, list[float]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") == "blocked":
            faults[str(r.get("w"))].append(float(r["t"]))
        if r.get("kind") != "fault":
            continue
        name, t = str(r.get("fault", "")), float(r["t"])
        if name.startswith(SERVER_SIDE):
            faults["*"].append(t)
        elif name.startswith("net-") and r.get("target"):
            faults[str(r["target"])].append(t)
    shared = faults.pop("*", [])
    workers = {str(r.get("w")) for r in ordered if r.get("kind") == "start"}
    return {w: sorted([*shared, *faults.get(w, [])]) for w in workers | set(faults)}


def _active(run: Run, pauses: Sequence[Interval]) -> list[Interval]:
    spans = _unpaused(run, pauses)
    for c0, c1 in run.children:  # a child is not stopped with its worker
        spans = [*_subtract(spans, (c0, c1)), (c0, c1)]
    return sorted(spans)


def _subtract(spans: Sequence[Interval], cut: Interval) -> list[Interval]:
    out: list[Interval] = []
    for s0, s1 in spans:
        if s1 <= cut[0] or s0 >= cut[1]:
            out.append((s0, s1))
            continue
        if s0 < cut[0]:
            out.append((s0, cut[0]))
        if s1 > cut[1]:
            out.append((cut[1], s1))
    return out


def _unpaused(run: Run, pauses: Sequence[Interval]) -> list[Interval]:
    spans: list[Interval] = []
    cursor = run.start
    for p0, p1 in sorted(pauses):
        if p1 <= cursor or p0 >= run.end:
            continue
        if p0 > cursor:
            spans.append((cursor, p0))
        cursor = max(cursor, p1)
    if cursor < run.end:
        spans.append((cursor, run.end))
    return spans


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    return [(max(a0, b0), min(a1, b1)) for a0, a1 in a for b0, b1 in b if max(a0, b0) < min(a1, b1)]


def _length(spans: Iterable[Interval]) -> float:
    return sum(end - start for start, end in spans)


# --- completions, order, fencing ---------------------------------------------------------------


def _completions(ordered: Iterable[Record], bad: set[tuple[str, str]]) -> dict[str, list[str]]:
    done: dict[str, list[str]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") == "end" and r.get("ok", True) is not False and (r["key"], r["tag"]) not in bad:
            done[r["key"]].append(r["tag"])
    return done


GIVEN_BACK: Final = ("released", "handed-off")
"""Session events that end a hold with the key given back (a ``foreign-subject`` token is settled by one)."""


def _bad_inputs(ordered: Sequence[Record]) -> list[BadInput]:
    """Each stored bad request, with how it was settled (see the module's rule)."""
    stored = [r for r in ordered if r.get("kind") == "bad_input"]
    if not stored:
        return []
    settled: dict[str, tuple[str, str]] = {}
    for r in ordered:
        if r.get("kind") == "dlq" and r.get("reason") and r.get("request_id") not in settled:
            settled[str(r["request_id"])] = ("dead-lettered", str(r["reason"]))
            continue
        if r.get("kind") != "event" or r.get("request_id") in settled:
            continue
        if r.get("event") == "dead_lettered" and r.get("reason"):
            settled[str(r["request_id"])] = ("dead-lettered", str(r["reason"]))
        elif r.get("event") == "succeeded":
            settled[str(r["request_id"])] = ("done", "")
    given_back = defaultdict(list)  # key -> when a worker gave it back (for foreign-subject tokens)
    tokens_gone: set[str] = set()  # keys whose token the soak found gone from the stream after the run
    for r in ordered:
        if r.get("kind") == "event" and r.get("event") in GIVEN_BACK:
            given_back[str(r.get("key"))].append(float(r["t"]))
        elif r.get("kind") == "token_gone":
            tokens_gone.add(str(r.get("key")))
    found = []
    for r in stored:
        rid, bad = str(r["request_id"]), str(r.get("bad", ""))
        how, reason = settled.get(rid, ("", ""))
        if bad == "foreign-subject":
            t = float(r["t"])
            how = ("given back" if any(at >= t for at in given_back.get(str(r["key"]), ()))
                   else "token released" if str(r["key"]) in tokens_gone else "")
        if how == "done" and bad != "long-inbox":
            how = ""  # a request the worker must refuse was run: not settled as it should be
        found.append(BadInput(str(r["key"]), str(r["tag"]), rid, bad, how, reason))
    return found


def _order_violations(firsts: Mapping[str, Sequence[str]],
                      expected: Mapping[str, Sequence[str]]) -> list[OrderViolation]:
    violations: list[OrderViolation] = []
    for key, tags in expected.items():
        position = {tag: i for i, tag in enumerate(tags)}
        done = [tag for tag in firsts.get(key, ()) if tag in position]
        latest = ""  # the latest-enqueued request completed so far
        for tag in done:
            if latest and position[tag] < position[latest]:
                violations.append(OrderViolation(key, tag, latest))
            else:
                latest = tag
    return violations


def _stale_in_log(writes: Sequence[Record]) -> list[StaleWrite]:
    accepted: dict[str, list[Record]] = defaultdict(list)
    for r in writes:
        if r.get("accepted") is True:
            accepted[r["key"]].append(r)
    found: list[StaleWrite] = []
    for key, records in accepted.items():
        if all(isinstance(r.get("seq"), int) for r in records):
            records = sorted(records, key=lambda r: int(r["seq"]))
        for i, highest in _stale([tuple(r["fencing"]) for r in records]):
            r = records[i]
            found.append(StaleWrite(key, tuple(r["fencing"]), highest, "log", str(r.get("tag", "")), str(r["w"])))
    return found


def _stale(history: Sequence[Sequence[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Where a commit-ordered fencing history goes down: each such index, with the highest before it."""
    found: list[tuple[int, tuple[int, ...]]] = []
    highest: tuple[int, ...] | None = None
    for i, entry in enumerate(history):
        fencing = tuple(int(part) for part in entry)
        if highest is not None and fencing < highest:
            found.append((i, highest))
        else:
            highest = fencing
    return found


def _show(run: Run) -> str:
    return f"{run.tag}@{run.w} [{run.start:.3f}, {run.end:.3f}{' open' if run.open else ''}]"
