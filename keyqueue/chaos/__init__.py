"""Reusable parts of keyqueue's chaos harness: fault injection, a fenced store, a verdict.

    proxy.FaultProxy      a TCP proxy per worker: blackhole/heal, reset, latency, bandwidth, refuse
    proxy.FaultScript     a seeded sequence of those faults against a list of proxies
    fenced.FencedStore    a downstream store on JetStream that refuses writes with stale fencing
    checker.check         the verdict on a run log: overlaps, order, loss, duplicates, stale writes

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
from keyqueue.chaos.proxy import (
    DEFAULT_FAULTS,
    FaultKind,
    FaultProxy,
    FaultScript,
    FaultSpec,
    InjectedFault,
    PlannedFault,
    ProxyStats,
)

__all__ = [
    "DEFAULT_FAULTS",
    "FENCE_STREAM",
    "FENCE_SUBJECTS",
    "FaultKind",
    "FaultProxy",
    "FaultScript",
    "FaultSpec",
    "FenceSnapshot",
    "FencedRecord",
    "FencedStore",
    "Fencing",
    "InjectedFault",
    "OrderViolation",
    "Overlap",
    "PlannedFault",
    "ProxyStats",
    "Run",
    "StaleWrite",
    "Verdict",
    "WriteOutcome",
    "build_runs",
    "check",
    "read_log",
]
