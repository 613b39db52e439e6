"""The reconciler's decisions with a fake queue (the real server: test_core_basic.py).

Which keys get a token published, which are skipped, and who of the fleet runs the passes: the
worker holding the queue's reconciler role record, taken over when its holder's record is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from keyqueue.core.reconciler import Reconciler
from keyqueue.errors import KeyqueueError, KeyqueueTimeout, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.subjects import QueueNames

ROLE = "kq.q.role.reconciler"
LONG_AGO = "2000-01-01T00:00:00Z"


def server_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FakeQueue:
    """The queue as the reconciler sees it (a :class:`~keyqueue.core.key_io.ReconcilerIO`): its
    subjects, token publishes and lease records."""

    closed = False

    def __init__(self, requests: dict[str, int] | None = None, tokens: set[str] | None = None) -> None:
        self.names = QueueNames("q")
        self.requests = dict(requests or {})
        self.tokens = set(tokens or ())
        self.raced: set[str] = set()
        """Keys whose token another worker publishes between the scan and ours (10077)."""
        self.scheduled: list[str] = []
        self.scan_error: KeyqueueError | None = None
        self.write_error: KeyqueueError | None = None
        self.seq = 0
        self.records: dict[str, StoredMsg] = {}
        self.writes: list[tuple[str, int, dict[str, Any], int]] = []
        self.removed: list[int] = []

    # the scan and the token publish

    async def keys_with_requests(self) -> dict[str, int]:
        if self.scan_error is not None:
            raise self.scan_error
        return dict(self.requests)

    async def keys_with_tokens(self) -> set[str]:
        return set(self.tokens)

    async def schedule(self, key: str) -> bool:
        self.scheduled.append(key)
        if key in self.tokens | self.raced:
            return False
        self.tokens.add(key)
        return True

    # the lease stream

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        if self.write_error is not None:
            raise self.write_error
        self.writes.append((subject, expected, json.loads(body), ttl))
        current = self.records.get(subject)
        if (current.seq if current else 0) != expected:
            raise WrongLastSequence("wrong last sequence", 400, 10071)
        return self.put(subject, body, server_now()).seq

    async def last_record(self, subject: str) -> StoredMsg | None:
        return self.records.get(subject)

    unanswered_removals = False
    """Whether the lock may remove a record without waiting (as on one server)."""

    async def forget_record(self, seq: int, ttl: float) -> None:
        await self.remove_record(seq)

    async def remove_record(self, seq: int) -> None:
        self.removed.append(seq)
        self.records = {s: r for s, r in self.records.items() if r.seq != seq}

    async def wait_connected(self, timeout: float) -> bool:
        return True

    def put(self, subject: str, body: bytes, timestamp: str) -> StoredMsg:
        self.seq += 1
        self.records[subject] = StoredMsg(subject, self.seq, {}, body, timestamp)
        return self.records[subject]

    def role_holder(self) -> str | None:
        record = self.records.get(ROLE)
        return None if record is None else str(json.loads(record.data).get("worker"))


def reconciler(queue: FakeQueue, worker: str = "w1", interval: float = 30.0) -> Reconciler:
    return Reconciler(queue, interval=interval, worker=worker)


class Stop(Exception):
    """Ends a reconciler's run loop from its sleep (the loop only catches KeyqueueError)."""


