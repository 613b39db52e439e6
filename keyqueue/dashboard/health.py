"""``GET /health``: a verdict per queue, for load balancers and alerting.

Each queue is judged from the dashboard's last snapshot (so a health check costs no read of the
server) by :func:`judge`, which is pure:

- ``fail``: requests are stored and no live worker serves the queue (with how much the backlog grew
  over the last minute); the oldest stored request has waited longer than ``--max-wait``; a
  worker that is gone left keys held past twice their lease (the server failed to expire them).
- ``warn``: the DLQ grew over the last five minutes; keys are held by a worker that is gone (they
  move when its lease ends).
- ``ok`` otherwise.

The answer is JSON: ``{"status": ..., "checked": ..., "queues": {name: {"status", "reasons", ...}}}``,
with HTTP 503 when any queue fails, else 200. Without credentials (where credentials are
required) it says only the overall status.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from keyqueue.admin.inspection import QueueReport
from keyqueue.admin.workers import WorkerState

__all__ = ["DLQ_SPAN", "GROWTH_SPAN", "Health", "Status", "Verdict", "judge", "overall"]

Status = Literal["ok", "warn", "fail"]

GROWTH_SPAN: Final = 60.0
"""Seconds over which a backlog's growth is measured."""

DLQ_SPAN: Final = 300.0
"""Seconds over which the DLQ's growth is measured."""

_RANK: Final = {"ok": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Verdict:
    """One queue's health."""

    queue: str
    status: Status
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Health:
    """What ``/health`` answers."""

    status: Status
    checked: float
    queues: list[Verdict]

    def fields(self, *, detailed: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status,
                                "checked": datetime.fromtimestamp(self.checked, UTC).isoformat(timespec="seconds")}
        if detailed:
            body["queues"] = {v.queue: {"status": v.status, "reasons": v.reasons, **v.figures} for v in self.queues}
        return body


def judge(report: QueueReport, workers: Sequence[WorkerState], *, now: float, max_wait: float,
          backlog_then: int | None, dlq_then: int | None) -> Verdict:
    """The verdict on one queue: ``backlog_then`` and ``dlq_then`` are its backlog ``GROWTH_SPAN``
    seconds ago and its DLQ ``DLQ_SPAN`` seconds ago (None when the dashboard has not run that long)."""
    live = [w for w in workers if w.live]
    live_names = {w.name for w in live}
    gone = {w.name for w in workers if not w.live}
    stamps = [t.timestamp() for t in (report.oldest_request, report.oldest_unkeyed) if t is not None]
    oldest = now - min(stamps) if stamps else None
    backlog = report.requests + report.unkeyed
    held_by_gone = [k for k in report.keys if k.holder is not None and k.holder.worker in gone]
    overdue = [k for k in held_by_gone if k.holder is not None and k.holder.renewed is not None
               and k.holder.ttl is not None and now - k.holder.renewed.timestamp() > 2 * k.holder.ttl]
    grew = backlog - backlog_then if backlog_then is not None else None
    dlq_grew = report.dlq_size - dlq_then if dlq_then is not None else None
    fails: list[str] = []
    warns: list[str] = []
    if backlog and not live:
        growth = f", {grew:+d} in the last {GROWTH_SPAN:g}s" if grew is not None else ""
        fails.append(f"{backlog} request(s) stored{growth} and no live worker serves the queue")
    if oldest is not None and oldest > max_wait:
        fails.append(f"the oldest stored request has waited {oldest:.0f}s (bound {max_wait:g}s)")
    if overdue:
        fails.append(f"{len(overdue)} key(s) held by a gone worker past twice their lease "
                     f"({', '.join(k.key for k in overdue[:5])})")
    elif held_by_gone:
        warns.append(f"{len(held_by_gone)} key(s) held by a gone worker until its lease ends "
                     f"({', '.join(k.key for k in held_by_gone[:5])})")
    if dlq_grew is not None and dlq_grew > 0:
        warns.append(f"the DLQ grew by {dlq_grew} in the last {DLQ_SPAN / 60:g} min ({report.dlq_size} now)")
    status: Status = "fail" if fails else "warn" if warns else "ok"
    figures = {"backlog": backlog, "unkeyed": report.unkeyed, "backlog_growth": grew, "oldest_wait_s": oldest,
               "live_workers": len(live_names), "dlq": report.dlq_size, "dlq_growth": dlq_grew,
               "keys_held_by_gone_workers": len(held_by_gone)}
    return Verdict(report.queue, status, fails + warns, figures)


def overall(verdicts: Sequence[Verdict]) -> Status:
    """The worst verdict (``ok`` without any queue)."""
    worst: Status = "ok"
    for v in verdicts:
        if _RANK[v.status] > _RANK[worst]:
            worst = v.status
    return worst
