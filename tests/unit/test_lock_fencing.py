"""KeyLock's fencing with a fake lease stream and a fake clock (the real server: test_key_lock.py).

What a record says, that fencing numbers only grow from one holder to the next, that a holder
only ever removes its own record (and every record of its own, even one whose write went
unanswered), the TTL's rounding, and when a stuck record counts as expired: by what the waiter
saw on its own clock, never by comparing wall clocks.
test_lock_bookkeeping.py covers when the lease runs from and how a renewal settles.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyqueue.core.lock import KeyLock, StaleRecordWatch
from keyqueue.errors import Disconnected, KeyqueueTimeout, LeaseLost, ReplyLost, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg

SUBJECT = "kq.q.lease.order-17"
WRITTEN = "2025-01-01T00:00:00Z"
WRITTEN_UNIX = 1735689600.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Write:
    subject: str
    expected: int
    body: dict[str, Any]
    ttl: int
    timeout: float | None


class Store:
    """The lease stream: sequences are stream-wide and only grow, writes are compare-and-set per
    subject, and a record is removed by its sequence only."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.seq = 0
        self.records: dict[str, StoredMsg] = {}
        self.writes: list[Write] = []
        self.removed: list[int] = []
        self.delay = 0.0
        """Seconds of the fake clock each write takes."""
        self.reads_hang = False
        self.reply_lost: type[Exception] | None = None
        """The next write is stored (or refused) but its reply is lost with this error."""
        self.reads_fail = 0
        """How many reads fail (the connection is down) before they succeed again."""
        self.reads_stale = 0
        """How many reads miss the latest write (a write still in flight on a replicated stream)."""
        self.connected = True

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        self.writes.append(Write(subject, expected, json.loads(body), ttl, timeout))
        self.clock.now += self.delay
        lost, self.reply_lost = self.reply_lost, None
        current = self.records.get(subject)
        if (current.seq if current else 0) != expected:
            if lost is not None:
                raise lost("reply lost")
            raise WrongLastSequence("wrong last sequence", 400, 10071)
        self.seq += 1
        self.records[subject] = StoredMsg(subject, self.seq, {}, body, WRITTEN)
        if lost is not None:
            raise lost("reply lost")
        return self.seq

    async def last_record(self, subject: str) -> StoredMsg | None:
        if self.reads_hang:
            await asyncio.Event().wait()
        if self.reads_fail:
            self.reads_fail -= 1
            raise Disconnected("down")
        if self.reads_stale:
            self.reads_stale -= 1
            return None
        return self.records.get(subject)

    async def wait_connected(self, timeout: float) -> bool:
        return self.connected

    closed = False
    """The connection is never closed for good here."""

    unanswered_removals = False
    """Whether the lock may remove a record without waiting (as on one server)."""

    async def forget_record(self, seq: int, ttl: float) -> None:
        await self.remove_record(seq)

    async def remove_record(self, seq: int) -> None:
        self.removed.append(seq)
        self.records = {s: r for s, r in self.records.items() if r.seq != seq}

    def expire(self, subject: str = SUBJECT) -> None:
        """The server's TTL ran out."""
        self.records.pop(subject, None)

    def put(self, data: bytes, *, timestamp: str = WRITTEN, subject: str = SUBJECT) -> StoredMsg:
        """Another writer's record."""
        self.seq += 1
        self.records[subject] = StoredMsg(subject, self.seq, {}, data, timestamp)
        return self.records[subject]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> Store:
    return Store(clock)


def new_lock(store: Store, ack_wait: float = 10.0, **holder: Any) -> KeyLock:
    return KeyLock(store, SUBJECT, ack_wait, holder=holder, clock=store.clock)


# --- the record -------------------------------------------------------------------------------------


