"""Liveness from a chaos run log: how long stored requests waited for nobody, and how long each
fault's keys took to move. Pure functions; :func:`keyqueue.chaos.checker.check` calls them.

The records it reads, besides the checker's own (``start``, ``paused``, ``resumed``, ``killed``)::

    {"w": "producer", "kind": "stored", "t": ..., "key": "k", "tag": "k-3"}  the producer got its PubAck
    {"w": "w1", "kind": "ready", "t": ..., "concurrency": 8}             keys the process may hold at once
    {"w": "w1", "kind": "event", "t": ..., "event": "acquired", "key": "k"}  w1 holds k (its lease record)
    {"w": "w1", "kind": "event", "t": ..., "event": "released", "key": "k"}  ... and no longer: also
        "handed-off", "lease_lost", "session_failed", "interrupted"
    {"w": "w1", "kind": "exited", "t": ...}       the process died (the soak's watcher; "exit": it ended)
    {"w": "w1", "kind": "blocked", "t": ...}      its handler blocked the event loop, until "unblocked"
    {"w": "soak", "kind": "fault", "t": ..., "fault": "net-blackhole", "target": "w1", "id": 4}
    {"w": "soak", "kind": "fault_end", "t": ..., "id": 4}    reverted, healed, or the server back and ready

The rules, exactly (``lease`` is the queue's ``ack_wait``; :class:`LivenessBounds`):

*Holds.* Worker ``w`` holds key ``k`` from its ``acquired`` event for ``k`` until its next
session-end event for ``k``, or until its process ends (``killed``, ``exited``, ``exit``, or a
new ``ready`` of ``w``), or the end of the log. ``k`` is *free* when no worker holds it.

*Faults.* A ``fault`` lasts until the ``fault_end`` of the same id (a fault never ended lasts to
the end of the log), except ``kill-9``, which is over when it begins (its ``fault_end`` marks the
new process being ready). A fault whose ``target`` is a worker (process and network faults) is a
fault *on* that worker; so is each interval in which a worker is paused (``paused`` ..
``resumed``: SIGSTOP, a stall) or blocked (``blocked`` .. ``unblocked``). A fault on the server
side (``server-*``, ``leader-*``, ``stepdown-*``, ``node-cut``, ``rolling-restart``) is a fault on
every worker, and *disturbs* the whole system while it lasts; one that leaves a replicated group
without a leader (``leader-kill-9-*``, ``node-cut``) lasts at least ``election`` seconds, however
soon the node is back (nats-server elects a new leader only after its election timeout).
``block-loop`` records from the soak only count the fault (its interval is the worker's
``blocked`` .. ``unblocked``).

*Available.* A worker is *up* from its ``ready`` until its process ends or a ``drain`` fault on it
begins. It is *available* while it is up, not paused, not blocked, not cut off (a
``net-blackhole`` or ``net-outage`` fault on it), not slowed (``net-latency``, ``net-bandwidth``:
a round trip of a second or more), and holding fewer keys than its ``concurrency`` (no limit if
its ``ready`` does not say). A token taken by a worker that is not available is in its key's
shadow (below), as one swallowed by a stopped worker.

*Shadows.* A fault on worker ``w`` over ``[f0, f1]`` casts a *shadow* on each key ``w`` held at any
moment of it, from when the fault and the hold first coincide until ``f1 + moved_after_loss``: the
key may still be held by ``w``'s lease record (renewed, at the latest, by bytes a partition
delivered when it healed) until its TTL runs out and a waiter notices.

*Swallowed tokens.* An outstanding pull of a stopped worker (paused, blocked, cut off) takes a
token that the server then waits a lease on before redelivering it (a cut-off worker may also
take it itself once healed). An ``acquired`` event at ``a`` with ``delivered`` ``d`` says the
token was delivered ``d - 1`` times before without being taken. If the acquiring worker was
stopped, or (``d`` > 1) any worker was stopped or its process ended, within
``W = [a - d * lease - slack, a]``, then ``W`` is in the key's shadow too.

*Tokens with the unavailable.* A ``token`` event says a worker received a key's token. If that
worker was unavailable (stopped, cut off, slowed, or its process ended) at some moment before the
key's next token or acquisition anywhere, the interval from the token to that next event is in the
key's shadow: the worker could not act on it, and the server delivers it again only after its
ack wait. Its claim may outlast that interval: the session tries to acquire for up to two leases,
and a write of it that a slowed or cut-off link delivers late, after the key's holder gave it
back, is a lease record its sender never hears of, which holds the key until its TTL. So the
shadow lasts at least until the claim's end: that worker's next ``acquired``, ``contended`` or
session-ending event of the key, or three leases after the token if none came (a failed acquire
says nothing in the log), or a lease after its process ended, whichever is first.

*Strand.* A request's strand is the total time, from its ``stored`` record until its first
``start`` (or the end of the log), during which its key was free, some worker was available, no
fault disturbed the system and the key was in no shadow: time in which nothing but the protocol
kept it from starting. A run's strand is its requests' largest; above ``LivenessBounds.strand`` it
fails the run.

*Hand-offs.* For each fault on worker ``w`` (or on every worker) beginning at ``f0``: each key
that ``w`` held at ``f0`` and that had a request stored before ``f0`` and not started by then
(the latest such request) *moved* at the first ``start`` of any of its requests after ``f0``, on
any worker; its hand-off is that time less ``f0`` (never: the end of the log), or less the end of
a sync handler's body of the key (a thread or a child, :mod:`keyqueue.chaos.checker`) that ran at
``f0`` (from its run's ``start``: time it waited for a free thread or pool child counts as its
own), if later: nothing cuts such a body short, so its key moves after it; time it ran is the
handler's (a body on a lost lease ends with its process). The bound of a fault ending at ``f1``:

- ``kill-9``: ``f0 + moved_after_loss`` (the lease, then a waiter's acquisition);
- a fault that takes a replicated group's leader away with no hand-over (``leader-kill-9-*``,
  ``node-cut``): ``max(f1 + resume, f0 + election + moved_after_loss)``. nats-server's raft elects
  a new leader only after its election timeout (4-9 s), during which nothing can be written to
  the group: a lease of a few seconds ends, and its record expires after the election;
- a fault shorter than the lease (its holder can keep its keys: a reset and reconnect, a short
  partition, stall or outage): ``f1 + resume``;
- a longer one: ``max(f1 + resume, f0 + moved_after_loss)``;
- ``net-latency``, ``net-bandwidth`` and ``drain``: none (reported, never failing).

If the key's holder's process ended after ``f0`` and before the key moved (its loop watchdog or its
lease alarm ended it, under this fault or one before it), the bound is at least that death plus
``moved_after_loss``: its keys move once their leases end, which no fault can hasten.

Time between ``f1`` (``f0`` for a ``kill-9``) and the key's move in which no worker was available
(every worker full, stopped, cut off or not yet back up: the strand's rule) is added to the bound:
no protocol moves a key to a worker that cannot take it. (The fault's own span is not: its bound
already gives it in full.)

*Silences.* A worker is *heard* at each record with its name in ``w`` but ``dumped`` (a state it
wrote because the soak asked, :class:`keyqueue.chaos.fleet.SilenceWatch`). A
silence is the stretch between two of them (or from the last to the end of the log, while its
process runs); what counts of it is the time in which that worker was available, no fault
disturbed the system, and some stored request waited with its key free and in no shadow (strand
time, of any request): time in which a working worker takes a token and says so within a few
round trips. A worker whose connection never came back, or whose pulls died, is silent through
all of it while the others serve; one that is merely idle has no such time (every waiting key is
held). A run's silence is its workers' largest; above ``LivenessBounds.silence`` it fails the run.

A hand-off is *alone* when no other fault began after its fault and before the key moved, and
none that began before it was still in effect when it began, on the server (a fault of a node or
of every worker, a leaderless group's until its election at the latest) or on a holder of the key.
One past its bound fails the run only if it is alone: otherwise its time may be another fault's
(a soak of a fault a second compounds them; a node cut off just before a worker's connection was
reset keeps that worker's lease writes unanswered until it heals, whatever the reset's bound),
and it is reported, counted apart, but not failed.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["Distribution", "Handoff", "Liveness", "LivenessBounds", "Silence", "Strand", "measure_liveness"]

Record = Mapping[str, Any]
Interval = tuple[float, float]

SESSION_ENDS: Final = frozenset({"released", "handed-off", "lease_lost", "session_failed", "interrupted"})
"""Session events after which the worker no longer holds the key."""

PROCESS_ENDS: Final = frozenset({"killed", "exited", "exit"})
"""Records after which a worker process no longer runs."""

SERVER_SIDE: Final = ("server-", "leader-", "stepdown-", "node-cut", "rolling-restart")
"""Fault kinds (prefixes) that act on the server side: every worker is affected."""

CUT_OFF: Final = frozenset({"net-blackhole", "net-outage"})
"""Network faults during which the worker cannot take a key."""

SLOWED: Final = frozenset({"net-latency", "net-bandwidth"})
"""Network faults during which the worker takes a key only slowly (a round trip of a second or
more): for strands it is not available, and a token it takes meanwhile is in the key's shadow."""

