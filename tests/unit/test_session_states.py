"""The key session's state changes, and what it tells its observer, against a fake ``KeyIO``.

Pure logic: the fake keeps a key's inbox and lease records in memory and records every write
the session makes. That the protocol works against NATS is proven by the integration tests
(test_core_basic.py, test_session_defects.py, test_core_faults.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
from nats.aio.msg import Msg

from keyqueue.core import removals as removals_module
from keyqueue.core.observer import KeyHold, NullObserver, Outcome, RequestAttempt, SessionEnd
from keyqueue.core.processor import BaseProcessor, BatchOutcome, Reply, Request, RequestContext, SessionContext
from keyqueue.core.removals import PURGE_EVERY
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import KeySession, SessionSettings
from keyqueue.errors import KeyqueueTimeout, Reject, ReplyLost, WrongLastSequence
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.queue_io import HEAD_TTL, Watch, head_runs_added
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.wire import headers as H

KEY = "k"


def stored(seq: int, body: bytes, message_type: str = "Work", reply: bool = False) -> StoredMsg:
    headers = {H.MSG_ID: f"r{seq}", H.MESSAGE_TYPE: message_type}
    if reply:
        headers[H.REPLY_INBOX] = f"_INBOX.r{seq}"
    return StoredMsg(f"kq.q.in.{KEY}", seq, headers, body)


class FakeIO:
    """One key's inbox and the queue's lease stream in memory; ``writes`` lists what the session sent.

    A :class:`~keyqueue.core.key_io.KeyIO` (mypy checks it where a session is built below)."""

    direct = False
    """Reads are answered by :meth:`read` (a session sends its first read as a task, as on a replicated inbox)."""
    release_markers = False
    """Keys are given back with a purge and a re-check (the marker's give-back is proven against a real
    server: tests/integration/test_release_marker.py)."""

    def __init__(self, *requests: StoredMsg) -> None:
        self.names = QueueConfig("q").names
        self.inbox = {m.seq: m for m in requests}
        self.records: dict[str, StoredMsg] = {}
        self.record_seq = 0
        self.writes: list[tuple[Any, ...]] = []
        self.on_refused: list[Callable[[], object]] = []
        """Called each time a lease write is refused."""

    # the key's requests
    async def read(self, key: str, from_seq: int, limit: int) -> tuple[list[StoredMsg], bool]:
        found = [self.inbox[s] for s in sorted(self.inbox) if s >= from_seq]
        return found[:limit], len(found) > limit

    async def send_read(self, key: str, from_seq: int, limit: int) -> asyncio.Future[list[Msg]]:
        raise AssertionError("direct gets only (this inbox is read with read)")

    async def read_reply(self, key: str, sent: asyncio.Future[list[Msg]]) -> tuple[list[StoredMsg], bool]:
        raise AssertionError("direct gets only (this inbox is read with read)")

    async def next_request(self, key: str, from_seq: int, *, requests_only: bool = False) -> StoredMsg | None:
        return next((self.inbox[s] for s in sorted(self.inbox) if s >= from_seq), None)

    async def request_remains(self, key: str, from_seq: int) -> bool:
        return await self.next_request(key, from_seq) is not None

    async def watch(self, key: str) -> Watch:
        return Watch()

    async def delete(self, seq: int) -> None:
        self.writes.append(("delete", seq))
        self.inbox.pop(seq, None)

    async def purge_soon(self, key: str, seq: int) -> asyncio.Future[list[Msg]]:
        await self.purge_through(key, seq)
        done: asyncio.Future[list[Msg]] = asyncio.get_running_loop().create_future()
        done.set_result([])
        return done

    async def settle(self, futures: Sequence[asyncio.Future[list[Msg]]]) -> None:
        return None

    def confirmed(self, future: asyncio.Future[list[Msg]]) -> bool:
        return future.done()

    async def purge_through(self, key: str, seq: int) -> int:
        self.writes.append(("purge", seq))
        gone = [s for s in self.inbox if s <= seq]
        for s in gone:
            del self.inbox[s]
        return len(gone)

    # outputs
    async def mark_released(self, key: str, last_seq: int, timeout: float | None = None) -> bool:
        raise AssertionError("no release markers here (release_markers is False)")

    async def dead_letter(self, key: str, msg: StoredMsg, headers: Mapping[str, str], *,
                          dedupe: str | None = None) -> None:
        self.writes.append(("dead_letter", msg.seq, headers[H.DLQ_REASON]))

    async def reply(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        self.writes.append(("reply", inbox, headers[H.STATUS]))

    async def progress(self, key: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.writes.append(("progress", body))

    # lease records
    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        last = self.records.get(subject)
        if (last.seq if last else 0) != expected:
            for refused in self.on_refused:
                refused()
            raise WrongLastSequence("wrong last sequence", 400, 10071)
        self.record_seq += 1
        self.records[subject] = StoredMsg(subject, self.record_seq, {}, body)
        return self.record_seq

    async def last_record(self, subject: str) -> StoredMsg | None:
        return self.records.get(subject)

    async def add_head_runs(self, key: str, seq: int, *, runs: int = 0, killed: int = 0) -> tuple[int, int]:
        subject = self.names.head(key)
        record = await self.last_record(subject)
        new_runs, new_killed, body = head_runs_added(record, seq, runs=runs, killed=killed)
        await self.compare_and_set(subject, record.seq if record is not None else 0, body, HEAD_TTL)
        return new_runs, new_killed

    unanswered_removals = True
    """Whether the lock may remove a record without waiting (as on one server)."""

    async def forget_record(self, seq: int, ttl: float) -> None:
        await self.remove_record(seq)

    async def remove_record(self, seq: int) -> None:
        for subject, record in list(self.records.items()):
            if record.seq == seq:
                del self.records[subject]

    def steal(self) -> None:
        """Another worker writes the key's lease record (this holder's lapsed)."""
        self.record_seq += 1
        subject = self.names.lease(KEY)
        self.records[subject] = StoredMsg(subject, self.record_seq, {}, b'{"nonce": "theirs"}')

    # the token
    async def keepalive(self, token: Token) -> None:
        return None

    async def ack(self, token: Token, timeout: float = 5.0) -> None:
        self.writes.append(("ack", token.reply))

    async def release_token(self, token: Token, timeout: float = 5.0) -> None:
        await self.ack(token, timeout)

    async def delete_token(self, token: Token) -> None:
        self.writes.append(("delete_token", token.stream_seq))

    async def wait_connected(self, timeout: float) -> bool:
        return True

    closed = False

    async def nak(self, token: Token, delay: float = 0.0) -> None:
        self.writes.append(("nak", token.reply))

    replicated = False
    refuse_schedules = 0
    """How many of the next schedules are refused (a token is stored for the key)."""
    stored_token: int | None = None
    """The sequence of the key's stored token, as :meth:`token_stored` reads it."""

    async def schedule(self, key: str) -> bool:
        self.writes.append(("schedule", key))
        if self.refuse_schedules:
            self.refuse_schedules -= 1
            return False
        return True

    async def token_stored(self, token: Token) -> bool:
        return self.stored_token == token.stream_seq


