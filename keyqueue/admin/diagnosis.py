"""Why is this key waiting? One key's holder, head request, what blocks it, and its place in line.

``keyqueue inspect QUEUE KEY`` prints a :class:`KeyDiagnosis` and the dashboard's key page shows
the same one. It is read from the server, whoever asks, in a dozen reads:

- the key's token (held or waiting, and its sequence) and the token consumer's delivered
  sequence: a waiting key's *position* is how many tokens the consumer delivers before it;
- the key's lease record (holder, since, fencing number, last renewal, when the lease ends) and the
  worker registry (is that holder alive: pid, host, last heartbeat), judged by the server's clock
  (``keyqueue.admin.workers.server_time``), as ``keyqueue release`` judges it;
- the key's first stored request (task, arguments, when it was stored: how long it waits);
- the key's last lifecycle events (:mod:`keyqueue.admin.key_history`): how many attempts the head
  request made, since when it runs, its last error and when it is retried next;
- a rate-limited task's recent runs on the key, and the head request's last kept progress
  (``keyqueue.jetstream.records``, ``keyqueue.app.progress``).

What blocks a key (:class:`Blocker`) is derived from those facts alone (:func:`blockers`, pure):
no live worker serves the queue; a live worker holds it (running its head request, waiting out a
retry backoff or a rate limit); a worker that is gone left its lease, which ends at a known time;
the key is changing hands; it waits for a free slot; it has requests but no token.

Progress *messages* are not stored (``ctx.progress`` publishes on core NATS: the dashboard follows
them live); what is stored is each request's last progress, coalesced (``keyqueue.app.progress``),
which both the command line and the dashboard show for the head request.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from keyqueue.admin.inspection import Holder, TokenState, holder_of, parse_time
from keyqueue.admin.key_history import StoredEvent, latest_events
from keyqueue.admin.workers import WorkerState, queue_workers, server_time
from keyqueue.app.progress import kept_progress
from keyqueue.app.workflows import step_of
from keyqueue.errors import StreamNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.subjects import QueueNames, validate_key
from keyqueue.tasks.context import Progress
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

__all__ = ["Blocker", "BlockerKind", "HeadRequest", "KeyDiagnosis", "RateWindow", "blockers", "diagnose_key"]

BlockerKind = Literal["no-worker", "running", "retry-backoff", "rate-limit", "held", "gone-holder",
                      "changing-hands", "waiting-for-slot", "no-token", "empty-token"]

_FINISHED: Final = frozenset({"succeeded", "dead_lettered", "superseded", "cancelled"})

TTL_HEADER: Final = "Nats-TTL"


@dataclass(frozen=True, slots=True)
class HeadRequest:
    """The key's first stored request: the next to run, or the one running."""

    seq: int
    """Its sequence in the inbox stream."""
    request_id: str
    task: str
    arguments: Any
    """Its body decoded to plain values (a short text if it does not decode)."""
    stored: float | None
    """When the server stored it (Unix seconds)."""
    attempts: int | None = None
    """Attempts made so far (the one under way included), from its events; None if none is stored."""
    running_since: float | None = None
    """When its current attempt started, while it runs."""
    last_error: str | None = None
    """The error of its last failed attempt."""
    next_retry: float | None = None
    """When its next attempt is due, while it waits out a retry backoff."""
    workflow: tuple[str, int, str] | None = None
    """``(workflow id, step, queue where it is kept)`` when the request is a step of a workflow."""


@dataclass(frozen=True, slots=True)
class RateWindow:
    """A rate-limited task's recent runs on the key (what its rate limit counts)."""

    task: str
    starts: list[float]
    """Start times of its runs inside the window, oldest first."""
    period: float
    """The limit's period in seconds."""

    @property
    def frees_at(self) -> float | None:
        """When the oldest run leaves the window (then one more may start)."""
        return self.starts[0] + self.period if self.starts else None


@dataclass(frozen=True, slots=True)
class Blocker:
    """One reason the key's next request does not run now."""

    kind: BlockerKind
    text: str
    """What it is, for people, with what ends it."""
    until: float | None = None
    """When it ends, when that is known (Unix seconds; a lease's end is by the server's clock)."""


@dataclass(frozen=True)
class KeyDiagnosis:
    """Everything :func:`diagnose_key` found about one key, and what blocks it."""

    queue: str
    key: str
    backlog: int
    token: TokenState
    token_seq: int | None
    holder: Holder | None
    holder_worker: WorkerState | None
    """The holder's registry entry (pid, host, liveness), when it has one."""
    head: HeadRequest | None
    position: int | None
    """For a waiting key: tokens the consumer delivers before its own, itself included."""
    waiting_tokens: int
    """Tokens waiting for a worker on the whole queue."""
    live_workers: list[WorkerState]
    ack_wait: float
    rate: RateWindow | None = None
    blockers: list[Blocker] = field(default_factory=list)
    checked: float = 0.0
    """When this was read (Unix seconds)."""
    progress: Progress | None = None
    """The last progress kept for the head request (``ctx.progress``, ``keyqueue.app.progress``)."""

    @property
    def state(self) -> str:
        """``idle``, ``running``, ``waiting`` or ``blocked``, in one word."""
        if self.token == "none" and not self.backlog:
            return "idle"
        if any(b.kind == "running" for b in self.blockers):
            return "running"
        if self.blockers and all(b.kind in ("waiting-for-slot", "held") for b in self.blockers):
            return "waiting"
        return "blocked"

    @property
    def waited(self) -> float | None:
        """How long the head request has waited since it was stored (seconds)."""
        if self.head is None or self.head.stored is None:
            return None
        return max(0.0, self.checked - self.head.stored)