UNAVAILABLE: Final = CUT_OFF | SLOWED

CLAIM_ENDS: Final = SESSION_ENDS | {"acquired", "contended"}
"""Session events after which a worker's claim on a key (a token it received) is settled."""

CLAIM_LEASES: Final = 3
"""How long, in leases, a claim that logged no end may hold its key: a session tries to acquire for
two leases, and a record written at the last moment lives one more."""

LEADERLESS: Final = ("leader-kill-9", "node-cut")
"""Fault kinds (prefixes) after which a replicated group waits out a raft election."""

UNBOUNDED: Final = frozenset({"net-latency", "net-bandwidth", "drain"})
"""Faults whose hand-offs are reported but have no bound: they slow a worker rather than stop it,
or hand its keys back by design."""


@dataclass(frozen=True, slots=True)
class LivenessBounds:
    """What the run must achieve, in seconds; set from measurement (docs/chaos.md, "Liveness")."""

    lease: float
    """The queue's lease (``ack_wait``)."""
    strand: float = 2.0
    """Longest strand allowed: a stored request waiting with its key free and a worker free."""
    resume: float = 2.0
    """After a fault shorter than the lease ends, the holder's keys make progress within this."""
    slack: float = 1.0
    """After a lease ends: the server's TTL expiry and a waiter's next acquisition attempt."""
    election: float = 9.0
    """nats-server's longest raft election timeout: a group whose leader died or was cut off has no
    leader, and takes no write, until then."""
    silence: float = 5.0
    """Longest silence allowed: strand time (of any request) in which an available worker wrote
    nothing. A strand is one request's; this is one worker's, so a worker that took nothing while
    the others served every request fails here and not there."""

    @classmethod
    def for_lease(cls, lease: float, **fields: float) -> LivenessBounds:
        return cls(lease=lease, **fields)

    @property
    def moved_after_loss(self) -> float:
        """How soon a lost holder's keys move: the lease record's TTL (whole seconds) and the slack."""
        return math.ceil(self.lease) + self.slack


