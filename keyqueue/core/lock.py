"""The key lock: a lease record per key that only the server can grant.

A token says a key has work; it does not say who may do it, because the server acts on a former
holder's late ack or nak (docs/architecture.md, "Fencing"). The lock is one record per key on
``kq.<queue>.lease.<key>`` in the queue's lease stream, and every write to it is a
compare-and-set (``Nats-Expected-Last-Subject-Sequence``) with a per-message TTL:

- *acquire*: write with expected sequence 0. It succeeds only while no live record exists; its
  sequence is the holder's fencing number, strictly increasing per key.
- *renew*: write with the expected sequence of the holder's last record. A renewal that finds
  another record there tells the holder it lost the key.
- *release*: delete the holder's record by sequence; a record since written by someone else is
  untouched.
- *expire*: the server removes a record ``ttl`` seconds after it was stored, so a holder that
  died or was cut off frees the key without anyone's help. nats-server 2.15 does not always do so
  after a kill -9 and restart (found by the chaos soak: records outlived their TTL by minutes; see
  nats-server issue 7256), so a worker kept waiting by a record older than twice its TTL, by the
  server's timestamp, deletes that record by its sequence (:meth:`KeyLock.clear_expired`). A live
  holder rewrites its record every ``ttl/3``, so this needs clocks that agree within a TTL.

The holder's :class:`~keyqueue.core.lease.Lease` runs from when each confirmed write was *sent*,
on its own clock, less a margin; the server keeps the record at least ``ttl`` >= ``ack_wait``
from when it *stored* it, which is later. So while the holder believes its lease is valid, no
other worker can acquire the key, whatever arrives late and in whatever order.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from keyqueue.core.lease import Lease
from keyqueue.errors import LeaseLost, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg


class RecordStore(Protocol):
    """The lease stream, as the lock sees it (``keyqueue.jetstream.queue_io.QueueIO``)."""

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int: ...

    async def last_record(self, subject: str) -> StoredMsg | None: ...

    async def remove_record(self, seq: int) -> None: ...


class KeyLock:
    """One worker's claim on one key (or on a fleet role such as the reconciler's)."""

    __slots__ = ("ack_wait", "clock", "fence", "holder", "lease", "nonce", "seq", "since", "store", "subject", "ttl")

    def __init__(self, store: RecordStore, subject: str, ack_wait: float, *, holder: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.subject = subject
        self.ack_wait = ack_wait
        self.ttl = math.ceil(ack_wait)
        """The record's TTL in whole seconds (the server's granularity), never below the lease."""
        self.clock = clock
        self.nonce = secrets.token_hex(8)
        """Identifies this claim's records, so a renewal that landed late is recognised as ours."""
        self.holder = dict(holder or {})
        self.fence = 0
        """The sequence of the record that acquired the key: this holder's fencing number."""
        self.seq = 0
        """The sequence of this holder's newest record (the expected sequence of its next write)."""
        self.lease: Lease | None = None
        self.since = ""

    @property
    def held(self) -> bool:
        return self.lease is not None and self.lease.valid()

    def _body(self) -> bytes:
        return json.dumps({**self.holder, "nonce": self.nonce, "fence": self.fence, "since": self.since,
                           "ttl": self.ttl}, separators=(",", ":")).encode()

    def _mine(self, record: StoredMsg | None) -> bool:
        if record is None:
            return False
        try:
            return bool(json.loads(record.data).get("nonce") == self.nonce)
        except (ValueError, AttributeError):
            return False

    async def try_acquire(self) -> bool:
        """Write the first record; False while another live record holds the key."""
        sent = self.clock()
        self.since = datetime.now(UTC).isoformat(timespec="milliseconds")
        try:
            seq = await self.store.compare_and_set(self.subject, 0, self._body(), self.ttl)
        except WrongLastSequence:
            return False
        self.fence = self.seq = seq
        self.lease = Lease(self.ack_wait, sent, clock=self.clock)
        return True

    async def renew(self) -> None:
        """Extend the lease; raise :class:`~keyqueue.errors.LeaseLost` if the key is no longer ours."""
        lease = self._lease()
        lease.check()  # a resumed process must not renew a lapsed lease
        sent = self.clock()
        try:
            # A reply later than the deadline could not extend the lease anyway: waiting longer
            # would only keep a cut-off holder's work running past it.
            seq = await self.store.compare_and_set(self.subject, self.seq, self._body(), self.ttl,
                                                   timeout=lease.remaining())
        except WrongLastSequence:
            try:
                async with asyncio.timeout(lease.remaining()):
                    current = await self.store.last_record(self.subject)
            except TimeoutError:
                current = None
            if self._mine(current) and current is not None:
                # One of our own renewals landed after we gave up waiting for its reply: the
                # record is still ours. The lease is extended by the next confirmed renewal.
                self.seq = current.seq
                return
            lease.lose("another worker acquired the key's lease record")
            raise LeaseLost(lease.lost_reason) from None
        self.seq = seq
        lease.confirmed(sent, self.clock())

    async def clear_expired(self, now: float | None = None) -> bool:
        """Delete the key's current record if it is older than twice its TTL (the server failed to
        expire it); True if one was deleted. A record rewritten meanwhile has another sequence and
        is untouched."""
        record = await self.store.last_record(self.subject)
        if record is None or not record.timestamp:
            return False
        try:
            ttl = float(json.loads(record.data).get("ttl", self.ttl))
        except (ValueError, AttributeError):
            ttl = float(self.ttl)
        age = (time.time() if now is None else now) - _unix(record.timestamp)
        if age <= 2 * ttl:
            return False
        await self.store.remove_record(record.seq)
        return True

    async def release(self) -> None:
        """Remove this holder's record so the key can be acquired at once (not after the TTL)."""
        if self.seq:
            await self.store.remove_record(self.seq)

    def _lease(self) -> Lease:
        if self.lease is None:
            raise LeaseLost("the key's lease record was never acquired")
        return self.lease


def _unix(timestamp: str) -> float:
    """Seconds since the epoch of a JetStream RFC 3339 timestamp (nanoseconds cut to micro)."""
    stamp = timestamp.rstrip("Z")
    if "." in stamp:
        whole, fraction = stamp.split(".", 1)
        stamp = f"{whole}.{fraction[:6]}"
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
