"""A small JetStream key-value bucket with revision-checked writes.

A bucket ``B`` is the stream ``KV_B`` on the subjects ``$KV.B.>`` (the layout every NATS client
uses, so ``nats kv get B key`` reads what this module writes). A value's *revision* is the stream
sequence of the message that stored it. Writes are optimistic: ``put`` names the revision the
writer last read (``0`` for "the key must not exist yet"), and the server refuses the write with
``Nats-Expected-Last-Subject-Sequence`` error 10071 if anyone wrote the key since; that refusal is
:class:`~keyqueue.errors.WrongLastSequence`. Callers that hold a key of a queue use it to make
sure a stale holder's write fails rather than overwriting a newer holder's.

Calls go through the JetStream API on the core client (:class:`~keyqueue.jetstream.api.JetStreamApi`),
like every other keyqueue call, so errors are typed by :func:`keyqueue.errors.from_api_error`.
"""

from __future__ import annotations

import re
from typing import Any, Final, NamedTuple

from nats.aio.client import Client

from keyqueue.errors import ConfigError, TopologyMismatch
from keyqueue.jetstream.api import JetStreamApi, parse_pub_ack
from keyqueue.jetstream.topology import NS

__all__ = ["EXPECTED_LAST_SUBJECT_SEQUENCE", "KeyValue", "KvEntry"]

EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
"""Publish header: refuse the message unless the subject's last sequence is this value (0: none)."""

KV_OPERATION: Final = "KV-Operation"
"""Header NATS clients put on a delete or purge marker (``DEL`` / ``PURGE``); a marker is no value."""

_BUCKET: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KEY: Final = re.compile(r"^[-/_=.A-Za-z0-9]+$")

# Fields of an existing bucket's stream that must match for this module's semantics to hold.
_CHECKED: Final = ("subjects", "max_msgs_per_subject", "allow_direct")


class KvEntry(NamedTuple):
    """A stored value and its revision (the stream sequence that stored it)."""

    value: bytes
    revision: int


class KeyValue:
    """One bucket: ``ensure`` it exists, ``get`` a value with its revision, ``put`` against a revision."""

    def __init__(self, nc: Client, bucket: str, *, replicas: int = 1, history: int = 1, max_age: float = 0.0,
                 timeout: float = 5.0) -> None:
        if not _BUCKET.match(bucket):
            raise ConfigError(f"bucket name {bucket!r} is not valid: use 1-64 letters, digits, '-' or '_'")
        if not 1 <= history <= 64:
            raise ConfigError(f"history must be within 1..64, got {history}")
        self.bucket = bucket
        self.replicas = replicas
        self.history = history
        self.max_age = max_age
        self.api = JetStreamApi(nc, timeout=timeout)
        self.timeout = timeout

    @property
    def stream(self) -> str:
        return f"KV_{self.bucket}"

    def subject(self, key: str) -> str:
        """The subject that stores ``key``; raises ConfigError for a key NATS KV does not allow."""
        if not _KEY.match(key) or key.startswith(".") or key.endswith(".") or ".." in key:
            raise ConfigError(
                f"KV key {key!r} is not valid: use letters, digits and - / _ = . (no leading, trailing or "
                "doubled dots)"
            )
        return f"$KV.{self.bucket}.{key}"

    def config(self) -> dict[str, Any]:
        """The bucket's stream configuration, as NATS clients create it."""
        return {
            "name": self.stream,
            "subjects": [f"$KV.{self.bucket}.>"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_msgs_per_subject": self.history,
            "max_age": int(self.max_age * NS),
            "discard": "new",
            "allow_rollup_hdrs": True,
            "deny_delete": True,
            "deny_purge": False,
            # Direct gets may be answered by a lagging follower; a reader that then writes against
            # the revision it saw would only lose the race, but read from the leader when replicated.
            "allow_direct": self.replicas == 1,
            "duplicate_window": 120 * NS,
        }

    async def ensure(self) -> None:
        """Create the bucket if it is missing, else verify it; safe to call from every process."""
        wanted = self.config()
        existing = await self.api.stream_or_create(wanted)
        for field in _CHECKED:
            if existing.get(field) != wanted[field]:
                raise TopologyMismatch(f"KV bucket {self.bucket}", field, existing.get(field), wanted[field],
                                       f"delete the bucket (nats kv del {self.bucket}) or configure it to match")

    async def get(self, key: str) -> KvEntry | None:
        """The key's current value and revision, or None if it has none (never written, or deleted)."""
        stored = await self.api.get_msg(self.stream, last_by_subject=self.subject(key), direct=self.replicas == 1)
        if stored is None or stored.headers.get(KV_OPERATION) in ("DEL", "PURGE"):
            return None
        return KvEntry(stored.data, stored.seq)

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        """Store ``value`` and return its revision.

        ``expected_revision`` is the revision the caller last read, ``0`` if it read nothing (the
        key must not exist), or ``None`` to write unconditionally. A mismatch raises
        :class:`~keyqueue.errors.WrongLastSequence` and stores nothing.
        """
        headers = None if expected_revision is None else {EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected_revision)}
        reply = await self.api._request(self.subject(key), value, self.timeout, headers)
        return parse_pub_ack(reply).seq

    async def purge(self, key: str) -> None:
        """Remove every stored revision of ``key`` (used by tests and tools, not by writers)."""
        await self.api.purge(self.stream, subject=self.subject(key))