@dataclass(frozen=True, slots=True)
class Strand:
    """The strand of one request, and the stretch of its wait that counted the most."""

    key: str
    tag: str
    seconds: float
    stored: float
    started: float | None
    """Its first start (None: never)."""
    longest: Interval
    """The longest single stretch of strand time within the wait."""


@dataclass(frozen=True, slots=True)
class Silence:
    """One worker's longest silence: strand time in which it was available and wrote nothing."""

    worker: str
    seconds: float
    heard: float
    """Its record before the silence."""
    next_heard: float | None
    """Its record after it (None: none until the log or its process ended)."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """How long one key of one fault took to move (``seconds`` is None: never)."""

    fault: str
    fault_id: Any
    target: str
    key: str
    began: float
    ended: float
    seconds: float | None
    bound: float | None
    """Seconds after ``began`` allowed (None: unbounded)."""
    alone: bool = True
    """No other fault began between this one and the key's move, and none on the server or on the
    key's holder was still in effect when it began: the time is this fault's alone."""

    @property
    def late(self) -> bool:
        return self.bound is not None and (self.seconds is None or self.seconds > self.bound)


@dataclass(frozen=True, slots=True)
class Distribution:
    """p50 / p99 / max of some durations (``count`` of them)."""

    count: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls(0, 0.0, 0.0, 0.0)

        def rank(q: float) -> float:
            return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

        return cls(len(ordered), rank(0.5), rank(0.99), ordered[-1])

    def __str__(self) -> str:
        return f"n {self.count}, p50 {self.p50:.3f}s, p99 {self.p99:.3f}s, max {self.max:.3f}s"


@dataclass(frozen=True)
class Liveness:
    """Strands and hand-offs of one run, and which exceeded their bounds."""

    bounds: LivenessBounds | None
    strands: tuple[Strand, ...]
    """Every request's strand, largest first."""
    handoffs: tuple[Handoff, ...]
    """Every measured hand-off, in fault order."""
    handoffs_by_kind: Mapping[str, Distribution] = field(default_factory=dict)
    silences: tuple[Silence, ...] = ()
    """Each worker's longest silence, largest first."""

    @property
    def silences_over(self) -> tuple[Silence, ...]:
        if self.bounds is None:
            return ()
        return tuple(s for s in self.silences if s.seconds > self.bounds.silence)

    @property
    def strand(self) -> Distribution:
        return Distribution.of([s.seconds for s in self.strands])

    @property
    def strands_over(self) -> tuple[Strand, ...]:
        if self.bounds is None:
            return ()
        bound = self.bounds.strand
        return tuple(s for s in self.strands if s.seconds > bound)

    @property
    def late_handoffs(self) -> tuple[Handoff, ...]:
        return tuple(h for h in self.handoffs if h.late)

    @property
    def late_alone(self) -> tuple[Handoff, ...]:
        """Late hand-offs that no other fault confounds: those fail the run."""
        return tuple(h for h in self.late_handoffs if h.alone)

    @property
    def ok(self) -> bool:
        # A hand-off that another fault began to delay before its key moved measures both faults:
        # it is reported (and listed), but only one no other fault confounds holds the protocol to
        # its bound.
        return not (self.strands_over or self.late_alone or self.silences_over)

    def summary(self, shown: int = 5) -> list[str]:
        """Lines for the verdict's summary: the distributions, then the worst cases."""
        b = self.bounds
        lines = [f"strand per request: {self.strand}"
                 + (f"; over {b.strand:g}s: {len(self.strands_over)}" if b is not None else "")]
        lines += [f"  strand {s.key} {s.tag}: {s.seconds:.3f}s waiting with its key and a worker free (stored "
                  f"{s.stored:.3f}, started {'never' if s.started is None else f'{s.started:.3f}'}; longest "
                  f"stretch {s.longest[1] - s.longest[0]:.3f}s from {s.longest[0]:.3f})"
                  for s in self.strands[:shown] if s.seconds > 0]
        if self.silences:
            lines.append("silence per worker (strand time in which it was available and wrote nothing): "
                         + ", ".join(f"{x.worker} {x.seconds:.3f}s" for x in self.silences)
                         + (f"; over {b.silence:g}s: {len(self.silences_over)}" if b is not None else ""))
            lines += [f"  silent {x.worker} from {x.heard:.3f} until "
                      f"{'the end' if x.next_heard is None else f'{x.next_heard:.3f}'}: {x.seconds:.3f}s of strand time"
                      for x in self.silences_over[:shown]]
        if b is not None:
            late = self.late_handoffs
            lines.append(f"hand-offs (seconds from the fault until its held keys' next start; bounds: kill-9 "
                         f"{b.moved_after_loss:g}s, a fault shorter than the lease its end + {b.resume:g}s): "
                         f"late {len(late)} ({sum(h.alone for h in late)} with no other fault before the key moved)")
        for kind, dist in sorted(self.handoffs_by_kind.items()):
            late_here = [h for h in self.handoffs if h.fault == kind and h.late]
            never = sum(h.seconds is None for h in self.handoffs if h.fault == kind)
            lines.append(f"  {kind}: {dist}"
                         + (f", late {len(late_here)} ({sum(h.alone for h in late_here)} alone)" if late_here else "")
                         + (f", never {never}" if never else ""))
        # The worst late hand-offs, those no other fault confounds first.
        worst = sorted(self.late_handoffs,
                       key=lambda h: (not h.alone, -(h.seconds if h.seconds is not None else math.inf)))
        for h in worst[:shown]:
            took = "never moved" if h.seconds is None else f"moved after {h.seconds:.3f}s"
            lines.append(f"  late hand-off {h.fault}#{h.fault_id} on {h.target} at {h.began:.3f} (over "
                         f"{h.ended - h.began:.3f}s): {h.key} {took}, bound {h.bound:.3f}s"
                         + ("" if h.alone else ", other faults meanwhile"))
        return lines


