"""The dashboard's audit log: every action, who took it and how many it touched, kept in a stream.

Each action an operator takes on the dashboard (replay, delete, purge, cancel, a bulk action) and
each one refused (a viewer's, a wrong CSRF token) is one JSON entry in the queue's audit stream
``KQ_<queue>_AUDIT``, on ``kq.<queue>.audit.<action>`` (limits retention, kept ``KEPT`` seconds),
and one line on the ``keyqueue.dashboard.audit`` logger. The Audit page lists the last entries
of every queue, newest first. Entries name the caller (the basic-auth user, ``token``,
``viewer token``, or ``local`` and the client address), never a secret.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final, Literal

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import validate_queue_name

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["KEPT", "AuditEntry", "AuditLog", "Outcome", "audit_stream", "entry"]

log = logging.getLogger("keyqueue.dashboard.audit")

KEPT: Final = 90 * 24 * 3600
"""Seconds an audit entry is kept."""

Outcome = Literal["done", "refused", "failed"]


def audit_stream(queue: str) -> str:
    return f"KQ_{validate_queue_name(queue)}_AUDIT"


@dataclass(frozen=True)
class AuditEntry:
    """One action on one queue."""

    ts: float
    queue: str
    who: str
    role: str
    action: str
    """``replay``, ``delete``, ``purge``, ``cancel``, ``bulk-replay``, ``bulk-delete``, ``bulk-cancel``, ..."""
    what: str
    """What it was applied to, for people (a key, a sequence, a filter)."""
    count: int
    """How many requests it touched."""
    outcome: Outcome
    detail: str = ""
    """What it did (``replayed 3 request(s)``) or why it was refused or failed."""

    def line(self) -> str:
        return (f"{self.who} ({self.role}): {self.action} on queue {self.queue} ({self.what}): {self.outcome}, "
                f"{self.count} touched" + (f"; {self.detail}" if self.detail else ""))


class AuditLog:
    """Writes entries to the queues' audit streams and reads the last ones back."""

    def __init__(self, nc: Client, *, kept: float = KEPT) -> None:
        self.api = JetStreamApi(nc)
        self.kept = kept
        self._ensured: set[str] = set()

    async def record(self, entry: AuditEntry) -> None:
        """Log ``entry`` and store it; a store that fails is logged as an error (the log line stays)."""
        (log.warning if entry.outcome != "done" else log.info)("%s", entry.line())
        try:
            await self._ensure(entry.queue)
            await self.api.publish(f"kq.{entry.queue}.audit.{entry.action}", json.dumps(asdict(entry)).encode())
        except Exception as exc:  # an audit store that fails must not turn an action or a refusal into a 500
            log.error("audit entry not stored in %s: %s (%s)", audit_stream(entry.queue), exc, entry.line())

    async def recent(self, queues: list[str], *, limit: int = 200) -> list[AuditEntry]:
        """The last ``limit`` entries of ``queues``, newest first."""
        found: list[AuditEntry] = []
        for queue in queues:
            stream = audit_stream(queue)
            try:
                state = (await self.api.stream_info(stream)).get("state") or {}
            except StreamNotFound:
                continue
            first = max(int(state.get("first_seq", 1)), int(state.get("last_seq", 0)) - limit + 1, 1)
            async for page in self.api.pages(stream, f"kq.{queue}.audit.>", seq=first, limit=limit):
                for msg in page:
                    try:
                        found.append(AuditEntry(**json.loads(msg.data)))
                    except (ValueError, TypeError):
                        continue
        found.sort(key=lambda e: e.ts, reverse=True)
        return found[:limit]

    async def _ensure(self, queue: str) -> None:
        if queue in self._ensured:
            return
        await self.api.stream_or_create({
            "name": audit_stream(queue), "subjects": [f"kq.{queue}.audit.>"], "retention": "limits",
            "storage": "file", "num_replicas": 1, "max_age": int(self.kept * 1e9), "allow_direct": True})
        self._ensured.add(queue)


def entry(queue: str, who: str, role: str, action: str, what: str, count: int, outcome: Outcome,
          detail: str = "") -> AuditEntry:
    """An entry stamped now."""
    return AuditEntry(time.time(), queue, who, role, action, what, count, outcome, detail)
