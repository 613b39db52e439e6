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

*Pauses.* A ``paused`` record stops its worker until its next ``resumed``, ``killed``,
``exited``, ``exit``, or the end of the log. A run's *active time* is its ``[start, end]`` minus its worker's pauses.

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
``handover_after`` should be the shortest time in which a stopped holder can lose a key
(``ack_wait`` minus the keepalive interval); the default 0 excuses every handover after a pause
began, so a short pause that should not have cost the hold is only caught with a real value.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from keyqueue.chaos.liveness import SERVER_SIDE, Liveness, LivenessBounds, measure_liveness

__all__ = ["Liveness", "LivenessBounds", "OrderViolation", "Overlap", "Run", "StaleWrite", "Verdict", "build_runs",
           "check", "read_log"]

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

    @property
    def ok(self) -> bool:
        """No overlap, order violation, lost or unexpected request, accepted stale write, or
        strand or hand-off past its bound."""
        return not (self.overlaps or self.order_violations or self.lost or self.unexpected
                    or self.stale_accepted) and (self.liveness is None or self.liveness.ok)

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
        for o in self.overlaps[:_SHOWN]:
            lines.append(f"  overlap {o.key}: {_show(o.first)} and {_show(o.second)}, both running {o.active:.3f}s")
        for v in self.order_violations[:_SHOWN]:
            lines.append(f"  order {v.key}: {v.tag} completed after {v.after}, enqueued before it")
        lines.extend(f"  lost {key}: {tag}" for key, tag in self.lost[:_SHOWN])
        lines.extend(f"  unexpected {key}: {tag}" for key, tag in self.unexpected[:_SHOWN])
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
    runs = build_runs(ordered)
    overlaps, fenced = _overlaps(runs, _pauses(ordered), handover_after, _renewal_faults(ordered))
    completions = _completions(ordered)
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
        liveness=measure_liveness(ordered, bounds),
    )


# --- runs and overlaps -------------------------------------------------------------------------


def build_runs(records: Iterable[Record]) -> list[Run]:
    """Every run in the log, open ones ended by the module's rule, in order of their start."""
    ordered = sorted(records, key=lambda r: float(r["t"]))
    end_of_log = float(ordered[-1]["t"]) if ordered else 0.0
    open_: dict[str, dict[tuple[str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    runs: list[Run] = []

    def end_open(w: str, t: float) -> None:
        for (key, tag), starts in open_.pop(w, {}).items():
            runs.extend(Run(w, key, tag, start, t, open=True, completed=False) for start in starts)

    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "start":
            open_[w][(r["key"], r["tag"])].append(t)
        elif kind == "end":
            starts = open_[w].get((r["key"], r["tag"]))
            if starts:
                runs.append(Run(w, r["key"], r["tag"], starts.pop(0), t, completed=r.get("ok", True) is not False))
        elif kind in ("killed", "exited", "exit", "ready"):
            end_open(w, t)
    for w in list(open_):
        end_open(w, end_of_log)
    return sorted(runs, key=lambda run: run.start)


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
                if _handed_over(x, y, pauses.get(x.w, ()), handover_after) or _gave_up(
                        x, y, shared, pauses.get(x.w, ()), renewal_faults.get(x.w, ())):
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


def _completions(ordered: Iterable[Record]) -> dict[str, list[str]]:
    done: dict[str, list[str]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") == "end" and r.get("ok", True) is not False:
            done[r["key"]].append(r["tag"])
    return done


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