class Ticks:
    """Stands in for the loop's pause: records each wait and stops the loop after ``rounds``."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.waits: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.waits.append(delay)
        if len(self.waits) >= self.rounds:
            raise Stop


async def run_for(monkeypatch: pytest.MonkeyPatch, rec: Reconciler, rounds: int) -> Ticks:
    ticks = Ticks(rounds)
    with monkeypatch.context() as patch:
        patch.setattr(rec, "_pause", ticks)
        with pytest.raises(Stop):
            await rec.run()
    return ticks


# --- which keys get a token -------------------------------------------------------------------------


async def test_only_keys_with_requests_and_no_token_get_one() -> None:
    queue = FakeQueue(requests={"a": 1, "b": 2, "c.d": 3}, tokens={"b", "idle"})
    rec = reconciler(queue)
    assert sorted(await rec.reconcile()) == ["a", "c.d"]
    assert sorted(queue.scheduled) == ["a", "c.d"]  # never a key with a token, nor one without requests


async def test_a_key_whose_token_appeared_meanwhile_is_not_counted() -> None:
    queue = FakeQueue(requests={"a": 1, "b": 1})
    queue.raced = {"b"}
    rec = reconciler(queue)
    assert await rec.reconcile() == ["a"]
    assert sorted(queue.scheduled) == ["a", "b"]
    assert rec.scheduled_total == 1


async def test_passes_and_scheduled_keys_add_up() -> None:
    queue = FakeQueue(requests={"a": 1, "b": 1})
    rec = reconciler(queue)
    await rec.reconcile()
    assert await rec.reconcile() == []  # their tokens exist now
    queue.requests["c"] = 1
    await rec.reconcile()
    assert (rec.passes, rec.scheduled_total) == (3, 3)


async def test_a_pass_that_scheduled_keys_logs_how_many_and_the_first_ten(caplog: pytest.LogCaptureFixture) -> None:
    queue = FakeQueue(requests={f"k{i:02d}": 1 for i in range(12)})
    rec = reconciler(queue)
    with caplog.at_level(logging.INFO, logger="keyqueue.reconciler"):
        await rec.reconcile()
        await rec.reconcile()  # nothing stranded: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        "queue q: reconciler scheduled 12 stranded key(s): " + ", ".join(f"k{i:02d}" for i in range(10))]


# --- the role ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("interval", "ack_wait", "ttl"), [(30.0, 60.0, 60), (0.75, 1.5, 2), (0.2, 1.0, 1)])
async def test_the_role_record_outlives_two_intervals_and_at_least_a_second(
        interval: float, ack_wait: float, ttl: int) -> None:
    queue = FakeQueue()
    rec = reconciler(queue, interval=interval)
    assert await rec.elected()
    assert rec._lock.ack_wait == ack_wait
    subject, expected, body, written_ttl = queue.writes[0]
    assert (subject, expected, written_ttl) == (ROLE, 0, ttl)
    assert (body["worker"], body["role"]) == ("w1", "reconciler")


async def test_one_worker_of_the_fleet_is_elected_and_stays_elected_by_renewing() -> None:
    queue = FakeQueue()
    first, second = reconciler(queue, "w1"), reconciler(queue, "w2")
    assert await first.elected()
    assert not await second.elected()
    seq = queue.records[ROLE].seq
    assert await first.elected()
    assert queue.writes[-1][1] == seq  # a renewal of its record, not a new claim
    assert not await second.elected()
    assert queue.role_holder() == "w1"
    assert queue.removed == []  # a live holder's record is left alone


async def test_a_holder_whose_record_was_taken_over_steps_down() -> None:
    queue = FakeQueue()
    first, second = reconciler(queue, "w1"), reconciler(queue, "w2")
    assert await first.elected()
    queue.records.pop(ROLE)  # its record expired (it was paused, say) ...
    assert await second.elected()  # ... and another worker took the role
    assert not await first.elected()
    assert queue.role_holder() == "w2"


async def test_a_holder_whose_lease_lapsed_waits_for_its_old_record_like_anyone_else() -> None:
    queue = FakeQueue()
    rec = reconciler(queue)
    assert await rec.elected()
    assert rec._lock.lease is not None
    rec._lock.lease.lose("paused past its lease")
    writes = len(queue.writes)
    assert not await rec.elected()
    assert queue.writes[writes:] and all(expected == 0 for _, expected, _, _ in queue.writes[writes:])
    queue.records.pop(ROLE)
    assert await rec.elected()
    # Each claim has its own nonce, so no record of a former claim can pass for the new one's.
    assert queue.writes[-1][2]["nonce"] != queue.writes[0][2]["nonce"]


async def test_a_dead_holders_record_the_server_kept_is_cleared_once_seen_unchanged_for_twice_its_ttl() -> None:
    queue = FakeQueue()
    dead = queue.put(ROLE, json.dumps({"worker": "dead", "ttl": 60}).encode(), LONG_AGO)
    rec = reconciler(queue)
    now = [1000.0]
    rec._expiry.clock = lambda: now[0]
    # Stamped long ago by the server's clock: that says nothing to this worker (clocks differ).
    assert not await rec.elected()
    assert queue.removed == []
    now[0] += 120.0
    assert not await rec.elected()  # each try is a new claim; what was seen is kept across them
    assert queue.removed == []
    now[0] += 0.001
    assert not await rec.elected()
    assert queue.removed == [dead.seq]
    assert await rec.elected()
    assert queue.role_holder() == "w1"


# --- the loop ---------------------------------------------------------------------------------------


async def test_only_the_elected_worker_runs_passes_one_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = FakeQueue(requests={"a": 1})
    first, second = reconciler(queue, "w1", interval=5.0), reconciler(queue, "w2", interval=5.0)
    ticks = await run_for(monkeypatch, first, rounds=3)
    assert ticks.waits == [5.0, 5.0, 5.0]
    assert (first.passes, first.scheduled_total) == (3, 1)
    await run_for(monkeypatch, second, rounds=3)
    assert second.passes == 0


async def test_a_failed_pass_or_election_is_logged_and_the_loop_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    queue = FakeQueue(requests={"a": 1})
    rec = reconciler(queue)
    queue.scan_error = KeyqueueTimeout("no reply to STREAM.INFO")
    with caplog.at_level(logging.WARNING, logger="keyqueue.reconciler"):
        await run_for(monkeypatch, rec, rounds=2)
        queue.scan_error = None
        queue.write_error = KeyqueueTimeout("no reply to a lease write")
        await run_for(monkeypatch, rec, rounds=1)
    assert rec.passes == 2
    # One warning per outage (the retries in between are at DEBUG).
    assert [r.getMessage() for r in caplog.records] == [
        "queue q: reconcile pass failed: no reply to STREAM.INFO; trying again in 0.5s",
        "queue q: reconcile pass failed: no reply to a lease write; trying again in 0.5s"]


async def test_a_failed_pass_is_tried_again_sooner_and_sooner_up_to_the_interval(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # An outage refused tokens: the pass after it repairs them, so it comes as soon as the
    # streams may answer again, not an interval later; a pass that succeeds resets the backoff.
    queue = FakeQueue(requests={"a": 1})
    rec = reconciler(queue, interval=5.0)
    queue.scan_error = KeyqueueTimeout("no reply to STREAM.INFO")
    with caplog.at_level(logging.DEBUG, logger="keyqueue.reconciler"):
        assert (await run_for(monkeypatch, rec, rounds=6)).waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    # Warned at the outage's first failure, then once per interval while it lasts.
    assert [r.levelno for r in caplog.records] == [logging.WARNING] + [logging.DEBUG] * 3 + [logging.WARNING] * 2
    queue.scan_error = None
    assert (await run_for(monkeypatch, rec, rounds=2)).waits == [5.0, 5.0]
    assert queue.scheduled == ["a"]


async def test_a_woken_reconciler_runs_its_pass_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = FakeQueue(requests={"a": 1})
    rec = reconciler(queue, interval=3600.0)
    passes: asyncio.Queue[int] = asyncio.Queue()
    reconcile = rec.reconcile

    async def counted() -> list[str]:
        scheduled = await reconcile()
        passes.put_nowait(rec.passes)
        return scheduled

    monkeypatch.setattr(rec, "reconcile", counted)
    running = asyncio.create_task(rec.run())
    try:
        assert await asyncio.wait_for(passes.get(), 5) == 1
        for n in (2, 3):
            rec.wake()  # a token stream back from an outage, a connection back
            assert await asyncio.wait_for(passes.get(), 5) == n
        assert queue.scheduled == ["a"]
    finally:
        running.cancel()
