"""The worker registry's records: each running worker says, every few seconds, that it is alive.

A ``Worker`` writes one *heartbeat record* per queue it serves to the queue's lease stream
(``KQ_<queue>_LEASES``), on ``kq.<queue>.role.worker.<id>`` (``id`` a hash of the worker's name,
since a name such as ``host.example:4711/2`` is not one subject token). The stream keeps one
message per subject, so each worker has exactly one record per queue: its latest. Each record
carries ``Nats-TTL`` (``RECORD_TTL``): the server removes it that long after the last write, so
a worker that died stays listed as *gone* for a while and then vanishes without anyone's help. A
worker that stops cleanly writes a last record saying ``stopped``.

``keyqueue inspect`` and ``keyqueue dashboard`` read these records
(``keyqueue.admin.workers``): a worker is *live* while its last heartbeat is younger than
``STALE_AFTER`` heartbeat intervals and it has not said it stopped.

Cost: one small JetStream publish per queue every ``INTERVAL`` seconds, off the key sessions'
path (docs/benchmarks.md measures it on hot-key throughput).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi, parse_pub_ack, stored_seconds
from keyqueue.jetstream.subjects import QueueNames

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.core.worker import QueueWorker

__all__ = ["INTERVAL", "RECORD_TTL", "STALE_AFTER", "Heartbeat", "WorkerRecord", "answering_workers", "queue_role",
           "read_records", "record_subject", "record_subject_prefix"]

log = logging.getLogger("keyqueue.worker")

INTERVAL: Final = 5.0
"""Seconds between two heartbeat records of one worker (``Worker(heartbeat_interval=...)``)."""

RECORD_TTL: Final = 600
"""Seconds the server keeps a worker's last record: how long a worker that died is listed as gone."""

STALE_AFTER: Final = 3
"""A worker whose last heartbeat is older than this many of its intervals is taken for gone."""

ROLE: Final = "worker"
"""The role subject token under which heartbeat records live (``kq.<queue>.role.worker.<id>``)."""


def record_subject_prefix(queue: str) -> str:
    """The subjects of ``queue``'s heartbeat records, without the worker id."""
    return QueueNames(queue).role(ROLE) + "."


def record_subject(queue: str, worker: str) -> str:
    """The subject of ``worker``'s heartbeat record on ``queue``."""
    return record_subject_prefix(queue) + hashlib.sha256(worker.encode()).hexdigest()[:24]