# --- intervals ---------------------------------------------------------------------------------


class _Union:
    """A union of intervals, for the length of its overlap with ``[a, b)`` in O(log n)."""

    def __init__(self, intervals: Iterable[Interval]) -> None:
        merged: list[list[float]] = []
        for a, b in sorted(i for i in intervals if i[1] > i[0]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]
        self.before = [0.0]
        for a, b in merged:
            self.before.append(self.before[-1] + b - a)

    def _covered_until(self, t: float) -> float:
        """Length of the union before ``t``."""
        i = bisect.bisect_right(self.starts, t)
        if i == 0:
            return 0.0
        return self.before[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def covered(self, a: float, b: float) -> float:
        return max(0.0, self._covered_until(b) - self._covered_until(a)) if b > a else 0.0

    def parts(self, a: float, b: float) -> list[Interval]:
        """The parts of ``[a, b)`` inside the union."""
        out: list[Interval] = []
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.starts) and self.starts[i] < b:
            lo, hi = max(a, self.starts[i]), min(b, self.ends[i])
            if hi > lo:
                out.append((lo, hi))
            i += 1
        return out

    def gaps(self, a: float, b: float) -> list[Interval]:
        """The parts of ``[a, b)`` outside the union."""
        out: list[Interval] = []
        cursor = a
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while cursor < b and i < len(self.starts):
            s, e = self.starts[i], self.ends[i]
            if e <= cursor:
                i += 1
                continue
            if s >= b:
                break
            if s > cursor:
                out.append((cursor, s))
            cursor = max(cursor, e)
            i += 1
        if cursor < b:
            out.append((cursor, b))
        return out


# --- the log, read for liveness ------------------------------------------------------------------


@dataclass
class _Hold:
    w: str
    key: str
    start: float
    end: float


@dataclass
class _Fault:
    kind: str
    fault_id: Any
    target: str | None
    """A worker's name, or None: every worker (a server-side fault)."""
    start: float
    end: float