async def diagnose_key(api: JetStreamApi, queue: str, key: str, *, now: float | None = None) -> KeyDiagnosis:
    """What ``key`` of ``queue`` holds and why it waits (``InvalidKey`` for a key that cannot be one,
    ``StreamNotFound`` if the queue does not exist)."""
    names = QueueNames(queue)
    validate_key(key)
    consumer = await api.consumer_info(names.token_stream, names.consumer)
    checked = now if now is not None else await server_time(api, names.lease_stream)
    delivered = int((consumer.get("delivered") or {}).get("stream_seq", 0))
    ack_wait = int((consumer.get("config") or {}).get("ack_wait", 0)) / 1e9
    token, record, head_msg, backlog, workers, latest = await asyncio.gather(
        api.get_msg(names.token_stream, last_by_subject=names.token(key), direct=False),
        _lease_record(api, names, key),
        api.get_msg(names.inbox_stream, seq=1, next_by_subject=names.inbox(key), direct=False),
        api.subjects(names.inbox_stream, names.inbox(key)),
        queue_workers(api, queue, now=checked),
        latest_events(api, queue, key),
    )
    if head_msg is not None and H.is_release_marker(head_msg.headers):
        # A former holder's release marker (it lives a second, before any request): not a request.
        backlog = {subject: count - 1 for subject, count in backlog.items()}
        head_msg = await api.get_msg(names.inbox_stream, seq=head_msg.seq + 1, next_by_subject=names.inbox(key),
                                     direct=False)
    token_state: TokenState = "none" if token is None else "held" if token.seq <= delivered else "scheduled"
    holder = holder_of(record) if record is not None else None
    holder_worker = next((w for w in workers if holder is not None and w.name == holder.worker), None)
    head = _head(head_msg, latest) if head_msg is not None else None
    rate, progress = await asyncio.gather(
        _rate_window(api, queue, key, head.task, checked) if head is not None and head.task else _nothing(),
        _kept_progress(api, queue, head.request_id) if head is not None and head.request_id else _nothing())
    diagnosis = KeyDiagnosis(
        queue=queue, key=key, backlog=sum(backlog.values()), token=token_state,
        token_seq=token.seq if token is not None else None, holder=holder if token_state == "held" else None,
        holder_worker=holder_worker if token_state == "held" else None, head=head,
        position=token.seq - delivered if token is not None and token_state == "scheduled" else None,
        waiting_tokens=int(consumer.get("num_pending", 0)), live_workers=[w for w in workers if w.live],
        ack_wait=ack_wait, rate=rate, checked=checked, progress=progress)
    diagnosis.blockers.extend(blockers(diagnosis))
    return diagnosis


def blockers(d: KeyDiagnosis) -> list[Blocker]:
    """What keeps ``d``'s next request from running now, most decisive first (pure)."""
    found: list[Blocker] = []
    if d.token == "none" and not d.backlog:
        return found
    if not d.live_workers:
        found.append(Blocker("no-worker", f"no worker serves queue {d.queue}: no live heartbeat record (start one: "
                                          f"keyqueue worker MODULE:APP)"))
    if d.token == "held" and d.holder is not None:
        found.extend(_held(d))
    elif d.token == "held":
        found.append(Blocker("changing-hands", "its token is delivered but no lease record names a holder: a worker "
                                               "is taking or giving back the key right now, or its holder's lease "
                                               f"lapsed and the token is delivered again within ack_wait "
                                               f"({d.ack_wait:g}s)"))
    elif d.token == "scheduled":
        slots = sum(w.record.slots for w in d.live_workers)
        full = f"; {len(d.live_workers)} live worker(s) with {slots} slot(s) in all" if d.live_workers else ""
        if d.backlog:
            found.append(Blocker("waiting-for-slot", f"waiting for a free worker slot: position {d.position} of "
                                                     f"{d.waiting_tokens} waiting keys{full}"))
        else:
            found.append(Blocker("empty-token", "a token without requests: its next holder finds nothing and gives "
                                                "the key back"))
    elif d.backlog:
        found.append(Blocker("no-token", f"{d.backlog} request(s) but no token: the reconciler gives the key one "
                                         "(when a worker starts, and periodically)"))
    return found


