"""Reusable parts of keyqueue's chaos harness: fault injection, a fenced store, a verdict.

    proxy.FaultProxy      a TCP proxy per worker (or per route): blackhole/heal, reset, latency, bandwidth, refuse
    proxy.ProxyGroup      several proxies faulted as one (a worker's proxies to every node of a cluster)
    proxy.FaultScript     a seeded sequence of those faults against a list of proxies or groups
    fenced.FencedStore    a downstream store on JetStream that refuses writes with stale fencing
    checker.check         the verdict on a run log: overlaps, order, loss, duplicates, stale writes, liveness
    liveness              strands (a request waiting for nobody) and hand-offs (a fault's keys moving), bounded
    clock                 a worker process whose wall clock is tens of seconds off (the run log stays true)
    fleet, injectors      the soak's worker processes and its fault injectors (process, server, cluster nodes)
    handlers              the handler shapes a worker runs (async, thread, process pool, GIL, blocking) and bad input

A soak wires them together: each worker process connects through its own ``FaultProxy``, its
processor writes every run through a ``FencedStore`` and logs ``start`` / ``write`` / ``end``
records, the soak logs ``killed`` / ``paused`` / ``resumed`` records and runs a ``FaultScript``,
and at the end ``check(read_log(path), expected, store_history=snapshot.history())`` decides.
"""

from __future__ import annotations

from keyqueue.chaos.checker import OrderViolation, Overlap, Run, StaleWrite, Verdict, build_runs, check, read_log
from keyqueue.chaos.fenced import (
    FENCE_STREAM,
    FENCE_SUBJECTS,
    FencedRecord,
    FencedStore,
    FenceSnapshot,
    Fencing,
    WriteOutcome,
)
from keyqueue.chaos.liveness import Distribution, Handoff, Liveness, LivenessBounds, Strand, measure_liveness
from keyqueue.chaos.proxy import (
    DEFAULT_FAULTS,
    Faultable,
    FaultKind,
    FaultProxy,
    FaultScript,
    FaultSpec,
    InjectedFault,
    PlannedFault,
    ProxyGroup,
    ProxyStats,
)

__all__ = [
    "DEFAULT_FAULTS",
    "FENCE_STREAM",
    "FENCE_SUBJECTS",
    "Distribution",
    "FaultKind",
    "FaultProxy",
    "FaultScript",
    "FaultSpec",
    "Faultable",
    "FenceSnapshot",
    "FencedRecord",
    "FencedStore",
    "Fencing",
    "Handoff",
    "InjectedFault",
    "Liveness",
    "LivenessBounds",
    "OrderViolation",
    "Overlap",
    "PlannedFault",
    "ProxyGroup",
    "ProxyStats",
    "Run",
    "StaleWrite",
    "Strand",
    "Verdict",
    "WriteOutcome",
    "build_runs",
    "check",
    "measure_liveness",
    "read_log",
]
