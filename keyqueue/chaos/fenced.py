"""A downstream store that honours fencing tokens, for chaos tests.

A chaos processor writes every run's effect here with the fencing token of its hold on the key.
The store keeps, per key, the history of accepted writes, and refuses a write whose fencing is
lower than the last accepted one: that is how a downstream system protects itself from a
worker that lost its key without knowing it (paused, partitioned) and resumes writing.

Layout, in one JetStream stream (``KQ_CHAOS_FENCE``, subjects ``chaos.fence.>``, limits
retention, no per-subject limit)::

    chaos.fence.accepted.<key>   every accepted write, in commit order; the last one is the state
    chaos.fence.refused.<key>    every refused write (appended without a check, for the counts)

A record is JSON ``{"fencing": [...], "payload": {...}}`` (a refused one also has ``"stored"``,
the fencing it lost to). Keeping every accepted write on the key's subject, rather than only the
last, makes the history and the state one atomic thing: the checker reads the exact sequence of
accepted fencing tokens per key from :meth:`FencedStore.snapshot`.

A write is a compare-and-set. The writer reads the key's last accepted record; if its fencing is
greater than the writer's (tuples compare element by element), the write is refused. Otherwise
the write is published with ``Nats-Expected-Last-Subject-Sequence`` set to the sequence read, so
the server stores it only if nobody wrote the key in between; on that conflict (10071,
:class:`~keyqueue.errors.WrongLastSequence`) the writer reads again and decides again. Equal
fencing is accepted: one holder may write many times.

A write whose reply does not come back raises (``KeyqueueTimeout``, ``ConnectionFailed``): its
outcome is unknown, and the snapshot is the authority on what was stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from nats.aio.client import Client

from keyqueue.errors import InvalidKey, WrongLastSequence
from keyqueue.jetstream.api import JetStreamApi, StoredMsg, parse_pub_ack
from keyqueue.jetstream.kv import EXPECTED_LAST_SUBJECT_SEQUENCE

__all__ = ["FENCE_STREAM", "FENCE_SUBJECTS", "FenceSnapshot", "FencedRecord", "FencedStore", "Fencing", "WriteOutcome"]

FENCE_STREAM: Final = "KQ_CHAOS_FENCE"
"""The stream that holds every fenced store's records."""

FENCE_SUBJECTS: Final = "chaos.fence"
"""Subject prefix of the fenced store: ``chaos.fence.accepted.<key>`` and ``chaos.fence.refused.<key>``."""

_KEY: Final = re.compile(r"^[^.\s*>]+(\.[^.\s*>]+)*$")

Fencing = tuple[int, ...]
"""A fencing token: compared as a tuple, e.g. ``(lease sequence, delivery count)``."""


@dataclass(frozen=True, slots=True)
class FencedRecord:
    """One write as stored: its stream sequence, fencing token and payload."""

    key: str
    seq: int
    fencing: Fencing
    payload: dict[str, Any]
    stored: Fencing | None = None
    """On a refused write: the fencing of the accepted write it lost to."""


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What became of one write."""

    accepted: bool
    seq: int
    """Stream sequence of the accepted write, or of the refusal record."""
    stored: Fencing | None
    """The fencing the write was judged against (None: the key had no accepted write)."""
    conflicts: int
    """Compare-and-set races lost (and retried) on the way."""


@dataclass(frozen=True)
class FenceSnapshot:
    """Every record in the store, per key, in commit order."""

    accepted: dict[str, list[FencedRecord]] = field(default_factory=dict)
    refused: dict[str, list[FencedRecord]] = field(default_factory=dict)

    @property
    def accepted_count(self) -> int:
        return sum(len(records) for records in self.accepted.values())

    @property
    def refused_count(self) -> int:
        return sum(len(records) for records in self.refused.values())

    def last(self, key: str) -> FencedRecord | None:
        """The key's current state: its last accepted write."""
        records = self.accepted.get(key)
        return records[-1] if records else None

    def history(self) -> dict[str, list[Fencing]]:
        """Per key, the fencing of each accepted write in commit order (the checker's ``store_history``)."""
        return {key: [r.fencing for r in records] for key, records in self.accepted.items()}


