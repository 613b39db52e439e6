"""The token puller's decisions, with a fake client and a fake clock (the real server: test_core_basic.py).

What the puller asks for (capacity, chunks, the throttle), what each status does to its
accounting (408/409 give back, 503 backs off, 423 unpins), and how a delivery becomes a Token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import nats.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from keyqueue.jetstream.api import DESCRIPTION, STATUS
from keyqueue.jetstream.pull import (
    NO_RESPONDERS_BACKOFF_MAX,
    NO_RESPONDERS_LOG_INTERVAL,
    NS,
    OUTSTANDING_CHUNKS,
    PENDING_MESSAGES,
    PIN_ID,
    PULL_CHUNK_MIN,
    PULLS_PER_WORKER,
    PullOptions,
    PullState,
    Token,
    TokenPuller,
    chunk_size,
    no_responders_backoff,
    parse_ack_subject,
)
from keyqueue.jetstream.subjects import QueueNames

NAMES = QueueNames("q")
NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{NAMES.token_stream}.{NAMES.consumer}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeMsg:
    subject: str = ""
    reply: str = ""
    headers: dict[str, str] | None = None
    data: bytes = b""


def ack_subject(seq: int, delivered: int = 1, stored_ns: int = 1_700_000_000 * NS, pending: int = 0) -> str:
    return f"$JS.ACK.{NAMES.token_stream}.{NAMES.consumer}.{delivered}.{seq}.{seq}.{stored_ns}.{pending}"


def token_msg(key: str, seq: int, *, delivered: int = 1, pin: str | None = None) -> FakeMsg:
    return FakeMsg(NAMES.token(key), ack_subject(seq, delivered), {PIN_ID: pin} if pin else None)


def status_msg(status: str, pending: int | None = None, description: str | None = None) -> FakeMsg:
    headers = {STATUS: status}
    if description is not None:
        headers[DESCRIPTION] = description
    if pending is not None:
        headers[PENDING_MESSAGES] = str(pending)
    return FakeMsg(headers=headers)


class FakeSub:
    def __init__(self) -> None:
        self.unsubscribed = False

    async def unsubscribe(self) -> None:
        self.unsubscribed = True


@dataclass
class FakeClient:
    """The few methods of nats-py's Client that the puller calls."""

    is_connected: bool = True
    is_closed: bool = False
    is_reconnecting: bool = False
    connected_url: str = "nats://fake"
    fail_publish: BaseException | None = None
    pulls: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    answer: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    """Set: requests are answered at once; cleared: they wait (a consumer with no leader)."""
    callbacks: list[Callable[[Any], Any]] = field(default_factory=list)
    inboxes: int = 0

    def new_inbox(self) -> str:
        self.inboxes += 1
        return f"_INBOX.test{self.inboxes}"

    async def subscribe(self, subject: str, cb: Callable[[Any], Any]) -> FakeSub:
        self.callbacks.append(cb)
        return FakeSub()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        if self.fail_publish is not None:
            raise self.fail_publish
        self.pulls.append((subject, json.loads(payload), reply))

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0,
                      headers: dict[str, str] | None = None) -> FakeMsg:
        self.requests.append(subject)
        await self.answer.wait()
        return FakeMsg(data=b"{}")

    def batches(self) -> list[int]:
        return [body["batch"] for _, body, _ in self.pulls]


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


