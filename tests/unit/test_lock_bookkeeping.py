"""KeyLock's bookkeeping with a fake record store and a fake clock (the real server: test_key_lock.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime

import pytest

from keyqueue.core.lock import EXPIRED_SLACK, KeyLock
from keyqueue.errors import ConnectionFailed, KeyqueueTimeout, LeaseLost, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """One subject's records; each write takes ``delay`` seconds of the fake clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.seq = 0
        self.last: StoredMsg | None = None
        self.delay = 0.0

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        self.clock.now += self.delay
        if (self.last.seq if self.last else 0) != expected:
            raise WrongLastSequence("wrong last sequence", 400, 10071)
        self.seq += 1
        self.last = StoredMsg(subject, self.seq, {}, body)
        return self.seq

    async def last_record(self, subject: str) -> StoredMsg | None:
        return self.last

    unanswered_removals = False
    """Whether the lock may remove a record without waiting (as on one server)."""

    async def forget_record(self, seq: int, ttl: float) -> None:
        await self.remove_record(seq)

    async def remove_record(self, seq: int) -> None:
        if self.last and self.last.seq == seq:
            self.last = None

    async def wait_connected(self, timeout: float) -> bool:
        return True

    closed = False
    """The connection is never closed for good here."""


async def test_the_lease_runs_from_when_the_acquire_was_sent() -> None:
    clock = Clock()
    store = Store(clock)
    store.delay = 2.0  # the loop stalled (or the reply was slow) while acquiring
    lock = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock)
    assert await lock.try_acquire()
    assert lock.lease is not None
    assert lock.lease.deadline == pytest.approx(100.0 + 10.0 - lock.lease.margin)


async def test_a_renewal_answered_after_the_deadline_extends_nothing() -> None:
    clock = Clock()
    store = Store(clock)
    lock = KeyLock(store, "kq.q.lease.k", 3.0, clock=clock)
    assert await lock.try_acquire()
    store.delay = 5.0
    await lock.renew()
    assert not lock.held


async def test_a_renewal_that_finds_its_own_late_write_adopts_it() -> None:
    clock = Clock()
    store = Store(clock)
    lock = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock)
    assert await lock.try_acquire()
    await store.compare_and_set(lock.subject, lock.seq, lock._body(0.0), lock.ttl)  # landed, reply lost
    await lock.renew()
    assert lock.seq == store.seq and lock.held


async def test_a_renewal_that_finds_another_holders_record_loses_the_lease() -> None:
    clock = Clock()
    store = Store(clock)
    lock = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock)
    assert await lock.try_acquire()
    store.last = StoredMsg(lock.subject, 99, {}, json.dumps({"nonce": "someone else"}).encode())
    with pytest.raises(LeaseLost):
        await lock.renew()
    assert not lock.held


class Unanswered(Store):
    """A lease stream whose writes go unanswered and whose reads get "no responders" (a stream
    electing its leader) on a live connection; counts the reads."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.reads = 0

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        raise KeyqueueTimeout("no reply to the write")

    async def last_record(self, subject: str) -> StoredMsg | None:
        self.reads += 1
        raise ConnectionFailed(f"nobody answered a read (no responders on {subject})")

    async def wait_connected(self, timeout: float) -> bool:
        return True  # connected all along: only the stream does not answer

    closed = False
    """The connection is never closed for good here."""


async def test_a_claim_whose_reads_get_no_responders_looks_again_after_a_growing_pause() -> None:
    store = Unanswered(Clock())
    lock = KeyLock(store, "kq.q.lease.k", 1.0)  # the real clock: a second of patience
    with pytest.raises(KeyqueueTimeout, match="could not learn whether a write"):
        await lock.try_acquire()
    # Pauses of 0.02 s doubling to 1 s fit a handful of reads in the second; at once, thousands.
    assert 1 < store.reads <= 8
    assert lock.unsettled  # the release looks for a record of this claim


async def test_a_waiter_logs_once_that_a_remote_holder_stopped_renewing_with_the_most_its_record_lasts(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store = Store(clock)
    holder = KeyLock(store, "kq.shop.lease.o1", 30.0, holder={"worker": "far-1", "host": "elsewhere", "pid": 7},
                     clock=clock)
    assert await holder.try_acquire()
    waiter = KeyLock(store, "kq.shop.lease.o1", 30.0, clock=clock)
    caplog.set_level("INFO", logger="keyqueue.session")
    assert not await waiter.clear_expired()  # first sight: a live holder renews every 10 s
    clock.now += 10.0
    assert not await waiter.clear_expired()
    assert "looks gone" not in caplog.text
    clock.now += 5.0  # 15 s without a rewrite: past a live holder's interval (and its slack)
    assert not await waiter.clear_expired()
    clock.now += 5.0
    assert not await waiter.clear_expired()
    [line] = [r.getMessage() for r in caplog.records if "looks gone" in r.getMessage()]
    assert line.startswith("queue shop key o1 waits for the lease record of worker far-1 (pid 7 on elsewhere), "
                           "which looks gone: it has not renewed its record for 15s (a live holder renews it every "
                           "10s); the key is free when the record expires, in at most 15s")
    role = KeyLock(store, "kq.shop.role.reconciler", 30.0, clock=clock)  # a fleet role's record: not a key's
    store.last = StoredMsg("kq.shop.role.reconciler", 9, {}, json.dumps({"worker": "far-1", "ttl": 30}).encode())
    assert not await role.clear_expired()
    clock.now += 20.0
    assert not await role.clear_expired()
    assert len([r for r in caplog.records if "looks gone" in r.getMessage()]) == 1


class Stamped(Store):
    """Records stamped by the server's wall clock, which reads ``server`` seconds."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.server = 1_000_000.0

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        seq = await super().compare_and_set(subject, expected, body, ttl, timeout)
        assert self.last is not None
        stamp = datetime.fromtimestamp(self.server, UTC).isoformat().replace("+00:00", "Z")
        self.last = StoredMsg(subject, seq, {}, body, stamp)
        return seq