class Steps(NullObserver):
    """Records every step a session reports, in order."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []
        self.ends: list[SessionEnd] = []

    def key_acquired(self, hold: KeyHold) -> None:
        self.steps.append(("acquired", hold.key, hold.fencing))

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        self.ends.append(end)
        self.steps.append(("released", end.outcome.value))

    def request_started(self, attempt: RequestAttempt) -> None:
        self.steps.append(("started", attempt.seq, attempt.attempt, attempt.message_type))

    def attempt_failed(self, attempt: RequestAttempt, error: BaseException) -> None:
        self.steps.append(("failed", attempt.seq, attempt.attempt, type(error).__name__))

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        self.steps.append(("retried", attempt.seq, attempt.attempt))

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        self.steps.append(("succeeded", request.seq, request.message_type, superseded_by))

    def request_dead_lettered(self, request: RequestAttempt, reason: str, error: BaseException) -> None:
        self.steps.append(("dead_lettered", request.seq, reason, request.attempt))

    def around_attempt(self, attempt: RequestAttempt, context: RequestContext,
                       requests: Sequence[Request]) -> AbstractAsyncContextManager[object]:
        return self._around(attempt.seq)

    @asynccontextmanager
    async def _around(self, seq: int) -> AsyncIterator[None]:
        self.steps.append(("enter", seq))
        try:
            yield
        finally:
            self.steps.append(("exit", seq))

    async def wait_for_room(self) -> None:
        self.steps.append(("room",))


class Handles(BaseProcessor):
    """Runs ``handle`` for each request: ``outcomes`` by body (an exception is raised)."""

    def __init__(self, steps: Steps, outcomes: Mapping[bytes, list[Reply | Exception | None]] | None = None) -> None:
        self.steps = steps
        self.outcomes = {body: list(queue) for body, queue in (outcomes or {}).items()}

    async def open(self, ctx: SessionContext) -> None:
        self.steps.steps.append(("open",))

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.steps.steps.append(("handle", request.seq))
        queue = self.outcomes.get(request.data)
        outcome = queue.pop(0) if queue else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        return RetryPolicy(max_attempts=3, base_delay=0.0, jitter=0.0)


def token(delivered: int = 1) -> Token:
    return Token(KEY, f"kq.q.token.{KEY}", f"$JS.ACK.token.{delivered}", 7, delivered, time.monotonic())


def session(io: FakeIO, processor: BaseProcessor, steps: Steps, *, delivered: int = 1,
            draining: asyncio.Event | None = None, ack_wait: float = 5.0) -> KeySession:
    settings = SessionSettings(ack_wait=ack_wait, linger=0.0)
    return KeySession(io, token(delivered), lambda key: processor, settings, observer=steps,
                      draining=draining or asyncio.Event(), worker="w1")


def sent(io: FakeIO, *kinds: str) -> list[tuple[Any, ...]]:
    return [w for w in io.writes if w[0] in kinds]


async def test_requests_run_in_order_inside_the_attempt_wrapper_and_the_key_is_released() -> None:
    io = FakeIO(stored(3, b"a"), stored(5, b"b", message_type="Other"))
    steps = Steps()
    s = session(io, Handles(steps), steps)
    assert await s.run() is Outcome.RELEASED
    fencing = s.ctx.fencing
    assert steps.steps == [
        ("acquired", KEY, fencing),
        ("room",), ("open",),
        ("room",), ("started", 3, 1, "Work"), ("enter", 3), ("handle", 3), ("exit", 3),
        ("succeeded", 3, "Work", None),
        ("room",), ("started", 5, 1, "Other"), ("enter", 5), ("handle", 5), ("exit", 5),
        ("succeeded", 5, "Other", None),
        ("released", "released"),
    ]
    assert fencing[0] > 0 and fencing[1] == 1
    assert s.cursor == 6 and steps.ends[0].processed == 2
    # Both are removed (in one purge, unless a loop iteration outlasted PURGE_WINDOW), then the ack.
    assert sent(io, "purge", "delete", "ack", "nak")[-2:] == [("purge", 5), ("ack", "$JS.ACK.token.1")]
    assert io.inbox == {}
    assert io.records == {}, "the lease record was not removed"


async def test_a_failed_attempt_is_retried_in_place_then_succeeds() -> None:
    io = FakeIO(stored(1, b"flaky", reply=True))
    steps = Steps()
    s = session(io, Handles(steps, {b"flaky": [RuntimeError("down"), Reply(b"ok")]}), steps)
    assert await s.run() is Outcome.RELEASED
    requests = [step for step in steps.steps if step[0] in ("started", "failed", "retried", "succeeded")]
    assert requests == [("started", 1, 1, "Work"), ("failed", 1, 1, "RuntimeError"), ("retried", 1, 1),
                        ("started", 1, 2, "Work"), ("succeeded", 1, "Work", None)]
    assert sent(io, "purge", "delete", "reply", "dead_letter") == [("purge", 1), ("reply", "_INBOX.r1", "ok")]


async def test_a_reject_dead_letters_the_request_at_once_and_the_key_goes_on() -> None:
    io = FakeIO(stored(1, b"bad", reply=True), stored(2, b"good"))
    steps = Steps()
    s = session(io, Handles(steps, {b"bad": [Reject("no such thing")]}), steps)
    assert await s.run() is Outcome.RELEASED
    requests = [step for step in steps.steps if step[0] in ("started", "failed", "dead_lettered", "succeeded")]
    assert requests == [("started", 1, 1, "Work"), ("failed", 1, 1, "Reject"), ("dead_lettered", 1, "rejected", 1),
                        ("started", 2, 1, "Work"), ("succeeded", 2, "Work", None)]
    assert sent(io, "dead_letter", "delete", "purge", "reply") == [
        ("dead_letter", 1, "rejected"), ("delete", 1), ("reply", "_INBOX.r1", "dead-lettered"), ("purge", 2)]
    assert s.cursor == 3


async def test_attempts_exhausted_dead_letter_with_the_count() -> None:
    io = FakeIO(stored(1, b"poison"))
    steps = Steps()
    s = session(io, Handles(steps, {b"poison": [RuntimeError("x")] * 3}), steps)
    assert await s.run() is Outcome.RELEASED
    assert [step for step in steps.steps if step[0] in ("retried", "dead_lettered")] == [
        ("retried", 1, 1), ("retried", 1, 2), ("dead_lettered", 1, "max-attempts", 3)]


async def test_superseded_replies_reach_the_observer_as_superseded() -> None:
    class Latest(Handles):
        batch_size = 10

        async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
            newest = requests[-1].request_id
            older = [Reply(b"", {H.STATUS: H.STATUS_SUPERSEDED, H.SUPERSEDED_BY: newest}) for _ in requests[:-1]]
            return [*older, Reply(b"done")]

    io = FakeIO(stored(1, b"v1", reply=True), stored(2, b"v2"), stored(3, b"v3", reply=True))
    steps = Steps()
    assert await session(io, Latest(steps), steps).run() is Outcome.RELEASED
    assert [step for step in steps.steps if step[0] in ("started", "succeeded")] == [
        ("started", 1, 1, "Work"),
        ("succeeded", 1, "Work", "r3"), ("succeeded", 2, "Work", "r3"), ("succeeded", 3, "Work", None)]
    assert sent(io, "purge", "reply") == [("purge", 3), ("reply", "_INBOX.r1", "superseded"),
                                          ("reply", "_INBOX.r3", "ok")]


async def test_a_token_redelivered_to_its_holder_is_adopted_and_acked() -> None:
    io = FakeIO(stored(1, b"slow"))
    steps = Steps()
    running, finish = asyncio.Event(), asyncio.Event()

    class Slow(Handles):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            running.set()
            await finish.wait()
            return None

    s = session(io, Slow(steps), steps)
    task = asyncio.create_task(s.run())
    await running.wait()
    redelivered = token(delivered=2)
    assert s.adopt(redelivered)
    assert not s.adopt(Token(KEY, "kq.q.token.k", "$JS.ACK.other", 8, 1, time.monotonic())), \
        "a token of another sequence is another scheduling of the key, not this one"
    finish.set()
    assert await task is Outcome.RELEASED
    assert sent(io, "ack", "nak") == [("ack", "$JS.ACK.token.2")]


async def test_a_lost_lease_ends_the_session_without_a_word_to_the_key() -> None:
    io = FakeIO(stored(1, b"stuck", reply=True), stored(2, b"next"))
    steps = Steps()
    running = asyncio.Event()

    class Stuck(Handles):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            io.steal()  # this holder stalled; another worker acquired the key meanwhile
            running.set()
            await asyncio.Event().wait()
            return None

    # A short lease: the keepalive renews (and finds the record gone) after ack_wait / 3.
    s = session(io, Stuck(steps), steps, ack_wait=0.3)
    assert await asyncio.wait_for(s.run(), 5) is Outcome.LEASE_LOST
    assert steps.steps[-1] == ("released", "lease-lost")
    assert "another worker" in steps.ends[0].reason
    assert sent(io, "ack", "nak", "delete", "purge", "reply", "dead_letter", "schedule") == []
    assert 1 in io.inbox and 2 in io.inbox


async def test_a_lease_lost_while_waiting_for_requests_ends_the_wait_and_the_session() -> None:
    io = FakeIO(stored(1, b"x"))
    steps = Steps()
    closed: list[str] = []

    class Steals(Handles):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            io.steal()  # another worker takes the key while this one waits for its next request
            return None

        async def close(self, ctx: SessionContext, reason: str) -> None:
            closed.append(reason)

    settings = SessionSettings(ack_wait=0.3, linger=60.0)  # the renewal, not the linger, ends it
    s = KeySession(io, token(), lambda key: Steals(steps), settings, observer=steps,
                   draining=asyncio.Event(), worker="w1")
    async with asyncio.timeout(5):
        assert await s.run() is Outcome.LEASE_LOST
    assert closed == ["lease-lost"]
    assert steps.ends[0].outcome is Outcome.LEASE_LOST
    assert sent(io, "ack", "nak", "reply", "schedule") == []


async def test_a_drain_ends_a_session_waiting_for_requests_at_once() -> None:
    watching = asyncio.Event()

    class Watched(FakeIO):
        async def watch(self, key: str) -> Watch:
            watching.set()
            return await super().watch(key)

    io = Watched(stored(1, b"x"))
    steps = Steps()
    draining = asyncio.Event()
    settings = SessionSettings(ack_wait=30.0, linger=60.0)  # the drain, not the linger, ends it
    s = KeySession(io, token(), lambda key: Handles(steps), settings, observer=steps,
                   draining=draining, worker="w1")
    task = asyncio.ensure_future(s.run())
    await watching.wait()  # the request ran; the session waits for the next one, or is about to
    draining.set()
    s.wake()  # what QueueWorker.stop() does for every session it holds
    async with asyncio.timeout(5):
        assert await task is Outcome.RELEASED
    assert sent(io, "delete", "purge", "ack") == [("purge", 1), ("ack", "$JS.ACK.token.1")]


async def test_a_key_held_elsewhere_until_the_drain_is_contended() -> None:
    io = FakeIO(stored(1, b"x"))
    io.steal()
    steps = Steps()
    draining = asyncio.Event()
    io.on_refused.append(draining.set)  # the drain begins while another worker holds the key
    assert await session(io, Handles(steps), steps, draining=draining).run() is Outcome.CONTENDED
    assert steps.steps == [("released", "contended")]
    assert sent(io, "ack", "nak", "delete", "purge") == [("nak", "$JS.ACK.token.1")]


async def test_a_failing_session_reports_its_error_and_gives_the_token_back() -> None:
    class OpenFails(Handles):
        async def open(self, ctx: SessionContext) -> None:
            raise OSError("the processor's store is down")

    io = FakeIO(stored(1, b"x"))
    steps = Steps()
    assert await session(io, OpenFails(steps), steps).run() is Outcome.FAILED
    [end] = steps.ends
    assert (end.outcome, type(end.error)) == (Outcome.FAILED, OSError)
    assert sent(io, "ack", "nak", "delete", "purge") == [("nak", "$JS.ACK.token.1")]
    assert 1 in io.inbox


async def test_requests_done_one_after_another_are_removed_by_one_purge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removals_module, "PURGE_WINDOW", 60.0)  # no timer fires: only the count and the I/O
    count = PURGE_EVERY + 3
    io = FakeIO(*(stored(seq, b"x") for seq in range(1, count + 1)))
    steps = Steps()
    assert await session(io, Handles(steps), steps).run() is Outcome.RELEASED
    # One purge after PURGE_EVERY requests, one when the read-ahead ran out; then the ack.
    assert sent(io, "purge", "delete", "ack") == [("purge", PURGE_EVERY), ("purge", count),
                                                   ("ack", "$JS.ACK.token.1")]
    assert io.inbox == {}


async def test_a_request_done_before_a_slow_one_is_removed_while_the_slow_one_runs() -> None:
    io = FakeIO(stored(1, b"fast"), stored(2, b"slow"))
    steps = Steps()
    removed = asyncio.Event()

    class SlowSecond(Handles):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            if request.data == b"slow":
                async with asyncio.timeout(5):  # PURGE_WINDOW after this one started
                    while True:
                        if 1 not in io.inbox:
                            break
                        await asyncio.sleep(0.001)
                removed.set()
            return await super().handle(ctx, request)

    assert await session(io, SlowSecond(steps), steps).run() is Outcome.RELEASED
    assert removed.is_set()
    assert sent(io, "purge", "delete", "ack") == [("purge", 1), ("purge", 2), ("ack", "$JS.ACK.token.1")]


# --- outages: a lost connection costs a pause, not the key ------------------------------------------


class Outage(FakeIO):
    """A FakeIO whose named steps fail (the connection dropped) as many times as asked; the
    connection is back after ``down_for`` seconds of ``wait_connected`` (never, if None)."""

    def __init__(self, *requests: StoredMsg, fail: Mapping[str, list[Exception]], down_for: float | None = 0.0) -> None:
        super().__init__(*requests)
        self.fail = {step: list(errors) for step, errors in fail.items()}
        self.down_for = down_for
        self.waits = 0

    def _maybe_fail(self, step: str) -> None:
        errors = self.fail.get(step)
        if errors:
            raise errors.pop(0)

    async def wait_connected(self, timeout: float) -> bool:
        self.waits += 1
        if self.down_for is None or self.down_for > timeout:
            await asyncio.sleep(max(0.0, timeout))
            return False
        await asyncio.sleep(self.down_for)
        return True

    async def read(self, key: str, from_seq: int, limit: int) -> tuple[list[StoredMsg], bool]:
        self._maybe_fail("read")
        return await super().read(key, from_seq, limit)

    async def reply(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        self._maybe_fail("reply")
        await super().reply(inbox, headers, body)

    async def release_token(self, token: Token, timeout: float = 5.0) -> None:
        self._maybe_fail("release_token")
        await super().release_token(token, timeout)

    async def next_request(self, key: str, from_seq: int, *, requests_only: bool = False) -> StoredMsg | None:
        self._maybe_fail("next_request")
        return await super().next_request(key, from_seq, requests_only=requests_only)

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        if expected:
            self._maybe_fail("renew")
        return await super().compare_and_set(subject, expected, body, ttl, timeout)


async def test_a_holder_whose_connection_drops_and_comes_back_within_the_lease_carries_on() -> None:
    from keyqueue.errors import Disconnected, ReplyLost

    io = Outage(stored(1, b"a", reply=True), stored(2, b"b"),
                # the first read goes with the acquire and is simply read again: the second one fails too
                fail={"read": [ReplyLost("dropped")] * 2, "reply": [Disconnected("down")],
                      "release_token": [ReplyLost("dropped")], "next_request": [Disconnected("down")]},
                down_for=0.05)
    steps = Steps()
    assert await session(io, Handles(steps), steps).run() is Outcome.RELEASED
    assert [s for s in steps.steps if s[0] == "succeeded"] == [("succeeded", 1, "Work", None),
                                                              ("succeeded", 2, "Work", None)]
    assert io.waits == 4  # each failed step waited for the connection, then was sent again
    assert sent(io, "reply", "ack") == [("reply", "_INBOX.r1", "ok"), ("ack", "$JS.ACK.token.1")]
    assert io.inbox == {} and io.records == {}


async def test_a_connection_down_past_the_lease_loses_the_key_and_sends_nothing_more() -> None:
    from keyqueue.errors import Disconnected

    down = [Disconnected("down")] * 100
    io = Outage(stored(1, b"a"), fail={"read": list(down), "renew": list(down)}, down_for=None)
    steps = Steps()
    s = session(io, Handles(steps), steps, ack_wait=0.3)
    assert await asyncio.wait_for(s.run(), 5) is Outcome.LEASE_LOST
    assert sent(io, "ack", "nak", "purge", "reply", "schedule", "delete_token") == []
    assert 1 in io.inbox


async def test_a_release_that_cannot_confirm_its_token_is_gone_hands_the_re_check_to_the_worker() -> None:
    from keyqueue.errors import Disconnected

    io = Outage(stored(1, b"a"), fail={"release_token": [Disconnected("down")] * 100}, down_for=None)
    # (renewals go through: the lease holds, and the release waits for the connection until it ends)
    steps = Steps()
    handed: list[tuple[int, int]] = []
    s = session(io, Handles(steps), steps, ack_wait=0.3)
    s.recheck_later = lambda tok, cursor: handed.append((tok.stream_seq, cursor))
    assert await asyncio.wait_for(s.run(), 5) is Outcome.RELEASED
    assert handed == [(7, 2)]
    assert sent(io, "schedule") == []  # not re-checked while the token may still be there
    assert io.records == {}, "the lease record was removed"


class LateArrival(FakeIO):
    """A request lands right after the session's last read, before its release's re-check."""

    async def release_token(self, token: Token, timeout: float = 5.0) -> None:
        await super().release_token(token, timeout)
        self.inbox[9] = stored(9, b"late")


@pytest.mark.parametrize("ours", [True, False])
async def test_a_re_schedule_refused_by_our_own_token_on_r3_removes_it_again(ours: bool) -> None:
    """On R3 the released token was seen still stored, rarely, after release_token: a refused
    re-schedule that finds its own token removes it and publishes again; a token of someone else
    (a producer's, the reconciler's) is left as the key's token."""
    io = LateArrival(stored(1, b"a"))
    io.replicated, io.refuse_schedules, io.stored_token = True, 1, 7 if ours else 8
    steps = Steps()
    s = session(io, Handles(steps), steps)
    assert await s.run() is Outcome.RELEASED
    if ours:
        assert sent(io, "delete_token", "schedule") == [("schedule", KEY), ("delete_token", 7), ("schedule", KEY)]
        assert s.republished
    else:
        assert sent(io, "delete_token", "schedule") == [("schedule", KEY)] and not s.republished