class Harness:
    """A TokenPuller on a fake client; ``rounds`` counts its loop's iterations (one capacity read each)."""

    def __init__(self, capacity: int = 20, options: PullOptions | None = None) -> None:
        self.clock = Clock()
        self.client = FakeClient()
        self.free = capacity
        self.tokens: list[Token] = []
        self.pins: list[str | None] = []
        self.rounds = 0
        self._round = asyncio.Event()
        self.answered_again = 0
        self.puller = TokenPuller(cast(Client, self.client), NAMES, capacity=self._capacity,
                                  on_token=self._on_token, options=options, on_pinned=self._on_pinned,
                                  clock=self.clock, on_answered_again=self._on_answered_again)

    def _on_answered_again(self) -> None:
        self.answered_again += 1

    def _capacity(self) -> int:
        self.rounds += 1
        self._round.set()
        return self.free

    async def _on_token(self, token: Token) -> None:
        self.tokens.append(token)

    async def _on_pinned(self, pin: str | None) -> None:
        self.pins.append(pin)

    async def deliver(self, msg: FakeMsg) -> None:
        await self.puller._on_msg(cast(Any, msg), self.puller._generation)

    async def next_round(self, *, wake: bool = True) -> None:
        """Wake the puller and wait until its loop has run once more and is waiting again (the fake
        client never suspends, so the loop's only suspension is its wait at the end)."""
        self._round.clear()
        if wake:
            self.puller.wake()
        await asyncio.wait_for(self._round.wait(), 5)

    async def __aenter__(self) -> Harness:
        self._task = asyncio.create_task(self.puller.run())
        await self.next_round(wake=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.puller.stop()
        await asyncio.wait_for(self._task, 5)


# --- PullState: capacity accounting -----------------------------------------------------------------


def test_wanted_is_what_the_free_slots_lack_and_never_negative() -> None:
    state = PullState(last_activity=0.0)
    assert state.wanted(5) == 5
    state.requested(3, now=1.0)
    assert state.wanted(5) == 2
    assert state.wanted(2) == 0  # slots were taken meanwhile: ask for nothing, give nothing back


Op = tuple[str, int | None]
OPS = st.lists(st.one_of(
    st.tuples(st.just("request"), st.integers(0, 50)),
    st.tuples(st.just("deliver"), st.none()),
    st.tuples(st.just("give_back"), st.none() | st.integers(0, 60)),
    st.tuples(st.just("reset"), st.none()),
), max_size=40)


@given(OPS, st.integers(0, 100))
def test_pending_stays_the_outstanding_count_whatever_the_server_answers(ops: list[Op], capacity: int) -> None:
    state = PullState(last_activity=0.0)
    for now, (op, n) in enumerate(ops):
        before = state.pending
        if op == "request":
            assert n is not None
            state.requested(n, now)
            assert state.pending == before + n
        elif op == "deliver":
            state.delivered(now)
            assert state.pending == max(0, before - 1)
        elif op == "give_back":
            state.given_back(n, now)
            assert state.pending == (0 if n is None else max(0, before - n))
        else:
            state.reset()
            assert state.pending == 0
        assert state.pending >= 0
    before = state.pending
    state.requested(state.wanted(capacity), len(ops))
    assert state.pending == max(capacity, before)  # topped up to capacity, never cut below


def test_the_heartbeat_clock_starts_with_the_first_outstanding_pull_and_runs_from_the_last_sign_of_life() -> None:
    state = PullState(last_activity=0.0)
    state.requested(4, now=10.0)
    state.requested(4, now=15.0)  # a later pull does not hide the first one's silence
    assert state.last_activity == 10.0
    assert not state.heartbeat_missed(now=14.0, heartbeat=2.0)
    assert state.heartbeat_missed(now=14.001, heartbeat=2.0)
    state.delivered(now=20.0)
    assert not state.heartbeat_missed(now=24.0, heartbeat=2.0)
    assert state.heartbeat_missed(now=24.001, heartbeat=2.0)


def test_no_heartbeat_is_missed_while_nothing_is_requested() -> None:
    state = PullState(last_activity=0.0)
    assert not state.heartbeat_missed(now=1e9, heartbeat=2.0)
    state.requested(1, now=0.0)
    state.given_back(1, now=0.0)
    assert not state.heartbeat_missed(now=1e9, heartbeat=2.0)


# --- how many tokens it asks for --------------------------------------------------------------------


@pytest.mark.parametrize(("capacity", "chunk"), [(0, 4), (1, 4), (32, 4), (33, 5), (64, 8), (65, 9), (800, 100)])
def test_a_chunk_is_an_eighth_of_the_free_slots_rounded_up_and_at_least_four(capacity: int, chunk: int) -> None:
    assert chunk_size(capacity) == chunk


@given(st.integers(0, 100_000))
def test_a_chunk_is_the_smallest_batch_that_covers_the_slots_in_so_many_pulls(capacity: int) -> None:
    chunk = chunk_size(capacity)
    assert chunk >= PULL_CHUNK_MIN
    assert chunk * PULLS_PER_WORKER >= capacity
    assert chunk == PULL_CHUNK_MIN or (chunk - 1) * PULLS_PER_WORKER < capacity


def test_a_throttled_worker_keeps_two_chunks_requested() -> None:
    state = PullState(last_activity=0.0)
    chunk = chunk_size(100)
    assert state.to_request(100, chunk, throttled=True) == 2 * chunk
    state.requested(2 * chunk - 3, now=0.0)
    assert state.to_request(100, chunk, throttled=True) == 3
    state.requested(10, now=0.0)  # more outstanding than two chunks (capacity grew, then shrank)
    assert state.to_request(100, chunk, throttled=True) == 0
    assert state.to_request(100, chunk, throttled=False) == 100 - state.pending


@given(st.integers(0, 1000), st.integers(0, 1000), st.booleans())
def test_a_request_never_exceeds_the_free_slots_nor_when_throttled_two_chunks(
        capacity: int, pending: int, throttled: bool) -> None:
    state = PullState(pending=pending, last_activity=0.0)
    chunk = chunk_size(capacity)
    want = state.to_request(capacity, chunk, throttled=throttled)
    assert 0 <= want <= state.wanted(capacity)
    if throttled:
        assert want == 0 or pending + want <= OUTSTANDING_CHUNKS * chunk
        assert want == min(state.wanted(capacity), max(0, OUTSTANDING_CHUNKS * chunk - pending))
    else:
        assert want == state.wanted(capacity)


def test_pull_requests_carry_expiry_and_heartbeat_in_nanoseconds_and_no_group_fields_without_a_group() -> None:
    options = PullOptions(expires=10.0, heartbeat=2.5, min_pending=3, priority=1)
    assert options.request(4, "pin-1") == {"batch": 4, "expires": 10 * NS, "idle_heartbeat": 2_500_000_000}


def test_a_group_pull_carries_the_set_priority_fields_and_the_pin() -> None:
    assert PullOptions(group="g").request(4, None) == {
        "batch": 4, "expires": 5 * NS, "idle_heartbeat": 1 * NS, "group": "g"}
    options = PullOptions(group="g", min_pending=3, min_ack_pending=2, priority=0)
    assert options.request(4, "pin-1") == {
        "batch": 4, "expires": 5 * NS, "idle_heartbeat": 1 * NS, "group": "g", "min_pending": 3,
        "min_ack_pending": 2, "priority": 0, "id": "pin-1"}  # priority 0 is the best tier, not unset


# --- the token of a delivered message ---------------------------------------------------------------


def test_both_ack_subject_versions_parse() -> None:
    v1 = "$JS.ACK.KQ_q_TOKENS.workers.3.17.42.1700000000123456789.5"
    v2 = "$JS.ACK._.AbCd.KQ_q_TOKENS.workers.3.17.42.1700000000123456789.5.Xy9"
    seq, delivered, stored_at, pending = parse_ack_subject(v1)
    assert (seq, delivered, pending) == (17, 3, 5)
    assert stored_at == pytest.approx(1700000000.123456789)
    assert parse_ack_subject(v2) == (seq, delivered, stored_at, pending)


@given(st.integers(1, 2**63), st.integers(1, 10**6), st.integers(0, 2**62), st.integers(0, 10**9),
       st.booleans())
def test_an_ack_subject_gives_back_what_the_server_put_in_it(
        seq: int, delivered: int, stored_ns: int, pending: int, v2: bool) -> None:
    fields = f"{NAMES.token_stream}.{NAMES.consumer}.{delivered}.{seq}.99.{stored_ns}.{pending}"
    reply = f"$JS.ACK.hub.AcCtHaSh.{fields}.rAnD" if v2 else f"$JS.ACK.{fields}"
    assert parse_ack_subject(reply) == (seq, delivered, stored_ns / NS, pending)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc", "$JS.ACK.S.C.1.2.3.4", "$JS.ACK.a.b.S.C.1.2.3.4.5",
                                   "$JS.ACK.S.C.1.x.3.4.5"])