async def test_a_record_names_its_holder_its_claim_and_its_ttl_in_compact_json(store: Store) -> None:
    lock = new_lock(store, worker="w1", token=7)
    before = datetime.now(UTC)
    assert await lock.try_acquire()
    record = store.records[SUBJECT]
    body = json.loads(record.data)
    assert body == {"worker": "w1", "token": 7, "nonce": lock.nonce, "fence": 0, "since": lock.since, "ttl": 10,
                    "sent": 100.0}  # on the holder's own (here: fake) clock
    assert b" " not in record.data
    since = datetime.fromisoformat(body["since"])
    assert since.utcoffset() == timedelta(0)
    assert len(body["since"].split(".")[1]) == len("000+00:00")  # milliseconds
    assert before - timedelta(milliseconds=1) <= since <= datetime.now(UTC)


async def test_the_claims_own_fields_win_over_holder_fields_of_the_same_name(store: Store) -> None:
    lock = new_lock(store, nonce="forged", fence=99, ttl=1, since="never")
    assert await lock.try_acquire()
    await lock.renew()
    body = store.writes[-1].body
    assert (body["nonce"], body["fence"], body["ttl"], body["since"]) == (lock.nonce, lock.fence, 10, lock.since)


async def test_the_holder_is_a_copy_of_what_the_caller_passed(store: Store) -> None:
    holder = {"worker": "w1"}
    lock = KeyLock(store, SUBJECT, 10.0, holder=holder, clock=store.clock)
    holder["worker"] = "w2"
    assert await lock.try_acquire()
    assert store.writes[-1].body["worker"] == "w1"


def test_every_claim_has_its_own_nonce(store: Store) -> None:
    nonces = {new_lock(store).nonce for _ in range(100)}
    assert len(nonces) == 100
    assert all(int(n, 16) >= 0 for n in nonces)


def test_a_record_is_the_json_of_the_holders_fields_and_the_claims(store: Store) -> None:
    lock = new_lock(store)
    lock.fence, lock.since = 7, "2026-11-27T17:00:00.000+00:00"
    for sent in (12345.6789012, 0.0, 3.0):
        assert json.loads(lock._body(sent)) == {**lock.holder, "nonce": lock.nonce, "fence": 7, "since": lock.since,
                                               "ttl": lock.ttl, "sent": round(sent, 6)}
    lock.update_holder(delivered=2, ack="$JS.ACK.q.workers.2")  # a redelivered token's, as the session adopts it
    assert json.loads(lock._body(1.0))["delivered"] == 2 and json.loads(lock._body(1.0))["ack"].endswith(".2")


def test_a_forked_child_draws_its_own_nonce_prefix(store: Store) -> None:
    from keyqueue.core import lock as lock_module

    parent = new_lock(store).nonce
    lock_module._NONCES[0] = -1  # as in a child forked after the parent drew its prefix
    child = new_lock(store).nonce
    assert parent[:12] != child[:12]


# --- fencing ----------------------------------------------------------------------------------------


async def test_renewals_chain_on_the_last_record_and_carry_the_fence_of_the_acquire(store: Store) -> None:
    store.put(b"{}", subject="kq.q.lease.other")  # sequences are stream-wide
    lock = new_lock(store)
    assert await lock.try_acquire()
    assert (lock.fence, lock.seq) == (2, 2)
    await lock.renew()
    await lock.renew()
    assert (lock.fence, lock.seq) == (2, 4)
    assert [(w.expected, w.body["fence"]) for w in store.writes] == [(0, 0), (2, 2), (3, 2)]
    assert len({w.body["since"] for w in store.writes}) == 1  # when the claim began


async def test_a_refused_acquire_leaves_the_claim_empty(store: Store) -> None:
    holder = new_lock(store)
    assert await holder.try_acquire()
    other = new_lock(store)
    assert not await other.try_acquire()
    assert (other.fence, other.seq, other.lease, other.held) == (0, 0, None, False)
    with pytest.raises(LeaseLost, match="never acquired"):
        await other.renew()
    await other.release()
    assert store.removed == []
    assert store.records[SUBJECT].seq == holder.seq


async def test_each_new_holder_gets_a_greater_fence_after_a_release_or_an_expiry(store: Store) -> None:
    first, second, third = new_lock(store), new_lock(store), new_lock(store)
    assert await first.try_acquire()
    await first.renew()
    await first.release()
    assert await second.try_acquire()
    store.expire()
    assert await third.try_acquire()
    assert first.fence < second.fence < third.fence
    assert second.fence > first.seq  # greater than any record of the former holder, renewals too