async def test_an_acquire_that_fails_after_its_write_may_have_landed_leaves_no_lease_record() -> None:
    # The acquire's write was stored but its reply lost, and the record could not be read back
    # until the session gave up: the record would have kept the key from every worker until its TTL.
    class Blind(FakeIO):
        blind = True
        writes_lost = 1

        async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                                  timeout: float | None = None) -> int:
            seq = await super().compare_and_set(subject, expected, body, ttl, timeout)
            if self.writes_lost:
                self.writes_lost -= 1
                raise ReplyLost("the connection dropped before the reply")
            return seq

        async def last_record(self, subject: str) -> StoredMsg | None:
            if self.blind:
                raise KeyqueueTimeout("no answer")
            return await super().last_record(subject)

        async def nak(self, token: Token, delay: float = 0.0) -> None:
            await super().nak(token, delay)
            self.blind = False  # the server answers again as the session gives the token back

    io = Blind(stored(1, b"a"))
    steps = Steps()
    assert await session(io, Handles(steps), steps, ack_wait=0.3).run() is Outcome.FAILED
    assert sent(io, "nak") == [("nak", "$JS.ACK.token.1")]
    assert io.records == {}, "the lease record of the failed acquire was left behind"


async def test_a_removal_waits_for_the_purge_beside_the_work_that_still_confirms_kept_results() -> None:
    # Request 1's kept result is confirmed slowly; request 2 runs past PURGE_WINDOW, so request 1's
    # purge goes out beside it and waits for that confirmation. Request 2's own removal (a purge
    # through 2, which removes 1 too) must wait for it as well: else request 1 leaves the inbox
    # before its result is stored, and a crash then loses the result of a request that ran.
    io = FakeIO(stored(1, b"a"), stored(2, b"b"))
    steps = Steps()
    first_kept = asyncio.Event()
    second_done = asyncio.Event()
    purged_with: list[tuple[int, bool]] = []
    purge_through = io.purge_through

    async def recording_purge(key: str, seq: int) -> int:
        purged_with.append((seq, first_kept.is_set()))
        return await purge_through(key, seq)

    io.purge_through = recording_purge  # type: ignore[method-assign]

    async def first_confirmed() -> None:
        await first_kept.wait()

    class Keeps(Handles):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            hold = ctx.hold_removal
            assert hold is not None, "a key session's context holds removals"
            if request.seq == 1:
                hold(first_confirmed)
            else:
                await asyncio.sleep(removals_module.PURGE_WINDOW * 20)  # request 1's purge goes out beside it

                async def kept() -> None:
                    return None

                hold(kept)
                second_done.set()
            return None

    run = asyncio.ensure_future(session(io, Keeps(steps), steps).run())
    await second_done.wait()
    for _ in range(50):  # let the session go as far as it can without request 1's confirmation
        await asyncio.sleep(0)
    assert purged_with == [], "a request was removed before its kept result was confirmed"
    first_kept.set()
    assert await run is Outcome.RELEASED
    assert purged_with and all(confirmed for _, confirmed in purged_with)
    assert io.inbox == {}