def test_anything_else_is_not_an_ack_subject(reply: str) -> None:
    with pytest.raises(ValueError):
        parse_ack_subject(reply)


def test_a_redelivery_fences_out_the_earlier_delivery_and_a_new_token_fences_out_both() -> None:
    first = Token("k", "kq.q.tok.k", "r", stream_seq=7, delivered=1, received_at=0.0)
    again = Token("k", "kq.q.tok.k", "r", stream_seq=7, delivered=2, received_at=0.0)
    later = Token("k", "kq.q.tok.k", "r", stream_seq=8, delivered=1, received_at=0.0)
    assert first.fencing < again.fencing < later.fencing


async def test_a_delivery_becomes_a_token_received_now_and_uses_up_one_requested_slot() -> None:
    h = Harness()
    h.puller.state.requested(8, now=h.clock.now)
    h.clock.now = 1003.5
    await h.deliver(FakeMsg(NAMES.token("order.17"), ack_subject(42, delivered=2, stored_ns=1_700_000_000_500_000_000,
                                                                 pending=9)))
    assert h.tokens == [Token("order.17", "kq.q.tok.order.17", ack_subject(42, 2, 1_700_000_000_500_000_000, 9),
                              stream_seq=42, delivered=2, received_at=1003.5, stored_at=1_700_000_000.5, pending=9)]
    assert h.puller.state.pending == 7
    assert h.puller.state.last_activity == 1003.5