def _held(d: KeyDiagnosis) -> list[Blocker]:
    assert d.holder is not None
    h, worker = d.holder, d.holder_worker
    ends = h.lease_ends.timestamp() if h.lease_ends is not None else None
    if worker is not None and not worker.live:
        return [Blocker("gone-holder", f"held by {h.worker}, which is gone ({worker.gone_because}, last heartbeat "
                                       f"{_clock(worker.received)}); its lease ends at {_clock(ends)}, then the key "
                                       f"moves to another worker (or now: keyqueue release {d.queue} {d.key})", ends)]
    if worker is None and ends is not None and ends < d.checked:
        return [Blocker("gone-holder", f"held by {h.worker or 'a worker'} whose lease record was last renewed at "
                                       f"{_clock(h.renewed.timestamp() if h.renewed else None)} and has lapsed "
                                       f"(ended {_clock(ends)}): the key moves within ack_wait ({d.ack_wait:g}s)",
                        ends)]
    who = h.worker or "a worker"
    if worker is not None:
        who += f" (pid {worker.record.pid} on {worker.record.host})"
    head = d.head
    if head is not None and head.next_retry is not None:
        return [Blocker("retry-backoff", f"held by {who}; attempt {head.attempts} of request {head.request_id} "
                                         f"failed ({head.last_error or 'error'}): next attempt at "
                                         f"{_clock(head.next_retry)}", head.next_retry)]
    rate, frees = d.rate, d.rate.frees_at if d.rate is not None else None
    # The started hook fires before a rate-limited run waits for its slot; the run's own start is
    # written to the window once it takes the slot: a window whose newest start is older than the
    # head's start event means the head is still waiting for it.
    if head is not None and rate is not None and frees is not None and frees > d.checked and (
            head.running_since is None or max(rate.starts) < head.running_since):
        return [Blocker("rate-limit", f"held by {who}; the rate limit of task {rate.task}: {len(rate.starts)} "
                                      f"run(s) in the last {rate.period:g}s, the oldest leaves the window at "
                                      f"{_clock(frees)}", frees)]
    if head is not None and head.running_since is not None:
        return [Blocker("running", f"held by {who}, running request {head.request_id} ({head.task}) since "
                                   f"{_clock(head.running_since)}, attempt {head.attempts}")]
    return [Blocker("held", f"held by {who}" + (f", about to run request {head.request_id}" if head else
                                                  ", finishing (no request left)"))]


def _head(msg: Any, latest: dict[str, StoredEvent]) -> HeadRequest:
    headers = msg.headers
    request_id = headers.get(H.MSG_ID, "")
    try:
        arguments: Any = loads(msg.data, headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
    except WireError as exc:
        arguments = f"<{len(msg.data)} bytes that do not decode: {exc}>"
    stored = parse_time(msg.timestamp)
    started, retried = latest.get("started"), latest.get("retried")
    attempts = running = error = retry = None
    mine = [e for e in latest.values() if e.request_id == request_id and request_id]
    finished = any(e.event in _FINISHED for e in mine)
    if started is not None and started.request_id == request_id and request_id and not finished:
        attempts = started.attempt
        if retried is not None and retried.request_id == request_id and retried.order > started.order:
            error = retried.reason
            retry = retried.ts + (retried.delay or 0.0)
        else:
            running = started.ts
            if retried is not None and retried.request_id == request_id:
                error = retried.reason
    elif retried is not None and retried.request_id == request_id and request_id and not finished:
        attempts, error, retry = retried.attempt, retried.reason, retried.ts + (retried.delay or 0.0)
    step = step_of(headers)
    return HeadRequest(msg.seq, request_id, headers.get(H.MESSAGE_TYPE, ""), arguments,
                       stored.timestamp() if stored else None, attempts, running, error, retry,
                       (step.workflow_id, step.step, step.queue) if step is not None else None)


async def _lease_record(api: JetStreamApi, names: QueueNames, key: str) -> Any:
    try:
        return await api.get_msg(names.lease_stream, last_by_subject=names.lease(key), direct=False)
    except StreamNotFound:
        return None


async def _nothing() -> None:
    return None


async def _kept_progress(api: JetStreamApi, queue: str, request_id: str) -> Progress | None:
    records = RequestRecords(api.nc, queue)
    try:
        stored = await api.get_msg(records.stream, last_by_subject=records.progress_subject(request_id), direct=False)
    except StreamNotFound:
        return None
    return kept_progress(stored, request_id)


async def _rate_window(api: JetStreamApi, queue: str, key: str, task: str, now: float) -> RateWindow | None:
    records = RequestRecords(api.nc, queue)
    try:
        stored = await api.get_msg(records.stream, last_by_subject=records.runs_subject(task, key), direct=False)
    except StreamNotFound:
        return None
    if stored is None or not stored.data:
        return None
    try:
        starts = sorted(float(t) for t in json.loads(stored.data))
        ttl = float(stored.headers.get(TTL_HEADER, "").rstrip("s") or 0)
    except (ValueError, TypeError):
        return None
    # The holder keeps the record for the limit's period and one second more (RecordingTaskProcessor).
    period = max(0.0, ttl - 1)
    inside = [t for t in starts if t + period > now]
    return RateWindow(task, inside, period) if period and inside else None


def _clock(ts: float | None) -> str:
    return "?" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S UTC")
