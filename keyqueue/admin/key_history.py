"""A key's history, read from its queue's events stream: its last events and the runs they tell of.

Every lifecycle event of a key is stored on ``kq.<queue>.events.<event>.<key>``, or with others of the key
on ``kq.<queue>.events.batch.<key>``
(:mod:`keyqueue.events`), so the key's history is one subject filter,
``kq.<queue>.events.*.<key>``, whatever else the stream holds:

- :func:`latest_events`: the last event of each kind (one batched read of the last message of
  each of the key's few subjects): what ``keyqueue inspect QUEUE KEY`` needs to say how many
  attempts the head request made, since when it runs, when it is retried next.
- :func:`key_events`: the key's last events in order. JetStream reads forward only, so it starts
  a little before the key's last event and widens the span (a minute, an hour, a day, all)
  until it has enough: a key busy for days costs what its last minutes hold.
- :func:`runs_of`: those events as the timeline of runs a person reads: one row per attempt
  (holder, fencing number, outcome, duration) and per request that ended without one.

Events are best-effort telemetry (they may be sampled, or off): the history is what was stored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Final

from keyqueue.errors import StreamNotFound
from keyqueue.events import decode_events, events_stream, key_events_filter
from keyqueue.jetstream.api import JetStreamApi, StoredMsg

__all__ = ["KEY_EVENTS", "SPANS", "Run", "StoredEvent", "fields_of", "key_events", "latest_events", "runs_of"]

KEY_EVENTS: Final = 200
"""Events :func:`key_events` returns by default."""

SPANS: Final = (60.0, 3600.0, 86400.0, None)
"""Seconds before the key's last event that :func:`key_events` starts reading, widest last (None: all)."""

_ENDINGS: Final = {"succeeded", "retried", "dead_lettered"}
"""Events that end an attempt."""

_WITHOUT_RUN: Final = {"superseded", "cancelled"}
"""Events that end a request that did not run (again)."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One stored lifecycle event of a key (the fields of :data:`keyqueue.events.EVENT_FIELDS` it uses)."""

    seq: int
    """The stream sequence of the message that carried it (the events of one batch share it)."""
    ts: float
    event: str
    request_id: str | None = None
    task: str | None = None
    worker: str | None = None
    attempt: int | None = None
    wait: float | None = None
    run: float | None = None
    reason: str | None = None
    fence: int | None = None
    delay: float | None = None
    index: int = 0
    """Its place in that message (a batch's events share ``seq``)."""

    @property
    def order(self) -> tuple[int, int]:
        """Where it stands among the key's stored events (``seq``, then ``index``)."""
        return self.seq, self.index

    @classmethod
    def decode(cls, msg: StoredMsg) -> StoredEvent | None:
        """The (first) event in ``msg``, or None if it holds none."""
        found = cls.decode_all(msg)
        return found[0] if found else None

    @classmethod
    def decode_all(cls, msg: StoredMsg) -> list[StoredEvent]:
        """The events in ``msg``, in order: one, or several for a batch of the key's events."""
        return [cls._of(msg.seq, body, i) for i, body in enumerate(decode_events(msg.headers, msg.data))]

    @classmethod
    def _of(cls, seq: int, body: dict[str, Any], index: int = 0) -> StoredEvent:
        def text(name: str) -> str | None:
            value = body.get(name)
            return value if isinstance(value, str) else None

        def number(name: str) -> float | None:
            value = body.get(name)
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

        def whole(name: str) -> int | None:
            value = body.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(seq, number("ts") or 0.0, body["event"], text("request_id"), text("task"), text("worker"),
                   whole("attempt"), number("wait"), number("run"), text("reason"), whole("fence"), number("delay"),
                   index)


@dataclass(frozen=True, slots=True)
class Run:
    """One row of a key's timeline: an attempt of a request, or a request that ended without one."""

    request_id: str | None
    task: str | None
    attempt: int | None
    worker: str | None
    """The holder that ran it."""
    fence: int | None
    """The holder's fencing number (from its ``acquired`` event), when the history has it."""
    started: float | None
    """When the attempt started (None for a request that ended without running)."""
    ended: float | None
    """When it ended (None while it runs, or if the history stops before its end)."""
    outcome: str
    """``succeeded``, ``retried``, ``dead_lettered``, ``superseded``, ``cancelled``, ``running``, or
    ``interrupted`` (its holder gave the key up, or lost it, before the attempt ended)."""
    duration: float | None
    """The attempt's seconds (the event's ``run``, else ``ended - started``)."""
    reason: str | None = None
    """The error of a retried or dead-lettered attempt, why a request was superseded or cancelled."""