async def test_the_puller_is_woken_only_once_less_than_a_chunk_stays_requested() -> None:
    h = Harness()
    h.puller._chunk = 4
    h.puller.state.requested(8, now=h.clock.now)
    for seq in range(1, 5):
        await h.deliver(token_msg("k", seq))
    assert h.puller.state.pending == 4
    assert not h.puller._wake.is_set()
    await h.deliver(token_msg("k", 5))
    assert h.puller._wake.is_set()


async def test_deliveries_to_abandoned_pull_requests_are_dropped_untouched() -> None:
    h = Harness()
    old = h.puller._generation
    h.puller.abandon_pulls()
    await h.puller._on_msg(cast(Any, token_msg("k", 1)), old)
    assert h.tokens == []
    assert h.puller.dropped == 1
    await h.deliver(token_msg("k", 2))
    assert [t.stream_seq for t in h.tokens] == [2]


# --- statuses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["404", "408", "409", "423"])
async def test_an_ended_pull_gives_back_what_it_did_not_deliver(status: str) -> None:
    h = Harness()
    h.puller.state.requested(8, now=h.clock.now)
    h.clock.now += 1
    await h.deliver(status_msg(status, pending=3))
    assert h.puller.state.pending == 5
    assert h.puller.state.last_activity == h.clock.now
    await h.deliver(status_msg(status))  # no count: forget every outstanding request
    assert h.puller.state.pending == 0
    assert h.puller.statuses == {status: 2}


async def test_an_idle_heartbeat_is_a_sign_of_life_and_changes_no_count() -> None:
    h = Harness()
    h.puller.state.requested(8, now=h.clock.now)
    h.clock.now += 3
    await h.deliver(status_msg("100"))
    assert h.puller.state.pending == 8
    assert h.puller.state.last_activity == h.clock.now
    assert h.puller.statuses == {"100": 1}


async def test_an_unexpected_status_is_logged_and_forgets_the_outstanding_requests(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.puller.state.requested(8, now=h.clock.now)
    with caplog.at_level(logging.WARNING, logger="keyqueue.pull"):
        await h.deliver(FakeMsg(headers={STATUS: "400", "Description": "Bad Request"}))
    assert h.puller.state.pending == 0
    assert [r.getMessage() for r in caplog.records] == ["queue q: unexpected pull status 400 Bad Request"]


@pytest.mark.parametrize(("streak", "backoff"), [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.6), (6, 2.0), (50, 2.0)])
def test_the_503_backoff_doubles_from_a_tenth_of_a_second_up_to_two(streak: int, backoff: float) -> None:
    assert no_responders_backoff(streak) == pytest.approx(backoff)


