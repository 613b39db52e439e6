"""The live worker registry: who serves a queue, from the workers' heartbeat records.

Each running worker writes a record per queue every few seconds (``keyqueue.app.heartbeat``) to
the queue's lease stream; the server drops a record ``RECORD_TTL`` seconds after its last write.
A worker is *live* while its last record is younger than ``STALE_AFTER`` of its intervals and
does not say ``stopped``; otherwise it is *gone* (stopped cleanly, or silent: killed, cut off, or
its machine down), listed until its record expires. ``keyqueue inspect`` and the dashboard
both read the registry through :func:`queue_workers`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from keyqueue.admin.inspection import parse_time
from keyqueue.app.heartbeat import STALE_AFTER, WorkerRecord, read_records
from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["WorkerState", "queue_workers", "server_time"]


@dataclass(frozen=True)
class WorkerState:
    """One worker of a queue as its last heartbeat record says, and whether it is still live."""

    record: WorkerRecord
    received: float
    """When the server stored the record (Unix seconds, the server's clock)."""
    live: bool

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def gone_because(self) -> str | None:
        """Why the worker is not live: ``stopped`` or ``silent``; None while it is."""
        if self.live:
            return None
        return "stopped" if self.record.state == "stopped" else "silent"


async def server_time(api: JetStreamApi, stream: str) -> float:
    """The server's time now (Unix seconds), as the leader of ``stream`` says when it answers an info
    request: what a record's server timestamp is compared with, so that no caller's clock counts."""
    try:
        stamp = parse_time((await api.stream_info(stream)).get("ts"))
    except StreamNotFound:
        stamp = None
    return stamp.timestamp() if stamp is not None else time.time()


async def queue_workers(api: JetStreamApi, queue: str, *, now: float | None = None) -> list[WorkerState]:
    """The workers of ``queue`` with a heartbeat record: live ones first, then by name. Liveness is
    judged by the server's clock alone (``now`` defaults to :func:`server_time`)."""
    names = QueueNames(queue)
    records = await read_records(api, queue)
    now = await server_time(api, names.lease_stream) if now is None else now
    found: list[WorkerState] = []
    for record, stored in records:
        received = stored or record.heartbeat
        # Judged by the server's clock on both sides, so no reader's or worker's skewed clock counts.
        fresh = now - received <= STALE_AFTER * max(record.interval, 1.0)
        found.append(WorkerState(record, received, live=fresh and record.state != "stopped"))
    return sorted(found, key=lambda w: (not w.live, w.name))