def _holds(ordered: Sequence[Record], end_of_log: float) -> list[_Hold]:
    open_: dict[tuple[str, str], float] = {}
    holds: list[_Hold] = []
    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "event":
            key, event = r.get("key"), r.get("event")
            if key is None:
                continue
            if event == "acquired":
                open_.setdefault((w, str(key)), t)
            elif event in SESSION_ENDS and (w, str(key)) in open_:
                holds.append(_Hold(w, str(key), open_.pop((w, str(key))), t))
        elif kind in PROCESS_ENDS or kind == "ready":
            for (hw, key) in [pair for pair in open_ if pair[0] == w]:
                holds.append(_Hold(w, key, open_.pop((hw, key)), t))
    holds.extend(_Hold(w, key, t, end_of_log) for (w, key), t in open_.items())
    return holds


def _spans(ordered: Sequence[Record], begin: str, end: Iterable[str], end_of_log: float) -> dict[str, list[Interval]]:
    """Per worker, the intervals from a ``begin`` record to the next of ``end`` (or a process end)."""
    ends = frozenset(end) | PROCESS_ENDS
    since: dict[str, float] = {}
    spans: dict[str, list[Interval]] = defaultdict(list)
    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == begin:
            since.setdefault(w, t)
        elif kind in ends and w in since:
            spans[w].append((since.pop(w), t))
    for w, t in since.items():
        spans[w].append((t, end_of_log))
    return spans


def _faults(ordered: Sequence[Record], end_of_log: float, workers: set[str]) -> list[_Fault]:
    ended = {r.get("id"): float(r["t"]) for r in ordered if r.get("kind") == "fault_end" and r.get("id") is not None}
    faults: list[_Fault] = []
    for r in ordered:
        if r.get("kind") != "fault":
            continue
        kind, t = str(r.get("fault", "")), float(r["t"])
        if kind == "block-loop":
            continue
        target = r.get("target")
        if kind.startswith(SERVER_SIDE):
            target = None
        elif target not in workers:
            continue
        end = t if kind == "kill-9" else ended.get(r.get("id"), end_of_log)
        faults.append(_Fault(kind, r.get("id"), None if target is None else str(target), t, max(t, end)))
    return faults


def _availability(ordered: Sequence[Record], holds: Sequence[_Hold], faults: Sequence[_Fault],
                  pauses: Mapping[str, Sequence[Interval]], blocks: Mapping[str, Sequence[Interval]],
                  end_of_log: float) -> tuple[list[Interval], dict[str, list[Interval]]]:
    """The intervals in which no worker was available, and per worker those in which it was not
    (module docstring)."""
    # (t, ends before begins at one instant, worker, field, delta); field "up" is set, not added.
    changes: list[tuple[float, int, str, str, int]] = []
    capacity: dict[str, float] = {}
    for r in ordered:
        kind, w, t = r.get("kind"), str(r.get("w")), float(r["t"])
        if kind == "ready":
            changes.append((t, 1, w, "up", 1))
            capacity[w] = r["concurrency"] if isinstance(r.get("concurrency"), int) else math.inf
        elif kind in PROCESS_ENDS:
            changes.append((t, 0, w, "up", 0))
    for f in faults:
        if f.target is not None and f.kind == "drain":
            changes.append((f.start, 0, f.target, "up", 0))
        if f.target is not None and f.kind in UNAVAILABLE:
            changes += [(f.start, 1, f.target, "cut", 1), (f.end, 0, f.target, "cut", -1)]
    for spans in (pauses, blocks):
        for w, intervals in spans.items():
            for a, b in intervals:
                changes += [(a, 1, w, "stopped", 1), (b, 0, w, "stopped", -1)]
    for h in holds:
        changes += [(h.start, 1, h.w, "holds", 1), (h.end, 0, h.w, "holds", -1)]
    changes.sort(key=lambda c: (c[0], c[1]))
    state: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def available(w: str) -> bool:
        s = state[w]
        return s["up"] > 0 and s["stopped"] <= 0 and s["cut"] <= 0 and s["holds"] < capacity.get(w, math.inf)

    unavailable: list[Interval] = []
    since: float | None = float(ordered[0]["t"]) if ordered else None
    first = float(ordered[0]["t"]) if ordered else 0.0
    away: dict[str, float] = {}  # an available worker is not in it; one unavailable since when
    apart: dict[str, list[Interval]] = defaultdict(list)
    for t, _, w, name, delta in changes:
        if name == "up":
            state[w]["up"] = delta
        else:
            state[w][name] += delta
        was = w not in away and w in apart
        if available(w) and not was:
            apart[w].append((away.pop(w, first), t))
        elif not available(w) and was:
            away[w] = t
        any_free = any(available(x) for x in state)
        if any_free and since is not None:
            unavailable.append((since, t))
            since = None
        elif not any_free and since is None:
            since = t
    if since is not None:
        unavailable.append((since, end_of_log))
    for w, t in away.items():
        apart[w].append((t, end_of_log))
    return unavailable, apart