@given(st.integers(0, 10_000))
def test_the_503_backoff_never_shrinks_as_the_streak_grows_and_stays_capped(streak: int) -> None:
    assert 0 < no_responders_backoff(streak) <= no_responders_backoff(streak + 1) <= NO_RESPONDERS_BACKOFF_MAX


async def test_503s_back_off_longer_in_a_row_and_a_delivery_or_heartbeat_ends_the_streak() -> None:
    h = Harness()
    for streak in (1, 2, 3):
        await h.deliver(status_msg("503"))
        assert h.puller._retry_at == h.clock.now + no_responders_backoff(streak)
    await h.deliver(status_msg("100"))
    await h.deliver(status_msg("503"))
    assert h.puller._retry_at == h.clock.now + no_responders_backoff(1)
    await h.deliver(status_msg("503"))
    await h.deliver(token_msg("k", 1))
    await h.deliver(status_msg("503"))
    assert h.puller._retry_at == h.clock.now + no_responders_backoff(1)


async def test_503s_warn_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    with caplog.at_level(logging.WARNING, logger="keyqueue.pull"):
        await h.deliver(status_msg("503"))
        h.clock.now += NO_RESPONDERS_LOG_INTERVAL - 0.001
        await h.deliver(status_msg("503"))
        h.clock.now += 0.001
        await h.deliver(status_msg("503"))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert all("503 no responders" in w for w in warnings)
    assert h.puller.statuses == {"503": 3}


async def test_a_new_pin_is_taken_and_reported_once_and_a_423_unpins() -> None:
    h = Harness()
    await h.deliver(token_msg("a", 1, pin="pin-1"))
    await h.deliver(token_msg("b", 2, pin="pin-1"))
    await h.deliver(token_msg("c", 3))  # a message without the header leaves the pin alone
    assert h.puller.state.pin_id == "pin-1"
    await h.deliver(token_msg("d", 4, pin="pin-2"))
    await h.deliver(status_msg("423"))
    await h.deliver(status_msg("423"))  # already unpinned: nothing to report
    assert h.puller.state.pin_id is None
    assert h.pins == ["pin-1", "pin-2", None]


# --- the loop, on a fake client ---------------------------------------------------------------------


async def test_the_loop_requests_two_chunks_on_its_inbox_and_a_used_up_chunk_brings_the_next() -> None:
    async with Harness(capacity=20) as h:
        inbox = h.puller._inbox
        assert h.client.pulls == [(NEXT, PullOptions().request(4, None), f"{inbox}.1"),
                                  (NEXT, PullOptions().request(4, None), f"{inbox}.2")]
        for seq in range(1, 6):
            await h.client.callbacks[0](token_msg("k", seq))
        h._round.clear()
        await asyncio.wait_for(h._round.wait(), 5)  # woken by the delivery that left less than a chunk
        assert h.client.batches() == [4, 4, 4, 1]
        assert [reply for _, _, reply in h.client.pulls[2:]] == [f"{inbox}.3", f"{inbox}.4"]


async def test_with_priorities_every_free_slot_is_requested_at_once() -> None:
    async with Harness(capacity=20, options=PullOptions(group="g", priority=1)) as h:
        assert h.client.batches() == [4, 4, 4, 4, 4]
        await h.next_round()
        assert h.client.batches() == [4, 4, 4, 4, 4]  # all outstanding: nothing more


async def test_after_a_503_nothing_is_pulled_until_the_backoff_has_passed() -> None:
    async with Harness(capacity=4) as h:
        assert h.client.batches() == [4]
        await h.client.callbacks[0](status_msg("503"))
        await h.next_round()
        assert h.puller._retry_at == h.clock.now + no_responders_backoff(1)
        h.clock.now = h.puller._retry_at - 0.001
        await h.next_round()
        assert h.client.batches() == [4]
        h.clock.now = h.puller._retry_at
        await h.next_round()
        assert h.client.batches() == [4, 4]


