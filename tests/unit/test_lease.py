"""The lease's arithmetic on a fake clock: how long a holder may still act, and when it must stop.

The server redelivers a token ``ack_wait`` after it last heard from the holder, so a valid lease
must always end, by the holder's clock and less the margin, before the last keepalive the holder
knows arrived could have been followed by a redelivery.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyqueue.core.lease import Lease
from keyqueue.errors import LeaseLost

ACK_WAITS = st.floats(0.1, 3600, allow_nan=False)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- the validity window ----------------------------------------------------------------------------


@pytest.mark.parametrize(("ack_wait", "margin"), [(0.5, 0.05), (5.0, 0.5), (10.0, 1.0), (30.0, 1.0)])
def test_the_margin_is_a_tenth_of_ack_wait_and_at_most_a_second(ack_wait: float, margin: float) -> None:
    assert Lease.default_margin(ack_wait) == pytest.approx(margin)
    assert Lease(ack_wait, 0.0).margin == pytest.approx(margin)


@given(ACK_WAITS)
def test_the_margin_never_eats_more_than_a_tenth_of_the_lease(ack_wait: float) -> None:
    margin = Lease.default_margin(ack_wait)
    assert 0 < margin <= min(1.0, ack_wait * 0.1)
    assert margin == min(1.0, ack_wait * 0.1)


def test_an_explicit_margin_is_used_even_when_it_is_zero() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, margin=0.0, clock=clock)
    assert lease.deadline == 110.0
    clock.now = 109.999
    assert lease.valid()


def test_the_lease_runs_from_receipt_less_the_margin_and_ends_at_the_deadline_itself() -> None:
    clock = Clock(now=103.0)  # the token waited 3 s in a buffer before it was looked at
    lease = Lease(10.0, received_at=100.0, clock=clock)
    assert lease.deadline == 109.0
    assert lease.remaining() == 6.0
    clock.now = 108.999
    assert lease.valid()
    clock.now = 109.0
    assert not lease.valid()
    assert lease.lost_reason == "lease expired: no keepalive confirmed in time"
    assert lease.remaining() == 0.0


@given(ACK_WAITS, st.floats(0, 1e6, allow_nan=False), st.floats(0, 2, allow_nan=False))
def test_a_lease_is_valid_exactly_until_ack_wait_less_the_margin_after_receipt(
        ack_wait: float, received_at: float, fraction: float) -> None:
    clock = Clock(now=received_at + fraction * ack_wait)
    lease = Lease(ack_wait, received_at, clock=clock)
    assert lease.valid() == (clock.now < received_at + ack_wait - lease.margin)


def test_an_expired_lease_stays_lost_even_if_the_clock_reads_earlier_again() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    clock.now = 200.0
    assert not lease.valid()
    clock.now = 101.0
    assert not lease.valid()


# --- lose and check ---------------------------------------------------------------------------------


def test_check_passes_while_valid_and_raises_the_reason_once_lost() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    lease.check()
    lease.lose("another worker acquired the key's lease record")
    with pytest.raises(LeaseLost, match="another worker acquired"):
        lease.check()
    assert lease.remaining() > 0  # lost, though its time is not up


def test_the_first_reason_a_lease_was_lost_is_the_one_kept() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    lease.lose("first")
    lease.lose("second")
    clock.now = 1000.0
    assert not lease.valid()
    with pytest.raises(LeaseLost, match=r"^first$"):
        lease.check()


def test_a_lost_lease_is_not_revived_by_a_keepalive() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    lease.lose("the key's lease record is not acquired yet")  # as a session starts
    assert not lease.confirmed(sent_at=100.0, replied_at=100.1)
    assert lease.deadline == 109.0
    assert lease.lost_reason == "the key's lease record is not acquired yet"


# --- keepalives -------------------------------------------------------------------------------------


def test_a_confirmed_keepalive_extends_the_lease_from_when_it_was_sent() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    clock.now = 108.5
    assert lease.confirmed(sent_at=105.0, replied_at=108.5)
    assert lease.deadline == 114.0  # 105 + 10 - 1, not 108.5 + 10 - 1
    assert lease.valid()


def test_a_keepalive_answered_at_the_deadline_loses_the_lease() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    assert not lease.confirmed(sent_at=108.0, replied_at=109.0)
    assert lease.lost_reason == "keepalive confirmed after the lease deadline"
    assert lease.deadline == 109.0


def test_a_late_reply_to_an_older_keepalive_never_shortens_the_lease() -> None:
    clock = Clock()
    lease = Lease(10.0, 100.0, clock=clock)
    assert lease.confirmed(sent_at=106.0, replied_at=106.1)
    assert lease.confirmed(sent_at=103.0, replied_at=107.0)  # sent earlier, answered later
    assert lease.deadline == 115.0


KEEPALIVES = st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.floats(0, 30, allow_nan=False)),
                      max_size=30)


@given(st.floats(1, 60, allow_nan=False), KEEPALIVES)
def test_while_valid_the_holder_is_a_margin_ahead_of_any_redelivery(
        ack_wait: float, keepalives: list[tuple[float, float]]) -> None:
    """Each keepalive is (seconds after the previous send, round trip). Whatever arrives when, a
    valid lease ends ``margin`` before ``ack_wait`` after the last confirmed send (or receipt)."""
    clock = Clock(now=0.0)
    lease = Lease(ack_wait, 0.0, clock=clock)
    basis = 0.0  # the latest moment the server certainly heard from the holder, confirmed in time
    sent = 0.0
    for gap, round_trip in keepalives:
        sent += gap
        clock.now = max(clock.now, sent + round_trip)
        was_valid = lease.valid()
        extended = lease.confirmed(sent, clock.now)
        assert extended == was_valid  # a lost lease stays lost
        if extended:
            basis = max(basis, sent)
        assert lease.deadline == basis + ack_wait - lease.margin
        if lease.valid():
            assert clock.now < basis + ack_wait - lease.margin


# --- renew timing, as the session's keepalive loop uses it ------------------------------------------


def test_keepalives_go_out_every_third_of_ack_wait() -> None:
    assert Lease(9.0, 0.0).interval == 3.0
    assert Lease(30.0, 0.0).interval == 10.0


def keep_alive(lease: Lease, clock: Clock, round_trip: float, renewals: int) -> bool:
    """The session's keepalive loop (core/session.py ``KeySession._renew`` with
    ``KeyLock.renew``): sleep ``min(interval, remaining)``, check, send, confirm on reply. True if
    the lease survived ``renewals`` rounds."""
    for _ in range(renewals):
        clock.now += min(lease.interval, max(0.0, lease.remaining()))
        if not lease.valid():
            return False
        sent = clock.now
        clock.now += round_trip
        lease.confirmed(sent, clock.now)
        if not lease.valid():
            return False
    return True


@given(st.floats(0.5, 600, allow_nan=False), st.floats(0, 0.25, allow_nan=False))
def test_round_trips_up_to_a_quarter_of_ack_wait_never_cost_the_lease(ack_wait: float, share: float) -> None:
    clock = Clock(now=0.0)
    lease = Lease(ack_wait, 0.0, clock=clock)
    assert keep_alive(lease, clock, share * ack_wait, renewals=50)


@given(st.floats(0.5, 600, allow_nan=False), st.floats(0.95, 3, allow_nan=False))
def test_a_keepalive_whose_reply_outlasts_the_lease_ends_it(ack_wait: float, share: float) -> None:
    clock = Clock(now=0.0)
    lease = Lease(ack_wait, 0.0, clock=clock)
    assert not keep_alive(lease, clock, share * ack_wait, renewals=3)
    with pytest.raises(LeaseLost):
        lease.check()


def test_a_stalled_holder_renews_at_once_and_a_lapsed_one_does_not_renew() -> None:
    clock = Clock(now=0.0)
    lease = Lease(9.0, 0.0, clock=clock)  # deadline 8.1, interval 3
    clock.now = 7.0  # the loop stalled: only 1.1 s left, less than an interval
    assert min(lease.interval, max(0.0, lease.remaining())) == pytest.approx(1.1)
    clock.now = 8.5  # stalled past the deadline: the next sleep is 0 and the check fails
    assert min(lease.interval, max(0.0, lease.remaining())) == 0.0
    with pytest.raises(LeaseLost):
        lease.check()
