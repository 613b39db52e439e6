"""``keyqueue inspect QUEUE KEY``: one key's diagnosis (``keyqueue.admin.diagnosis``) as text or JSON.

The dashboard's key page shows the same diagnosis; this module only formats it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from keyqueue.admin.diagnosis import KeyDiagnosis
from keyqueue.admin.key_history import Run, fields_of
from keyqueue.cli.common import table, to_json
from keyqueue.tasks.context import Progress

__all__ = ["key_fields", "key_text", "progress_fields", "progress_text"]


def key_fields(d: KeyDiagnosis, runs: list[Run]) -> dict[str, Any]:
    """The diagnosis as one JSON object with stable keys (times as RFC 3339 UTC, durations in seconds)."""
    h, w, head = d.holder, d.holder_worker, d.head
    return {
        "queue": d.queue, "key": d.key, "state": d.state, "backlog": d.backlog, "token": d.token,
        "token_seq": d.token_seq, "position": d.position, "waiting_tokens": d.waiting_tokens,
        "waited": d.waited,
        "holder": None if h is None else {
            "worker": h.worker, "since": _iso(h.since.timestamp() if h.since else None),
            "renewed": _iso(h.renewed.timestamp() if h.renewed else None), "fence": h.fence,
            "lease_ends": _iso(h.lease_ends.timestamp() if h.lease_ends else None),
            "pid": w.record.pid if w else None, "host": w.record.host if w else None,
            "live": w.live if w else None},
        "head": None if head is None else {
            "seq": head.seq, "request_id": head.request_id, "task": head.task, "arguments": head.arguments,
            "stored": _iso(head.stored), "attempts": head.attempts, "running_since": _iso(head.running_since),
            "last_error": head.last_error, "next_retry": _iso(head.next_retry),
            "workflow": None if head.workflow is None else {
                "workflow_id": head.workflow[0], "step": head.workflow[1], "queue": head.workflow[2]},
            "progress": None if d.progress is None else progress_fields(d.progress)},
        "blockers": [{"kind": b.kind, "text": b.text, "until": _iso(b.until)} for b in d.blockers],
        "live_workers": len(d.live_workers),
        "runs": [{**fields_of(r), "started": _iso(r.started), "ended": _iso(r.ended)} for r in runs],
    }


def key_text(d: KeyDiagnosis, runs: list[Run]) -> str:
    """The diagnosis for people: state, holder, head request, what blocks it, its place, its last runs."""
    lines = [f"key {d.key} of queue {d.queue}: {d.state}",
             f"  backlog {d.backlog} request(s); token {d.token}" + (f" (seq {d.token_seq})" if d.token_seq else "")]
    if d.holder is not None:
        h, w = d.holder, d.holder_worker
        where = f" (pid {w.record.pid} on {w.record.host}, {'live' if w.live else 'gone: ' + str(w.gone_because)})" \
            if w else " (not in the worker registry)"
        lines.append(f"  holder: {h.worker or '?'}{where}")
        since = _iso(h.since.timestamp()) if h.since else "?"
        renewed = _iso(h.renewed.timestamp()) if h.renewed else "?"
        ends = _iso(h.lease_ends.timestamp()) if h.lease_ends else "?"
        lines.append(f"    since {since}, fencing {h.fence or '?'}, last renewal {renewed}, lease ends {ends}")
    head = d.head
    if head is not None:
        lines.append(f"  head request: {head.request_id} (task {head.task}, inbox seq {head.seq}), stored "
                     f"{_iso(head.stored) or '?'}")
        if head.attempts is not None:
            lines.append(f"    attempt {head.attempts}" + (f", running since {_iso(head.running_since)}"
                                                           if head.running_since else "")
                         + (f", last error: {head.last_error}" if head.last_error else "")
                         + (f", next attempt at {_iso(head.next_retry)}" if head.next_retry else ""))
        lines.append(f"    arguments: {to_json(head.arguments)}")
        if head.workflow is not None:
            lines.append(f"    step {head.workflow[1]} of workflow {head.workflow[0]} (keyqueue workflow show "
                         f"{head.workflow[0]})")
    if d.blockers:
        lines.append("  why:")
        lines += [f"    - {b.kind}: {b.text}" for b in d.blockers]
    if d.position is not None:
        lines.append(f"  position: {d.position} of {d.waiting_tokens} waiting key(s)")
    if d.waited is not None:
        lines.append(f"  waited: {d.waited:.1f}s since its head request was stored")
    if head is not None:
        lines.append(f"  last progress of {head.request_id}: {progress_text(d.progress)}")
    if runs:
        rows = [[_iso(r.started or r.ended) or "-", r.outcome, r.request_id or "-", r.task or "-",
                 r.attempt if r.attempt is not None else "-", r.worker or "-", r.fence or "-",
                 f"{r.duration:.3f}s" if r.duration is not None else "-"] for r in runs]
        lines += ["", "Runs, newest first:",
                  table(["WHEN", "OUTCOME", "REQUEST", "TASK", "ATTEMPT", "HOLDER", "FENCING", "DURATION"], rows)]
    return "\n".join(lines)


def progress_fields(p: Progress) -> dict[str, Any]:
    """A kept progress as JSON fields (``keyqueue inspect --json``, ``keyqueue status --progress --json``)."""
    return {"value": p.value, "task": p.task, "attempt": p.attempt,
            "reported_at": _iso(p.reported_at.timestamp() if p.reported_at else None)}


def progress_text(p: Progress | None) -> str:
    """A kept progress in one line: its value as JSON, the attempt that reported it and when."""
    if p is None:
        return "none kept (it reported none yet; keyqueue watch QUEUE KEY follows it live)"
    when = _iso(p.reported_at.timestamp()) if p.reported_at else "?"
    return f"{to_json(p.value)} (attempt {p.attempt}, {when})"


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