async def test_a_former_holder_removes_only_its_own_record(store: Store) -> None:
    former, current = new_lock(store), new_lock(store)
    assert await former.try_acquire()
    store.expire()
    assert await current.try_acquire()
    await former.release()
    assert store.removed == [former.seq]
    assert store.records[SUBJECT].seq == current.seq
    with pytest.raises(LeaseLost, match="another worker acquired"):
        await former.renew()
    assert store.records[SUBJECT].seq == current.seq


Step = tuple[str, int]
STEPS = st.lists(st.tuples(st.sampled_from(["acquire", "renew", "release", "expire"]), st.integers(0, 2)),
                 max_size=40)


@given(STEPS)
async def test_fences_strictly_increase_and_only_the_writer_of_the_live_record_holds_it(steps: list[Step]) -> None:
    clock = Clock()
    store = Store(clock)
    locks = [new_lock(store) for _ in range(3)]
    fences = []
    owner: KeyLock | None = None  # whose record is live
    for op, i in steps:
        lock = locks[i]
        if op == "acquire":
            if await lock.try_acquire():
                assert owner is None
                owner = lock
                fences.append(lock.fence)
            else:
                assert owner is not None
        elif op == "renew":
            try:
                await lock.renew()
                assert lock is owner
            except LeaseLost:
                assert lock is not owner
        elif op == "release":
            await lock.release()
            if lock is owner:
                owner = None
        else:
            store.expire()
            owner = None
        live = store.records.get(SUBJECT)
        assert (live is None) == (owner is None)
        if owner is not None and live is not None:
            assert json.loads(live.data)["nonce"] == owner.nonce
            assert live.seq == owner.seq
    assert fences == sorted(set(fences))


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b'"a string"', b"{}"])
async def test_an_unreadable_or_anonymous_record_is_not_ours(store: Store, data: bytes) -> None:
    lock = new_lock(store)
    assert await lock.try_acquire()
    store.put(data)
    with pytest.raises(LeaseLost):
        await lock.renew()
    assert not lock.held


# --- renewal timing ---------------------------------------------------------------------------------


async def test_a_renewal_waits_for_its_reply_no_longer_than_the_lease_has_left(store: Store, clock: Clock) -> None:
    lock = new_lock(store)
    assert await lock.try_acquire()  # at 100: the lease ends at 109
    assert store.writes[0].timeout is None
    clock.now = 103.5
    await lock.renew()
    assert store.writes[1].timeout == 5.5


async def test_a_lapsed_lease_is_not_renewed(store: Store, clock: Clock) -> None:
    lock = new_lock(store)
    assert await lock.try_acquire()
    clock.now = 109.0
    with pytest.raises(LeaseLost, match="expired"):
        await lock.renew()
    assert len(store.writes) == 1


async def test_a_refused_renewal_whose_lookup_outlasts_the_lease_loses_it(store: Store) -> None:
    lock = new_lock(store)
    assert await lock.try_acquire()
    store.put(lock._body(0.0))  # our own renewal landed, its reply was lost: the next one is refused ...
    store.delay = 10.0  # ... after the lease is over
    store.reads_hang = True  # and the lookup that would prove the record ours does not come back
    with pytest.raises(LeaseLost, match="another worker acquired"):
        await asyncio.wait_for(lock.renew(), 5)


# --- the TTL ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ack_wait", "ttl"), [(0.2, 1), (1.0, 1), (2.1, 3), (30.0, 30), (30.0001, 31)])
async def test_the_ttl_is_ack_wait_rounded_up_to_whole_seconds_on_every_write(
        store: Store, ack_wait: float, ttl: int) -> None:
    lock = new_lock(store, ack_wait)
    assert lock.ttl == ttl
    assert await lock.try_acquire()
    await lock.renew()
    assert [w.ttl for w in store.writes] == [ttl, ttl]
    assert [w.body["ttl"] for w in store.writes] == [ttl, ttl]