class Unanswered(FakeIO):
    """Removals sent into a connection that is gone without a word: never confirmed."""

    def __init__(self, *requests: StoredMsg) -> None:
        super().__init__(*requests)
        self.settling = asyncio.Event()
        self.given_up = asyncio.Event()

    async def purge_soon(self, key: str, seq: int) -> asyncio.Future[list[Msg]]:
        self.writes.append(("purge", seq))
        return asyncio.get_running_loop().create_future()  # its reply never comes

    async def settle(self, futures: Sequence[asyncio.Future[list[Msg]]]) -> None:
        self.settling.set()
        await self.given_up.wait()  # then as QueueIO.settle past its timeout
        raise KeyqueueTimeout(f"{len(futures)} delete(s) unconfirmed")


async def test_a_session_stops_running_requests_once_enough_of_their_removals_go_unconfirmed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Read ahead, a session runs its next requests without I/O: on a connection lost without a word,
    # every request it runs there runs again elsewhere. It waits for confirmations once
    # MAX_UNCONFIRMED_REQUESTS are outstanding (it ran 64 before, 8 purges of 8).
    monkeypatch.setattr(removals_module, "PURGE_WINDOW", 60.0)  # purges by count only
    io = Unanswered(*(stored(seq, b"x") for seq in range(1, 101)))
    steps = Steps()
    running = asyncio.ensure_future(session(io, Handles(steps), steps).run())
    await asyncio.wait_for(io.settling.wait(), 10)
    handled = [s for s in steps.steps if s[0] == "handle"]
    assert len(handled) == removals_module.MAX_UNCONFIRMED_REQUESTS
    assert sent(io, "purge") == [("purge", n) for n in range(PURGE_EVERY, len(handled) + 1, PURGE_EVERY)]
    io.given_up.set()  # each removal is sent again as one purge; the session goes on and ends
    assert await asyncio.wait_for(running, 30) is Outcome.RELEASED
    assert io.inbox == {}