class _KeyHolds:
    """One key's holds, for "which holds meet ``[a, b]``" in O(log n) plus the answer."""

    def __init__(self, holds: Iterable[_Hold]) -> None:
        self.holds = sorted(holds, key=lambda h: h.start)
        self.starts = [h.start for h in self.holds]
        self.longest = max((h.end - h.start for h in self.holds), default=0.0)

    def meeting(self, a: float, b: float) -> Iterable[_Hold]:
        i = bisect.bisect_right(self.starts, b)
        while i > 0 and self.starts[i - 1] >= a - self.longest:
            i -= 1
            h = self.holds[i]
            if h.end >= a:
                yield h


# --- the measures --------------------------------------------------------------------------------


def measure_liveness(records: Iterable[Record], bounds: LivenessBounds | None = None,
                     busy: Mapping[str, Sequence[Interval]] | None = None) -> Liveness:
    """Strands and hand-offs of a run log (module docstring); ``bounds`` None: report, never fail.
    ``busy``: per key, when a sync handler's body of it ran (a thread or child, from its run's
    ``start``, which may wait for a free thread or child, to its real end: :mod:`keyqueue.chaos.checker`'s
    bodies)."""
    ordered = sorted(records, key=lambda r: float(r["t"]))
    end_of_log = float(ordered[-1]["t"]) if ordered else 0.0
    lease_after = bounds.moved_after_loss if bounds is not None else 0.0
    workers = {str(r.get("w")) for r in ordered if r.get("kind") == "ready"}
    holds = _holds(ordered, end_of_log)
    pauses = _spans(ordered, "paused", ("resumed",), end_of_log)
    blocks = _spans(ordered, "blocked", ("unblocked",), end_of_log)
    faults = _faults(ordered, end_of_log, workers)
    # Pauses and blocks are faults on their worker too.
    faults += [_Fault("paused", None, w, a, b) for w, spans in pauses.items() for a, b in spans]
    faults += [_Fault("block-loop", None, w, a, b) for w, spans in blocks.items() for a, b in spans]
    faults.sort(key=lambda f: f.start)

    grouped: dict[str, list[_Hold]] = defaultdict(list)
    for h in holds:
        grouped[h.key].append(h)
    holds_by_key = {key: _KeyHolds(key_holds) for key, key_holds in grouped.items()}
    # A group whose leader died or was cut off has none until an election (up to ``election``
    # seconds), whenever the node comes back: the fault's effects last that long.
    election = bounds.election if bounds is not None else 0.0
    effect_end = {id(f): max(f.end, f.start + election) if f.kind.startswith(LEADERLESS) else f.end for f in faults}
    shadows: dict[str, list[Interval]] = defaultdict(list)
    for f in faults:
        for key, key_holds in holds_by_key.items():
            for h in key_holds.meeting(f.start, effect_end[id(f)]):
                if f.target is None or h.w == f.target:
                    shadows[key].append((max(f.start, h.start), effect_end[id(f)] + lease_after))
    stops = [*(i for spans in (pauses, blocks) for intervals in spans.values() for i in intervals),
             *((f.start, f.end) for f in faults if f.kind in UNAVAILABLE),
             *((float(r["t"]), float(r["t"])) for r in ordered if r.get("kind") in PROCESS_ENDS)]
    worker_stops: dict[str, list[Interval]] = defaultdict(list)
    for spans in (pauses, blocks):
        for w, intervals in spans.items():
            worker_stops[w] += intervals
    for f in faults:
        if f.kind in UNAVAILABLE and f.target is not None:
            worker_stops[f.target].append((f.start, f.end))
    stopped = _Union((a, max(b, a + 1e-6)) for a, b in stops)
    stopped_by = {w: _Union((a, max(b, a + 1e-6)) for a, b in spans) for w, spans in worker_stops.items()}
    lease, slack = (bounds.lease, bounds.slack) if bounds is not None else (0.0, 0.0)
    for r in ordered:
        delivered = r.get("delivered")
        if r.get("kind") == "event" and r.get("event") == "acquired" and isinstance(delivered, int):
            a = float(r["t"])
            window = (a - delivered * lease - slack, a)
            mine = stopped_by.get(str(r.get("w")))
            if (mine is not None and mine.covered(*window) > 0) or (delivered > 1 and stopped.covered(*window) > 0):
                shadows[str(r["key"])].append(window)
    ended: dict[str, list[Interval]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") in PROCESS_ENDS:
            ended[str(r.get("w"))].append((float(r["t"]), float(r["t"]) + 1e-6))
    unable_by = {w: _Union([*worker_stops.get(w, []), *ended.get(w, [])]) for w in {*worker_stops, *ended}}
    for key, token_spans in _tokens_with_the_unavailable(ordered, unable_by, end_of_log, lease).items():
        shadows[key] += token_spans
    nobody, apart = _availability(ordered, holds, faults, pauses, blocks, end_of_log)
    everywhere = [*nobody, *((f.start, effect_end[id(f)]) for f in faults if f.target is None)]

    stored: dict[tuple[str, str], float] = {}
    starts: dict[str, list[float]] = defaultdict(list)
    first_start: dict[tuple[str, str], float] = {}
    for r in ordered:
        kind = r.get("kind")
        if kind == "stored":
            stored.setdefault((str(r["key"]), str(r["tag"])), float(r["t"]))
        elif kind == "start":
            key, tag, t = str(r["key"]), str(r["tag"]), float(r["t"])
            starts[key].append(t)
            first_start.setdefault((key, tag), t)

    blocked = {key: _Union([*((h.start, h.end) for h in grouped.get(key, ())), *shadows.get(key, ()),
                            *everywhere]) for key in {k for k, _ in stored}}
    strands: list[Strand] = []
    stranded: list[Interval] = []
    for (key, tag), t_stored in stored.items():
        started = first_start.get((key, tag))
        until = end_of_log if started is None else started
        if until <= t_stored:
            strands.append(Strand(key, tag, 0.0, t_stored, started, (t_stored, t_stored)))
            continue
        gaps = blocked[key].gaps(t_stored, until)
        stranded += gaps
        seconds = sum(b - a for a, b in gaps)
        longest = max(gaps, key=lambda g: g[1] - g[0], default=(t_stored, t_stored))
        strands.append(Strand(key, tag, seconds, t_stored, started, longest))
    strands.sort(key=lambda s: -s.seconds)
    silences = _silences(ordered, workers, _Union(stranded), apart, end_of_log)

    deaths: dict[str, list[float]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") in PROCESS_ENDS:
            deaths[str(r.get("w"))].append(float(r["t"]))
    handoffs = _handoffs(faults, holds_by_key, stored, first_start, starts, bounds, end_of_log, busy or {}, deaths,
                         effect_end, _Union(nobody))
    by_kind: dict[str, list[float]] = defaultdict(list)
    for handoff in handoffs:
        by_kind[handoff.fault].append(handoff.seconds if handoff.seconds is not None
                                      else end_of_log - handoff.began)
    return Liveness(bounds, tuple(strands), tuple(handoffs),
                    {kind: Distribution.of(values) for kind, values in by_kind.items()}, silences)


def _silences(ordered: Sequence[Record], workers: Iterable[str], stranded: _Union,
              apart: Mapping[str, Sequence[Interval]], end_of_log: float) -> tuple[Silence, ...]:
    """Each worker's longest silence (module docstring): between two of its records (or its last
    and the end of the log), the strand time of any request in which it was available."""
    heard: dict[str, list[float]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") != "dumped":  # the soak asked it (fleet.SilenceWatch): no sign of work
            heard[str(r.get("w"))].append(float(r["t"]))
    found: list[Silence] = []
    for w in sorted(workers):
        unable = _Union(apart.get(w, ()))
        times = heard[w]
        best = Silence(w, 0.0, times[0] if times else 0.0, None)
        for a, b in zip(times, [*times[1:], None], strict=True):
            until = end_of_log if b is None else b
            seconds = sum(hi - lo - unable.covered(lo, hi) for lo, hi in stranded.parts(a, until))
            if seconds > best.seconds:
                best = Silence(w, seconds, a, b)
        found.append(best)
    return tuple(sorted(found, key=lambda x: -x.seconds))


def _tokens_with_the_unavailable(ordered: Sequence[Record], stopped_by: Mapping[str, _Union],
                                 end_of_log: float, lease: float = 0.0) -> dict[str, list[Interval]]:
    """Key -> the intervals its token spent with a worker that was unavailable meanwhile: from a
    ``token`` event (the worker received the key's token) until the key's next token or
    acquisition anywhere, when that worker was stopped, cut off, slowed or died in between (it
    could not act on the token, which waits its ack wait before the server delivers it again); and
    at least until that worker's claim ended (``CLAIM_LEASES`` leases at most: see the module
    docstring)."""
    marks: dict[str, list[tuple[float, str | None]]] = defaultdict(list)
    claim_ends: dict[tuple[str, str], list[float]] = defaultdict(list)
    process_ends: dict[str, list[float]] = defaultdict(list)
    for r in ordered:
        if r.get("kind") in PROCESS_ENDS:
            process_ends[str(r.get("w"))].append(float(r["t"]))
        if r.get("kind") != "event" or r.get("key") is None:
            continue
        event = r.get("event")
        if event in ("token", "acquired"):
            marks[str(r["key"])].append((float(r["t"]), str(r.get("w")) if event == "token" else None))
        if event in CLAIM_ENDS:
            claim_ends[(str(r["key"]), str(r.get("w")))].append(float(r["t"]))
    found: dict[str, list[Interval]] = defaultdict(list)
    for key, seen in marks.items():
        for (t, w), (until, _) in zip(seen, [*seen[1:], (end_of_log, None)], strict=True):
            unable = stopped_by.get(w) if w is not None else None
            if w is None or unable is None or unable.covered(t, max(until, t + 1e-6)) <= 0:
                continue
            ends = claim_ends.get((key, w), [])
            i = bisect.bisect_left(ends, t)
            deaths = process_ends.get(w, [])
            j = bisect.bisect_left(deaths, t)
            claim_end = min(ends[i] if i < len(ends) else math.inf, t + CLAIM_LEASES * lease,
                            deaths[j] + lease if j < len(deaths) else math.inf, end_of_log)
            found[key].append((t, max(until, claim_end)))
    return found


def _handoffs(faults: Sequence[_Fault], holds_by_key: Mapping[str, _KeyHolds],
              stored: Mapping[tuple[str, str], float], first_start: Mapping[tuple[str, str], float],
              starts: Mapping[str, Sequence[float]], bounds: LivenessBounds | None,
              end_of_log: float, busy: Mapping[str, Sequence[Interval]],
              deaths: Mapping[str, Sequence[float]] | None = None,
              effect_end: Mapping[int, float] | None = None, nobody: _Union | None = None) -> list[Handoff]:
    """Each fault's hand-offs (module docstring); ``nobody``: when no worker was available."""
    latest_stored: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for (key, tag), t in stored.items():
        latest_stored[key].append((t, tag))
    for entries in latest_stored.values():
        entries.sort()
    found: list[Handoff] = []
    fault_starts = [f.start for f in faults if f.kind != "paused"]
    for f in faults:
        if f.kind == "paused":
            continue  # a pause is measured under the process fault that caused it
        # Faults begun before this one and still in effect when it began (see "alone").
        active = [g for g in faults if g.start < f.start and g.kind != "paused"
                  and (effect_end or {}).get(id(g), g.end) > f.start]
        for key, key_holds in holds_by_key.items():
            holders = [h.w for h in key_holds.meeting(f.start, f.start)
                       if (f.target is None or h.w == f.target) and h.start <= f.start <= h.end]
            if not holders:
                continue
            entries = latest_stored.get(key, [])
            i = bisect.bisect_right(entries, (f.start, "\uffff"))
            if i == 0:
                continue
            _, tag = entries[i - 1]
            if first_start.get((key, tag), math.inf) <= f.start:
                continue
            key_starts = starts.get(key, [])
            j = bisect.bisect_right(key_starts, f.start)
            begin = max([f.start, *(b1 for b0, b1 in busy.get(key, ()) if b0 <= f.start < b1)])
            moved = max(0.0, key_starts[j] - begin) if j < len(key_starts) else None
            until = key_starts[j] if j < len(key_starts) else end_of_log
            others = bisect.bisect_right(fault_starts, until) - bisect.bisect_right(fault_starts, f.start)
            others += sum(1 for g in active if g.target is None or g.target in holders)
            bound = _bound(f, bounds)
            # The holder's process ended after the fault began (its loop watchdog or lease alarm
            # ended it, under this fault or another): its keys move once their leases end, which
            # the fault cannot hasten. They are owed that from the death (the kill-9 bound).
            died = min((t for w in holders for t in (deaths or {}).get(w, ()) if f.start < t <= until), default=None)
            if died is not None and bound is not None and bounds is not None:
                bound = max(bound, died - f.start + bounds.moved_after_loss)
            # Nobody could take the key meanwhile (the other workers full, stopped or not yet up),
            # after the fault's own span, which its bound gives in full.
            if bound is not None and nobody is not None:
                bound += nobody.covered(f.end, until)
            found.append(Handoff(f.kind, f.fault_id, f.target or "*", key, f.start, f.end, moved,
                                 bound, alone=others == 0))
    return found


def _bound(f: _Fault, bounds: LivenessBounds | None) -> float | None:
    if bounds is None or f.kind in UNBOUNDED:
        return None
    if f.kind == "kill-9":
        return bounds.moved_after_loss
    length = f.end - f.start
    if f.kind.startswith(LEADERLESS):
        return max(length + bounds.resume, bounds.election + bounds.moved_after_loss)
    if length < bounds.lease:
        return length + bounds.resume
    return max(length + bounds.resume, bounds.moved_after_loss)