@given(st.floats(0.001, 1e6, allow_nan=False))
def test_the_record_never_expires_before_the_lease(ack_wait: float) -> None:
    ttl = KeyLock(Store(Clock()), SUBJECT, ack_wait).ttl
    assert isinstance(ttl, int)
    assert ack_wait <= ttl < ack_wait + 1


# --- records the server failed to expire ------------------------------------------------------------


async def test_a_record_is_cleared_only_once_the_waiter_saw_the_same_one_for_twice_its_ttl(
        store: Store, clock: Clock) -> None:
    record = store.put(json.dumps({"ttl": 10}).encode())
    lock = new_lock(store, 3.0)  # the record's own ttl counts, not this worker's
    assert not await lock.clear_expired()  # first sight, at 100
    clock.now = 120.0
    assert not await lock.clear_expired()
    clock.now = 120.001
    assert await lock.clear_expired()
    assert store.removed == [record.seq]
    assert SUBJECT not in store.records


async def test_a_record_rewritten_meanwhile_starts_the_count_again(store: Store, clock: Clock) -> None:
    store.put(json.dumps({"ttl": 10}).encode())
    lock = new_lock(store)
    assert not await lock.clear_expired()
    clock.now = 115.0
    renewed = store.put(json.dumps({"ttl": 10}).encode())  # its holder renewed it: alive
    assert not await lock.clear_expired()
    clock.now = 130.0  # 30 s after the first sight, but only 15 s after this record
    assert not await lock.clear_expired()
    clock.now = 135.001
    assert await lock.clear_expired()
    assert store.removed == [renewed.seq]


async def test_a_record_stamped_long_ago_by_the_servers_clock_is_not_cleared_on_sight(store: Store) -> None:
    """The defect: a waiter compared the record's server timestamp with its own wall clock, so a
    worker whose clock ran ahead took a live holder's record for expired and deleted it."""
    store.put(json.dumps({"ttl": 3}).encode(), timestamp="1999-01-01T00:00:00Z")
    lock = new_lock(store, 3.0)
    assert not await lock.clear_expired()
    assert not await lock.clear_expired()
    assert store.removed == []


@pytest.mark.parametrize("data", [b"{}", b"not json", b"[]"])
async def test_a_record_without_a_readable_ttl_is_judged_by_this_workers_ttl(
        store: Store, clock: Clock, data: bytes) -> None:
    store.put(data)
    lock = new_lock(store, 3.0)
    assert not await lock.clear_expired()
    clock.now += 6.0
    assert not await lock.clear_expired()
    clock.now += 0.001
    assert await lock.clear_expired()


async def test_no_record_clears_nothing(store: Store, clock: Clock) -> None:
    lock = new_lock(store)
    assert not await lock.clear_expired()
    clock.now += 1e6
    assert not await lock.clear_expired()
    assert store.removed == []


def test_the_stale_watch_needs_two_looks_at_one_sequence() -> None:
    clock = Clock()
    watch = StaleRecordWatch(clock)
    assert not watch.stale(5, ttl=1.0)
    clock.now += 100.0
    assert watch.stale(5, ttl=1.0)
    assert not watch.stale(6, ttl=1.0)  # another record: a new first sight
    clock.now += 2.0
    assert not watch.stale(6, ttl=1.0)
    clock.now += 0.001
    assert watch.stale(6, ttl=1.0)


# --- writes whose reply never came ------------------------------------------------------------------


@pytest.mark.parametrize("lost", [ReplyLost, KeyqueueTimeout])
async def test_an_acquire_stored_with_its_reply_lost_is_found_to_be_ours(
        store: Store, lost: type[Exception]) -> None:
    lock = new_lock(store)
    store.reply_lost = lost
    assert await lock.try_acquire()
    assert (lock.fence, lock.seq) == (store.records[SUBJECT].seq, store.records[SUBJECT].seq)
    assert lock.held and lock.lease is not None
    assert lock.lease.deadline == 100.0 + 10.0 - 1.0  # from when the write was sent
    assert not lock.unsettled


