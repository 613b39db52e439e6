"""The key lock: a lease record per key that only the server can grant.

A token says a key has work; it does not say who may do it, because the server acts on a former
holder's late ack or nak (docs/architecture.md, "Fencing"). The lock is one record per key on
``kq.<queue>.lease.<key>`` in the queue's lease stream, and every write to it is a
compare-and-set (``Nats-Expected-Last-Subject-Sequence``) with a per-message TTL:

- *acquire*: write with expected sequence 0. It succeeds only while no live record exists; its
  sequence is the holder's fencing number, strictly increasing per key. A loser gets 10071, or
  10164 on a replicated stream (another write to the subject is still being replicated): both
  are :class:`~keyqueue.errors.WrongLastSequence`, a lost race.
- *renew*: write with the expected sequence of the holder's last record. A renewal that finds
  another record there tells the holder it lost the key.
- *release*: delete the holder's record by sequence; a record since written by someone else is
  untouched. A write whose reply never came (the connection dropped, the request timed out) may
  have stored a newer record of this holder: the release then also removes whatever record
  carries this claim's nonce, so no orphan outlives the holder.
- *expire*: the server removes a record ``ttl`` seconds after it was stored, so a holder that
  died or was cut off frees the key without anyone's help. nats-server 2.15 does not always do so
  after a kill -9 and restart (the chaos soak saw records outlive their TTL by minutes after a
  restart: a nats-server bug, not ours), so a worker kept waiting by a record deletes it by its sequence once it
  has itself seen the *same* record (same sequence) for twice its TTL on its own monotonic clock
  (:class:`StaleRecordWatch`): a live holder rewrites its record every ``ttl/3``, so an unchanged
  sequence means nobody renewed it. No wall clock of any host is compared with another's. Its
  former holder does better: once its session ended with the lease lost (its work over), its
  worker removes the record itself when connected (``QueueWorker.remove_leftover``).
- *waiting on a gone holder*: a waiter kept from a key by a record whose holder looks gone (its
  process on this host has exited, or the record has not been rewritten for longer than a live
  holder's renewal interval) says so at INFO, once per record: the holder, why it looks gone, and
  the most the record can still last. A worker killed without a supervisor leaves its keys locked
  for a lease; without this line the other workers' logs said nothing about why keys paused.

The holder's :class:`~keyqueue.core.lease.Lease` runs from when each confirmed write was *sent*,
on its own clock, less a margin; the server keeps the record at least ``ttl`` >= ``ack_wait``
from when it *stored* it, which is later. So while the holder believes its lease is valid, no
other worker can acquire the key, whatever arrives late and in whatever order. What this still
assumes of time: the server's own wall clock does not jump forward by more than the margin while
a record lives (it expires records by it), and clock *rates* on the hosts agree within a factor
of two (docs/architecture.md, "What depends on time").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from keyqueue.core.lease import Lease
from keyqueue.core.outage import RETRIED, ride_out
from keyqueue.errors import KeyqueueTimeout, LeaseLost, ReplyLost, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg, stored_seconds

log = logging.getLogger("keyqueue.session")

_UNANSWERED = (ReplyLost, KeyqueueTimeout)
"""A write was sent but its reply never came: it may or may not have been stored."""


RENEWAL_SLACK: Final = 1.0
"""Seconds past a live holder's renewal interval (a third of the record's TTL) before a record not
rewritten meanwhile makes its holder look gone (in a log line; nothing is decided by it)."""

EXPIRED_SLACK: Final = 0.25
"""Seconds past a record's TTL, by the server's own clock, before a waiter removes a record the
server kept (see :meth:`KeyLock.clear_expired`)."""

_HOST: Final = socket.gethostname()


def _process_exited(pid: object) -> bool:
    """Whether process ``pid`` of this host is known to have exited (False when unknown)."""
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, as another user's
        return False
    return False


class RecordStore(Protocol):
    """The lease stream, as the lock sees it (``keyqueue.jetstream.queue_io.QueueIO``)."""

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int: ...

    async def last_record(self, subject: str) -> StoredMsg | None: ...

    async def remove_record(self, seq: int) -> None: ...

    @property
    def unanswered_removals(self) -> bool:
        """Whether :meth:`forget_record` may be used (a lost delete is redone after the reconnect)."""
        ...

    async def forget_record(self, seq: int, ttl: float) -> None:
        """:meth:`remove_record`, sent without waiting for its answer (sent again if none comes
        while the record, which expires ``ttl`` seconds after its last write, may live)."""
        ...

    async def wait_connected(self, timeout: float) -> bool: ...

    @property
    def closed(self) -> bool:
        """The connection is closed for good."""
        ...


class StaleRecordWatch:
    """Tells a waiter when the record in its way has not been rewritten for twice its TTL.

    Only what the waiter itself observes counts: the record's sequence, and when it first saw that
    sequence, on its own monotonic clock. A live holder rewrites its record every third of the TTL
    (a new sequence each time), so one sequence seen for twice the TTL belongs to nobody alive,
    whatever the hosts' wall clocks say. Pure logic; the clock is injectable.
    """

    __slots__ = ("clock", "seq", "since")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seq = 0
        self.since = 0.0

    def stale(self, seq: int, ttl: float) -> bool:
        """Note that the current record has ``seq``; True once that same sequence has been seen for ``2 * ttl``."""
        now = self.clock()
        if seq != self.seq:
            self.seq, self.since = seq, now
            return False
        return now - self.since > 2 * ttl


_NONCES: list[Any] = [0, "", None]
"""The process that made the nonce prefix, the prefix, and the counter after it (see :func:`_new_nonce`)."""


def _new_nonce() -> str:
    """A claim's nonce: unique among every claim of every worker (a random prefix drawn once per
    process, a fork's child draws its own, then a count), without reading the system's random
    source for each of thousands of cold keys a second."""
    pid = os.getpid()
    if _NONCES[0] != pid:
        _NONCES[:] = [pid, secrets.token_hex(6), itertools.count(1)]
    return f"{_NONCES[1]}{next(_NONCES[2]):x}"


class KeyLock:
    """One worker's claim on one key (or on a fleet role such as the reconciler's)."""

    __slots__ = ("_prefix", "ack_wait", "clock", "ended_claim", "expires_in", "expiry", "fence", "holder", "lease",
                 "nonce", "reported", "seq", "server_now", "since", "store", "subject", "ttl", "unanswered",
                 "unsettled")

    def __init__(self, store: RecordStore, subject: str, ack_wait: float, *, holder: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 server_now: Callable[[], float | None] | None = None,
                 ended_claim: Callable[[], str | None] | None = None) -> None:
        self.store = store
        self.ended_claim = ended_claim
        """The nonce of this process's last claim on the same subject whose session is over and may
        have left a record behind (a write of it went unanswered, or it lost its lease), if any: a
        waiter removes such a record at once (see :meth:`clear_expired`)."""
        self.server_now = server_now
        """The server's clock as this worker knows it, never ahead of it (Unix seconds; None while
        unknown), when the records and what it was learnt from are stamped by one clock (one
        server). A waiter then removes a record the server kept past its TTL by that clock."""
        self.expires_in: float | None = None
        """Seconds until the record last seen in this waiter's way is past its TTL by the server's
        clock (:attr:`server_now`), when known (see :meth:`clear_expired`)."""
        self.subject = subject
        self.ack_wait = ack_wait
        self.ttl = math.ceil(ack_wait)
        """The record's TTL in whole seconds (the server's granularity), never below the lease."""
        self.clock = clock
        self.nonce = _new_nonce()
        """Identifies this claim's records, so a renewal that landed late is recognised as ours."""
        self.holder = dict(holder or {})
        self.fence = 0
        """The sequence of the record that acquired the key: this holder's fencing number."""
        self.seq = 0
        """The sequence of this holder's newest record (the expected sequence of its next write)."""
        self.lease: Lease | None = None
        self.since = ""
        self.unsettled = False
        """A write of this claim was sent and its reply never came: a newer record of ours may exist."""
        self.unanswered = False
        """A write of this claim ever went unanswered: it may be stored even after the release
        looked for it (a slow or electing stream applies it later)."""
        self.expiry = StaleRecordWatch(clock)
        """What this claim saw of another holder's record while it waited (see :meth:`clear_expired`)."""
        self.reported = 0
        """The sequence of the last record in the way whose holder was logged as looking gone."""
        self._prefix = b""
        """A record's body up to its first field that changes from write to write (see :meth:`_body`)."""

    @property
    def held(self) -> bool:
        return self.lease is not None and self.lease.valid()

    def update_holder(self, **fields: Any) -> None:
        """Change the holder's fields written in the next records (a redelivered token's)."""
        self.holder.update(fields)
        self._prefix = b""

    def _body(self, sent: float) -> bytes:
        """A record: the holder's fields and this claim's, and when this write was sent on the
        holder's own clock (meaningful to it alone: a write found later says how long it lasts).

        One JSON object, the same as ``json.dumps`` of those fields: the holder's and the nonce are
        encoded once per claim (and again after :meth:`update_holder`), the rest per write."""
        if not self._prefix:
            self._prefix = json.dumps({**self.holder, "nonce": self.nonce}, separators=(",", ":"))[:-1].encode()
        return b'%s,"fence":%d,"since":%s,"ttl":%d,"sent":%s}' % (
            self._prefix, self.fence, json.dumps(self.since).encode(), self.ttl, repr(round(sent, 6)).encode())

    def _mine(self, record: StoredMsg | None) -> bool:
        return self._sent_if_mine(record) is not None

    def _sent_if_mine(self, record: StoredMsg | None) -> float | None:
        """When ``record``, if it is one of this claim's, was sent (its body says); else None."""
        if record is None:
            return None
        try:
            body = json.loads(record.data)
        except ValueError:
            return None
        if not isinstance(body, dict) or body.get("nonce") != self.nonce:
            return None
        sent = body.get("sent")
        return float(sent) if isinstance(sent, int | float) else math.inf

    async def try_acquire(self) -> bool:
        """Write the first record; False while another live record holds the key.

        An acquire whose reply was lost is settled by looking: the record there is ours (a write of
        this claim was stored: the key is ours, its lease running from when *that* write was sent,
        which the record says: an earlier try of this claim may be the one that landed) or it is
        not. Raises a connection error only when that cannot be known before such a lease would
        end (then a record of ours, if stored, expires by itself, or the release removes it)."""
        sent = self.clock()
        self.since = datetime.now(UTC).isoformat(timespec="milliseconds")
        try:
            seq = await self.store.compare_and_set(self.subject, 0, self._body(sent), self.ttl)
        except WrongLastSequence:
            # An earlier try of this claim whose reply was lost may be the record in the way.
            return await self._take_mine(sent) if self.unsettled else False
        except asyncio.CancelledError:
            self.unsettled = self.unanswered = True  # sent, maybe stored: release() looks for it
            raise
        except _UNANSWERED:
            self.unsettled = self.unanswered = True
            return await self._take_mine(sent)
        self.fence = self.seq = seq
        self.unsettled = False
        self.lease = Lease(self.ack_wait, sent, clock=self.clock)
        return True

    async def _take_mine(self, sent: float) -> bool:
        """After a write of this claim (sent at ``sent``) went unanswered: look at the key's record,
        again after a reconnect, while the lease such a write would give lasts. Ours: the key is ours
        for as long as the write that stored it allows (from its own send time), or, if that has run
        out on our clock, the record is removed. Another's: our write cannot land any more. None:
        ours may still land, so the claim stays unsettled (the release looks again)."""
        patience = Lease(self.ack_wait, sent, clock=self.clock)

        async def look() -> StoredMsg | None:
            # The deadline's TimeoutError is raised where the block ends: caught outside it, so a
            # read that hangs is retried like one that timed out (not a session failure).
            try:
                async with asyncio.timeout(max(0.001, patience.remaining())):
                    return await self.store.last_record(self.subject)
            except TimeoutError as e:
                raise KeyqueueTimeout(f"no answer from {self.subject}'s stream in time") from e

        try:
            current = await ride_out(look, patience, self.store)
        except (LeaseLost, *RETRIED) as e:
            raise KeyqueueTimeout(f"could not learn whether a write to {self.subject} was stored "
                                  "before the lease it would give ended") from e
        if current is None:
            return False
        stored_sent = self._sent_if_mine(current)
        if stored_sent is None:
            self.unsettled = False
            return False
        lease = Lease(self.ack_wait, min(stored_sent, sent), clock=self.clock)
        self.unsettled = False
        if not lease.valid() or lease.remaining() < lease.interval:
            await self.store.remove_record(current.seq)  # ours, about to expire: take the key afresh
            return False
        self.fence = self.seq = current.seq
        self.lease = lease
        return True

    async def renew(self) -> bool:
        """Extend the lease; True if it was extended, False if the record is still ours but this
        write lost a race to it (try again soon). Raises :class:`~keyqueue.errors.LeaseLost` if the
        key is no longer ours, and a connection error if the write's fate is unknown."""
        lease = self._lease()
        lease.check()  # a resumed process must not renew a lapsed lease
        sent = self.clock()
        try:
            # A reply later than the deadline could not extend the lease anyway: waiting longer
            # would only keep a cut-off holder's work running past it.
            seq = await self.store.compare_and_set(self.subject, self.seq, self._body(sent), self.ttl,
                                                   timeout=lease.remaining())
        except WrongLastSequence:
            try:
                async with asyncio.timeout(max(0.001, lease.remaining())):
                    current = await self.store.last_record(self.subject)
            except TimeoutError:
                current = None
            if self._mine(current) and current is not None:
                # One of our own writes landed after we gave up waiting for its reply, or (on a
                # replicated stream, 10164) another worker's acquire was in flight and will fail:
                # the record is still ours. The next confirmed renewal extends the lease.
                self.seq = current.seq
                self.unsettled = False
                return False
            lease.lose("another worker acquired the key's lease record")
            raise LeaseLost(lease.lost_reason) from None
        except (*_UNANSWERED, asyncio.CancelledError):
            self.unsettled = self.unanswered = True
            raise
        self.seq = seq
        self.unsettled = False
        return lease.confirmed(sent, self.clock())

    async def clear_expired(self) -> bool:
        """Look at the record in this waiter's way; delete it if this waiter has seen that same
        record (same sequence) for twice its TTL (the server failed to expire it), if the server's
        clock is past its TTL (:attr:`server_now`), or if it is this process's ended claim's
        (:attr:`ended_claim`: nothing of that session runs any more): True if one was deleted. A
        record rewritten meanwhile has another sequence and is untouched."""
        self.expires_in = None
        record = await self.store.last_record(self.subject)
        if record is None:
            return False
        try:
            body = json.loads(record.data)
            ttl = float(body.get("ttl", self.ttl))
        except (ValueError, AttributeError, TypeError):
            body, ttl = {}, float(self.ttl)
        holder = body if isinstance(body, dict) else {}
        ended = self.ended_claim() if self.ended_claim is not None else None
        if ended is not None and holder.get("nonce") == ended:
            why = "it is a claim of this worker's whose session is over"
        elif self._expired_by_server_clock(record, ttl):
            why = "the server kept it past its TTL by the server's own clock"
        elif self.expiry.stale(record.seq, ttl):
            why = "the server kept it: it was seen unchanged for twice its TTL"
        else:
            self._report_gone_holder(record.seq, holder, ttl)
            return False
        await self.store.remove_record(record.seq)
        log.warning("%s: removed lease record %d (worker %s, pid %s, stored %s): %s", self.subject, record.seq,
                    holder.get("worker", "?"), holder.get("pid", "?"), record.timestamp or "?", why)
        return True

    def _expired_by_server_clock(self, record: StoredMsg, ttl: float) -> bool:
        """Whether the server's clock is past ``record``'s TTL (by :data:`EXPIRED_SLACK`): the
        server should have removed it, and its holder's lease, which ends before the TTL from when
        the record was stored, is over. Sets :attr:`expires_in` when it is not yet."""
        now = self.server_now() if self.server_now is not None else None
        stored = stored_seconds(record.timestamp) if now is not None else None
        if now is None or stored is None:
            return False
        left = stored + ttl + EXPIRED_SLACK - now
        if left < 0:
            return True
        self.expires_in = left
        return False

    def _report_gone_holder(self, seq: int, holder: dict[str, Any], ttl: float) -> None:
        """Log, once per record, that this waiter waits on a key whose holder looks gone, with the most
        its record can still last (from what this waiter saw, and, for a holder on this host, from
        when the holder sent the record by the host's monotonic clock: no wall clock is read)."""
        parts = self.subject.split(".", 3)
        if seq == self.reported or len(parts) < 4 or parts[2] != "lease":
            return  # logged already, or a fleet role's record rather than a key's
        seen_for = self.clock() - self.expiry.since
        here = holder.get("host") == _HOST
        if here and _process_exited(holder.get("pid")):
            why = f"its process {holder.get('pid')} on this host has exited"
        elif seen_for > ttl / 3 + RENEWAL_SLACK:
            why = f"it has not renewed its record for {seen_for:.0f}s (a live holder renews it every {ttl / 3:.0f}s)"
        else:
            return
        self.reported = seq
        sent = holder.get("sent")
        age = self.clock() - sent if here and isinstance(sent, int | float) and self.clock is time.monotonic else 0.0
        left = max(0.0, ttl - max(seen_for, age))
        worker = holder.get("worker") or "?"
        log.info("queue %s key %s waits for the lease record of worker %s (pid %s on %s), which looks gone: %s; the "
                 "key is free when the record expires, in at most %.0fs, or at once with `keyqueue release %s "
                 "--worker %s` (a `keyqueue worker --processes` parent releases its children's keys itself)",
                 parts[1], parts[3], worker, holder.get("pid", "?"), holder.get("host", "?"), why, left, parts[1],
                 worker)

    async def release(self, *, unanswered: bool = False) -> None:
        """Remove this holder's record so the key can be acquired at once (not after the TTL); and,
        if a write of ours went unanswered, whatever newer record carries our nonce.

        ``unanswered``: where the store allows it (``unanswered_removals``: one server) and every
        write of ours was answered, the delete goes without waiting for its answer, a round trip
        less. For a key given back, whose release the worker notes: a delete lost with the
        connection is redone after the reconnect (``keyqueue.core.worker.REDELETE_WINDOW``)."""
        if unanswered and self.seq and not self.unsettled and self.store.unanswered_removals:
            await self.store.forget_record(self.seq, self.ttl)
            return
        if self.seq:
            await self.store.remove_record(self.seq)
        if self.unsettled:
            current = await self.store.last_record(self.subject)
            if self._mine(current) and current is not None and current.seq != self.seq:
                await self.store.remove_record(current.seq)
            self.unsettled = False

    def _lease(self) -> Lease:
        if self.lease is None:
            raise LeaseLost("the key's lease record was never acquired")
        return self.lease