async def test_a_waiter_removes_a_record_the_server_kept_past_its_ttl_by_the_servers_own_clock(
        caplog: pytest.LogCaptureFixture) -> None:
    """One server stamps the records and the tokens: once what the worker knows of its clock (never
    ahead of it) is past a record's TTL, the server should have removed it, and its holder's lease
    is over. The waiter removes it then, not after watching it for twice the TTL."""
    clock = Clock()
    store = Stamped(clock)
    holder = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock)
    assert await holder.try_acquire()
    known: list[float | None] = [None]
    waiter = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock, server_now=lambda: known[0])
    assert not await waiter.clear_expired()  # the server's time unknown: only the watch decides
    assert waiter.expires_in is None
    known[0] = store.server + 10.0  # the TTL (10 s) is over, but not by the slack
    assert not await waiter.clear_expired()
    assert waiter.expires_in == pytest.approx(EXPIRED_SLACK)
    caplog.set_level(logging.WARNING, "keyqueue.session")
    known[0] = store.server + 10.0 + EXPIRED_SLACK + 0.01
    assert await waiter.clear_expired()
    assert store.last is None
    assert "past its TTL by the server's own clock" in caplog.text


async def test_a_live_holders_record_is_never_past_its_ttl_by_the_servers_clock() -> None:
    clock = Clock()
    store = Stamped(clock)
    holder = KeyLock(store, "kq.q.lease.k", 9.0, clock=clock)
    assert await holder.try_acquire()
    waiter = KeyLock(store, "kq.q.lease.k", 9.0, clock=clock, server_now=lambda: store.server)
    for _ in range(10):  # the holder renews every third of the TTL; the server's clock runs on
        store.server += 3.0
        clock.now += 3.0
        assert await holder.renew()
        assert not await waiter.clear_expired()
    assert store.last is not None


class Hanging(Unanswered):
    """Writes go unanswered and reads hang: nothing comes back at all."""

    async def last_record(self, subject: str) -> StoredMsg | None:
        self.reads += 1
        await asyncio.Event().wait()
        return None


async def test_a_claim_whose_look_hangs_gives_up_with_a_connection_error_not_a_bare_timeout() -> None:
    """The session retries a connection error (KeyqueueTimeout) while the token is its own; a bare
    TimeoutError from the look's deadline would end the session as failed instead."""
    store = Hanging(Clock())
    lock = KeyLock(store, "kq.q.lease.k", 1.0)  # the real clock: a second of patience
    with pytest.raises(KeyqueueTimeout, match="could not learn whether a write"):
        await lock.try_acquire()
    assert store.reads >= 1 and lock.unsettled and lock.unanswered


async def test_a_waiter_removes_at_once_a_record_of_its_own_workers_ended_claim(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store = Store(clock)
    ended = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock)
    assert await ended.try_acquire()  # a claim whose session is over, its record left behind
    stranger = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock, ended_claim=lambda: "another claim")
    assert not await stranger.clear_expired()
    caplog.set_level(logging.WARNING, "keyqueue.session")
    waiter = KeyLock(store, "kq.q.lease.k", 10.0, clock=clock, ended_claim=lambda: ended.nonce)
    assert await waiter.clear_expired()  # at first sight, not after twice the TTL
    assert store.last is None
    assert "a claim of this worker's whose session is over" in caplog.text