async def test_an_acquire_refused_with_its_reply_lost_is_not_ours(store: Store) -> None:
    other = store.put(b'{"nonce": "someone else"}')
    lock = new_lock(store)
    store.reply_lost = ReplyLost
    assert not await lock.try_acquire()
    assert lock.lease is None
    assert store.records[SUBJECT] == other


async def test_an_acquire_whose_fate_cannot_be_learnt_in_time_raises_and_its_release_removes_it(
        store: Store) -> None:
    lock = new_lock(store)
    store.reply_lost = ReplyLost
    store.reads_fail = 1
    store.connected = False
    with pytest.raises(KeyqueueTimeout, match="could not learn"):
        await lock.try_acquire()
    assert lock.unsettled and lock.lease is None
    stored = store.records[SUBJECT]
    await lock.release()  # later, once connected: the orphan is found by its nonce and removed
    assert store.removed == [stored.seq]
    assert SUBJECT not in store.records


async def test_a_release_after_a_renewal_whose_reply_was_lost_leaves_no_orphan(store: Store) -> None:
    """The defect: the renewal was stored, its reply came late, and the release deleted only the
    old sequence; the renewed record lived out its TTL with nobody holding the key."""
    lock = new_lock(store)
    assert await lock.try_acquire()
    first = lock.seq
    store.reply_lost = ReplyLost
    with pytest.raises(ReplyLost):
        await lock.renew()
    assert lock.unsettled and lock.seq == first
    renewed = store.records[SUBJECT].seq
    assert renewed != first
    await lock.release()
    assert store.removed == [first, renewed]
    assert SUBJECT not in store.records


async def test_a_renewal_that_loses_a_race_to_its_own_record_keeps_the_key_and_says_not_extended(
        store: Store, clock: Clock) -> None:
    lock = new_lock(store)
    assert await lock.try_acquire()
    assert lock.lease is not None
    deadline = lock.lease.deadline
    store.put(lock._body(0.0))  # one of ours landed unanswered (or, on R3, a 10164 while another write was in flight)
    clock.now = 103.0
    assert await lock.renew() is False
    assert lock.held and lock.lease.deadline == deadline
    assert lock.seq == store.records[SUBJECT].seq
    assert await lock.renew() is True
    assert lock.lease.deadline == 103.0 + 10.0 - 1.0


async def test_a_record_left_by_an_earlier_unanswered_try_lasts_from_that_tries_send_time(
        store: Store, clock: Clock) -> None:
    """The overlap the cluster soak found: a try's write landed but its reply was lost and the look
    that followed missed it (still in flight); a later try, refused by that very record, or
    unanswered too, found it ours and held the key for a lease counted from the later try, while
    the server expired the record a lease after the earlier one. Another worker then took the key
    beside it. The record now says when it was sent."""
    lock = new_lock(store)  # ack_wait 10, margin 1
    store.reply_lost = ReplyLost
    store.reads_stale = 1
    assert not await lock.try_acquire()  # at 100: stored, unanswered, not seen
    assert lock.unsettled and store.records[SUBJECT]
    clock.now = 101.0
    assert await lock.try_acquire()  # refused by our own record: it is ours, from 100
    assert lock.lease is not None and lock.lease.deadline == 109.0  # not 110 (101 + 10 - 1)
    assert lock.seq == store.records[SUBJECT].seq and not lock.unsettled


async def test_an_own_record_about_to_expire_is_removed_rather_than_taken(store: Store, clock: Clock) -> None:
    lock = new_lock(store)
    store.reply_lost = ReplyLost
    store.reads_stale = 1
    assert not await lock.try_acquire()  # at 100
    stale = store.records[SUBJECT]
    clock.now = 107.0  # its lease would end at 109: less than a renewal interval left
    assert not await lock.try_acquire()
    assert store.removed == [stale.seq] and SUBJECT not in store.records
    assert lock.lease is None
    assert await lock.try_acquire()  # afresh, from 107
    assert lock.lease is not None and lock.lease.deadline == 116.0