class FencedStore:
    """Fencing-checked writes into ``FENCE_STREAM``; ``accepted``, ``refused`` count this instance's writes."""

    def __init__(self, nc: Client, *, stream: str = FENCE_STREAM, subjects: str = FENCE_SUBJECTS,
                 storage: Literal["file", "memory"] = "file", timeout: float = 5.0, replicas: int = 1) -> None:
        self.api = JetStreamApi(nc, timeout=timeout)
        self.stream = stream
        self.subjects = subjects
        self.storage = storage
        self.replicas = replicas
        self.timeout = timeout
        self.accepted = 0
        self.refused = 0
        self.conflicts = 0

    def config(self) -> dict[str, Any]:
        """The stream's configuration."""
        return {
            "name": self.stream,
            "subjects": [f"{self.subjects}.>"],
            "retention": "limits",
            "storage": self.storage,
            "num_replicas": self.replicas,
            "max_msgs_per_subject": -1,
            "discard": "old",
            "allow_direct": self.replicas == 1,
        }

    async def ensure(self) -> None:
        """Create the stream if it is missing; safe from every process (creation is idempotent)."""
        await self.api.add_stream(self.config())

    def subject(self, kind: Literal["accepted", "refused"], key: str) -> str:
        if not _KEY.match(key):
            raise InvalidKey(f"key {key!r} is not a sequence of NATS subject tokens")
        return f"{self.subjects}.{kind}.{key}"

    async def write(self, key: str, fencing: Sequence[int], payload: Mapping[str, Any]) -> bool:
        """Store ``payload`` for ``key`` unless a greater fencing was accepted before; True if stored."""
        return (await self.attempt(key, fencing, payload)).accepted

    async def attempt(self, key: str, fencing: Sequence[int], payload: Mapping[str, Any]) -> WriteOutcome:
        """Like :meth:`write`, telling also the sequence, the fencing judged against and the retries."""
        token = tuple(int(part) for part in fencing)
        subject = self.subject("accepted", key)
        conflicts = 0
        while True:
            last = await self.last(key)
            stored = None if last is None else last.fencing
            if stored is not None and stored > token:
                self.refused += 1
                record = {"fencing": list(token), "stored": list(stored), "payload": dict(payload)}
                seq = await self._publish(self.subject("refused", key), record)
                return WriteOutcome(False, seq, stored, conflicts)
            expected = 0 if last is None else last.seq
            try:
                seq = await self._publish(subject, {"fencing": list(token), "payload": dict(payload)},
                                          {EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected)})
            except WrongLastSequence:
                # Another writer committed since we read: its fencing decides whether we may still write.
                conflicts += 1
                self.conflicts += 1
                continue
            self.accepted += 1
            return WriteOutcome(True, seq, stored, conflicts)

    async def last(self, key: str) -> FencedRecord | None:
        """The key's last accepted write, or None if it has none."""
        stored = await self.api.get_msg(self.stream, last_by_subject=self.subject("accepted", key),
                                        direct=self.replicas == 1)
        return None if stored is None else _record(key, stored)

    async def snapshot(self) -> FenceSnapshot:
        """Every accepted and refused write, per key, in commit order."""
        snapshot = FenceSnapshot()
        accepted_prefix = f"{self.subjects}.accepted."
        refused_prefix = f"{self.subjects}.refused."
        seq = 1
        while (stored := await self.api.get_msg(self.stream, seq=seq, next_by_subject=f"{self.subjects}.>",
                                                direct=self.replicas == 1)):
            if stored.subject.startswith(accepted_prefix):
                key = stored.subject.removeprefix(accepted_prefix)
                snapshot.accepted.setdefault(key, []).append(_record(key, stored))
            elif stored.subject.startswith(refused_prefix):
                key = stored.subject.removeprefix(refused_prefix)
                snapshot.refused.setdefault(key, []).append(_record(key, stored))
            seq = stored.seq + 1
        return snapshot

    async def _publish(self, subject: str, record: Mapping[str, Any], headers: dict[str, str] | None = None) -> int:
        reply = await self.api._request(subject, json.dumps(record).encode(), self.timeout, headers)
        return parse_pub_ack(reply).seq


def _record(key: str, stored: StoredMsg) -> FencedRecord:
    body = json.loads(stored.data)
    lost_to = body.get("stored")
    return FencedRecord(key, stored.seq, tuple(body["fencing"]), body.get("payload") or {},
                        None if lost_to is None else tuple(lost_to))