async def latest_events(api: JetStreamApi, queue: str, key: str) -> dict[str, StoredEvent]:
    """Event name -> the key's last stored event of that name ({} without an events stream)."""
    try:
        found, _ = await api.get_batch(events_stream(queue), multi_last=[key_events_filter(queue, key)], batch=100)
    except StreamNotFound:
        return {}
    latest: dict[str, StoredEvent] = {}
    for msg in sorted(found, key=lambda m: m.seq):
        # A batch (the last of the key's batches) holds several: the later of one name wins.
        for stored in StoredEvent.decode_all(msg):
            latest[stored.event] = stored
    return latest


async def key_events(api: JetStreamApi, queue: str, key: str, *, limit: int = KEY_EVENTS,
                     latest: dict[str, StoredEvent] | None = None) -> list[StoredEvent]:
    """The key's last ``limit`` stored events, oldest first ([] without an events stream).

    ``latest`` (what :func:`latest_events` returned) saves one read when the caller has it.
    """
    latest = await latest_events(api, queue, key) if latest is None else latest
    if not latest:
        return []
    last = max(latest.values(), key=lambda e: e.seq)
    stream, subject = events_stream(queue), key_events_filter(queue, key)
    window: deque[StoredEvent] = deque(maxlen=limit)
    for span in SPANS:
        window.clear()
        start = None if span is None else datetime.fromtimestamp(max(0.0, last.ts - span), UTC).isoformat()
        async for page in api.pages(stream, subject, start_time=start, batch=1000):
            window.extend(e for msg in page for e in StoredEvent.decode_all(msg))
            if page[-1].seq >= last.seq:
                break
        if len(window) >= limit:
            break
    return list(window)


def runs_of(events: list[StoredEvent]) -> list[Run]:
    """The timeline of runs the events (oldest first) tell of, newest first."""
    fences: dict[str | None, int | None] = {}
    """Worker -> the fencing number of its current holding."""
    open_runs: dict[tuple[str | None, int | None], tuple[StoredEvent, int | None]] = {}
    """(request id, attempt) -> its started event and the fence it ran under."""
    runs: list[Run] = []

    def interrupt(worker: str | None, at: float) -> None:
        for ident, (started, fence) in list(open_runs.items()):
            if started.worker == worker:
                del open_runs[ident]
                runs.append(Run(started.request_id, started.task, started.attempt, worker, fence, started.ts, at,
                                "interrupted", at - started.ts))

    for e in events:
        if e.event == "acquired":
            interrupt(e.worker, e.ts)  # a holder acquiring again lost its earlier holding
            fences[e.worker] = e.fence
        elif e.event == "released":
            interrupt(e.worker, e.ts)
            fences.pop(e.worker, None)
        elif e.event == "started":
            open_runs[(e.request_id, e.attempt)] = (e, fences.get(e.worker))
        elif e.event in _ENDINGS:
            opened = open_runs.pop((e.request_id, e.attempt), None)
            if opened is None and e.event != "retried":  # a dead_lettered event counts attempts, not the last one
                opened = next((open_runs.pop(ident) for ident in list(open_runs) if ident[0] == e.request_id), None)
            started, fence = opened if opened is not None else (None, fences.get(e.worker))
            begun = started.ts if started is not None else None
            duration = e.run if e.run is not None else (e.ts - begun if begun is not None else None)
            runs.append(Run(e.request_id, e.task, e.attempt if started is None else started.attempt,
                            e.worker, fence, begun, e.ts, e.event, duration,
                            e.reason if e.event != "succeeded" else None))
        elif e.event in _WITHOUT_RUN:
            # A cancelled request's start event fires before its holder sees the cancel, and the
            # processor reports it superseded as well: one row, "cancelled", for all of it.
            opened = next((open_runs.pop(ident) for ident in list(open_runs) if ident[0] == e.request_id), None)
            earlier = next((i for i, r in enumerate(runs) if r.request_id == e.request_id and r.outcome in _WITHOUT_RUN
                            and e.request_id), None)
            if earlier is not None:
                if e.event == "cancelled":
                    runs[earlier] = replace(runs[earlier], outcome="cancelled", reason=e.reason)
                continue
            started, fence = opened if opened is not None else (None, fences.get(e.worker))
            runs.append(Run(e.request_id, e.task, None, e.worker, fence, started.ts if started else None, e.ts,
                            e.event, None, e.reason))
    for started, fence in open_runs.values():
        runs.append(Run(started.request_id, started.task, started.attempt, started.worker, fence, started.ts, None,
                        "running", None))
    runs.sort(key=lambda r: r.ended if r.ended is not None else r.started or 0.0, reverse=True)
    return runs


def fields_of(run: Run) -> dict[str, Any]:
    """A run as plain JSON-able fields (``keyqueue inspect QUEUE KEY --json``)."""
    return {"request_id": run.request_id, "task": run.task, "attempt": run.attempt, "worker": run.worker,
            "fence": run.fence, "started": run.started, "ended": run.ended, "outcome": run.outcome,
            "duration": run.duration, "reason": run.reason}