async def test_the_consumer_answering_again_after_refusals_is_said_once() -> None:
    # (The worker runs a reconciler pass then: tokens refused meanwhile may be missing.)
    async with Harness(capacity=4) as h:
        await h.client.callbacks[0](status_msg("100"))
        await h.client.callbacks[0](token_msg("k", 1))
        assert h.answered_again == 0  # nothing was refused
        await h.client.callbacks[0](status_msg("503"))
        await h.client.callbacks[0](status_msg("503"))
        await h.client.callbacks[0](status_msg("100"))
        await h.client.callbacks[0](status_msg("100"))
        assert h.answered_again == 1
        await h.client.callbacks[0](status_msg("409"))
        await h.client.callbacks[0](token_msg("k", 2))
        assert h.answered_again == 2


async def test_a_new_consumer_leader_is_asked_at_once_however_many_pulls_it_ends() -> None:
    # A consumer stepdown: the new leader ends each pull request that waited at the old one with
    # a 409 Leadership Change. Counted as refusals, three of them held pulls back 0.4 s (a worker
    # with more outstanding, up to 2 s); the new leader is up, so the pulls go again at once.
    async with Harness(capacity=12) as h:
        assert h.client.batches() == [4, 4]
        for _ in range(3):
            await h.client.callbacks[0](status_msg("409", pending=4, description="Leadership Change"))
        await h.next_round()
        assert h.puller._retry_at == 0.0 and h.puller._refused == 0
        assert h.client.batches() == [4, 4, 4, 4]
        # Another 409 (a limit of the consumer) still backs off.
        await h.client.callbacks[0](status_msg("409", pending=4, description="Exceeded MaxWaiting"))
        await h.next_round()
        assert h.puller._retry_at == h.clock.now + no_responders_backoff(1)


async def test_the_pin_goes_on_the_next_pulls() -> None:
    async with Harness(capacity=4, options=PullOptions(group="g")) as h:
        await h.client.callbacks[0](token_msg("k", 1, pin="pin-1"))
        await h.next_round()
        assert [body.get("id") for _, body, _ in h.client.pulls] == [None, "pin-1"]


async def test_missed_heartbeats_check_the_consumer_and_pull_afresh(caplog: pytest.LogCaptureFixture) -> None:
    async with Harness(capacity=8) as h:
        assert h.client.batches() == [4, 4]
        h.clock.now += 2 * h.puller.options.heartbeat + 0.001
        with caplog.at_level(logging.WARNING, logger="keyqueue.pull"):
            await h.next_round()
        assert h.client.requests == [f"$JS.API.CONSUMER.INFO.{NAMES.token_stream}.{NAMES.consumer}"]
        assert h.client.batches() == [4, 4, 4, 4]
        assert "missed idle heartbeats" in caplog.text


async def test_missed_heartbeats_pull_afresh_without_waiting_for_the_consumer_check() -> None:
    # After a consumer leader died, its consumer answers nothing until a new one is elected: the
    # check waits out the API's timeout. Pulls go out meanwhile, and one check at a time.
    async with Harness(capacity=8) as h:
        h.client.answer.clear()
        assert h.client.batches() == [4, 4]
        h.clock.now += 2 * h.puller.options.heartbeat + 0.001
        await h.next_round()
        assert h.client.batches() == [4, 4, 4, 4]
        h.clock.now += 2 * h.puller.options.heartbeat + 0.001
        await h.next_round()
        assert h.client.batches() == [4, 4, 4, 4, 4, 4]
        assert h.client.requests == [f"$JS.API.CONSUMER.INFO.{NAMES.token_stream}.{NAMES.consumer}"]
        h.client.answer.set()


async def test_a_pull_not_sent_is_not_counted_and_a_closed_connection_is_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="keyqueue.pull"):
        async with Harness(capacity=8) as h:
            h.client.is_closed = True  # closed between the puller's check and its publish
            h.client.fail_publish = nats.errors.ConnectionClosedError()
            h.puller.reconnected()
            await h.next_round()
            assert h.puller.state.pending == 0
            await h.next_round()
            assert h.puller.state.pending == 0
    assert caplog.text.count("the NATS connection is closed") == 1