def _version() -> str:
    try:
        return metadata.version("keyqueue")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker says about itself in a heartbeat record (a JSON object with these fields)."""

    name: str
    host: str
    pid: int
    version: str
    queues: list[str]
    slots: int
    """Keys the worker may hold at once on this record's queue."""
    used: int
    """Keys it holds on this record's queue at the time of the record."""
    started: float
    """When the worker started (Unix seconds)."""
    heartbeat: float
    """When this record was written (Unix seconds, the worker's clock)."""
    interval: float
    """Seconds between its records."""
    state: str = "running"
    """``running``, or ``stopped`` in the record a worker writes as it stops."""
    role: dict[str, Any] = field(default_factory=dict)
    """Its part in the queue's priority group (:func:`queue_role`); empty from workers before it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields a later version added (kept, not interpreted)."""

    def encode(self) -> bytes:
        fields = asdict(self)
        extra = fields.pop("extra")
        return json.dumps({**extra, **fields}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord | None:
        """The record in ``data``, or None if it is not one."""
        try:
            body = json.loads(data)
            known = {name: body.pop(name) for name in list(body) if name in _FIELDS}
            return cls(**known, extra=body)
        except (ValueError, TypeError, AttributeError):
            return None


_FIELDS: Final = frozenset(f for f in WorkerRecord.__dataclass_fields__ if f != "extra")


async def read_records(api: JetStreamApi, queue: str) -> list[tuple[WorkerRecord, float | None]]:
    """Each worker's last heartbeat record on ``queue``, with when the server stored it (Unix seconds,
    the server's clock; None if unreadable). Empty for a queue without a lease stream."""
    names = QueueNames(queue)
    try:
        subjects = await api.subjects(names.lease_stream, record_subject_prefix(queue) + "*")
    except StreamNotFound:
        return []
    messages = await asyncio.gather(*(api.get_msg(names.lease_stream, last_by_subject=subject, direct=False)
                                      for subject in subjects))
    return [(record, stored_seconds(msg.timestamp)) for msg in messages
            if msg is not None and (record := WorkerRecord.decode(msg.data)) is not None]


async def answering_workers(api: JetStreamApi, queue: str) -> int:
    """How many workers of ``queue`` can answer a question about a request now, as their records say.

    Those that have not stopped and whose last record is no more than ``STALE_AFTER`` of their
    intervals older than the newest record (the server's clock alone): a worker that died falls
    that far behind its live peers. A record of unknown time counts. Counting one that cannot
    answer costs the asker its wait; leaving out one that can would end the question early.
    """
    records = [(r, at) for r, at in await read_records(api, queue) if r.state != "stopped"]
    newest = max((at for _, at in records if at is not None), default=None)
    return sum(1 for r, at in records
               if at is None or newest is None or newest - at <= STALE_AFTER * max(r.interval, 1.0))


def queue_role(worker: QueueWorker) -> dict[str, Any]:
    """A worker's part in its queue's priority group (docs/priority-groups.md), as its record says it:
    ``policy`` (the queue's: ``none``, ``overflow``, ``pinned_client``, ``prioritized``), and as
    they apply, ``group``, ``priority``, ``min_pending``, ``min_ack_pending`` and ``pinned``
    (whether it is the pinned client now)."""
    policy = worker.config.priority_policy
    if policy == "none":
        return {"policy": policy}
    options = worker.puller.options
    role: dict[str, Any] = {"policy": policy, "group": worker.config.priority_group}
    if policy == "prioritized":
        role["priority"] = options.priority if options.priority is not None else 0
    elif policy == "overflow":
        role.update(min_pending=options.min_pending, min_ack_pending=options.min_ack_pending)
    elif policy == "pinned_client":
        role["pinned"] = worker.pinned is not None
    return role


class Heartbeat:
    """Writes a worker's heartbeat records while it runs; its last one says ``stopped``.

    ``used`` tells, per queue, how many keys the worker holds right now, ``role`` its part in the
    queue's priority group (both are read at each record, so they are as of it). A failed write (the
    server away, the stream not there) is logged at debug and tried again at the next interval:
    the registry is for people, it never holds up the worker.
    """

    def __init__(self, nc: Client, name: str, queues: Mapping[str, int], used: Callable[[str], int], *,
                 interval: float = INTERVAL, ttl: int = RECORD_TTL,
                 role: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.nc = nc
        self.name = name
        self.slots = dict(queues)
        self.used = used
        self.role = role
        """The worker's part in each queue's priority group (``queue_role``), read at each record."""
        self.interval = interval
        self.ttl = ttl
        self.started = time.time()
        self.written = 0
        """Records written so far (all queues)."""
        self.wrote = asyncio.Event()
        """Set after each record written (clear it to wait for the next)."""
        self._task: asyncio.Task[None] | None = None

    def record(self, queue: str, state: str = "running") -> WorkerRecord:
        host = socket.gethostname()
        return WorkerRecord(name=self.name, host=host, pid=os.getpid(), version=_version(), queues=list(self.slots),
                            slots=self.slots[queue], used=self.used(queue), started=self.started,
                            heartbeat=time.time(), interval=self.interval, state=state,
                            role=self.role(queue) if self.role is not None else {})

    async def write(self, state: str = "running") -> None:
        """One record per queue, now."""
        await asyncio.gather(*(self._write(queue, state) for queue in self.slots))

    async def _write(self, queue: str, state: str) -> None:
        try:
            reply = await self.nc.request(record_subject(queue, self.name), self.record(queue, state).encode(),
                                          timeout=2.0, headers={"Nats-TTL": str(self.ttl)})
            parse_pub_ack(reply)
            self.written += 1
            self.wrote.set()
        except Exception as exc:  # the registry is for people: it never fails a worker
            log.debug("worker %s: heartbeat for queue %s not written: %s", self.name, queue, exc)

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"keyqueue-heartbeat:{self.name}")

    async def _run(self) -> None:
        while True:
            await self.write()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Stop writing, then write the ``stopped`` record (once started)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        await self.write("stopped")
