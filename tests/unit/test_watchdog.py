"""The loop watchdog's decisions with a fake clock (the real thing: test_blocked_loop.py).

It fires only when the loop is blocked *and* a held lease is about to end; it counts the attempts
in hand, then ends the process with status 75.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from keyqueue.core.watchdog import EXIT_BLOCKED, HeldLease, LoopWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fired(Exception):
    pass


Counted = list[tuple[list[HeldLease], float]]
"""The attempts the watchdog counted: the leases in hand and the time budget, per count."""


def watchdog(clock: Clock, held: list[HeldLease], counted: Counted) -> LoopWatchdog:
    def count(in_hand: Sequence[HeldLease], budget: float) -> None:
        counted.append((list(in_hand), budget))

    def exit(status: int) -> None:
        raise Fired(status)

    return LoopWatchdog(8.0, lambda: held, count_killed=count, exit=exit, clock=clock)


def test_a_loop_that_beats_is_never_stopped_however_close_a_lease_is() -> None:
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [HeldLease("k", clock.now + 0.1, 7)], counted)
    for _ in range(100):
        clock.now += 0.1
        dog.beat()
        assert not dog.check()
    assert counted == [] and not dog.fired


def test_a_blocked_loop_is_stopped_only_once_a_lease_is_within_a_quarter_of_ack_wait() -> None:
    clock, counted = Clock(), Counted()
    held = [HeldLease("a", clock.now + 7.0, 0), HeldLease("b", clock.now + 5.0, 12)]
    dog = watchdog(clock, held, counted)
    dog.beat()
    clock.now += 2.9  # blocked for 2.9 s; b's lease ends in 2.1 s: more than 8 / 4
    assert not dog.check()
    clock.now += 0.2  # b's lease ends in 1.9 s
    with pytest.raises(Fired) as fired:
        dog.check()
    assert fired.value.args == (EXIT_BLOCKED,)
    [(in_hand, budget)] = counted
    assert [h.key for h in in_hand] == ["b"]  # only the key with a request in hand has an attempt to count
    assert 0.05 <= budget <= 0.5


def test_a_short_stall_near_a_deadline_is_left_to_the_session() -> None:
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [HeldLease("k", clock.now + 0.5, 3)], counted)
    dog.beat()
    clock.now += 0.5  # the loop ran 0.5 s ago: not blocked (the session's own lease check handles it)
    assert not dog.check()


def test_no_held_key_no_stop_and_a_failed_count_still_stops() -> None:
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [], counted)
    clock.now += 100
    assert not dog.check()

    def broken(in_hand: Sequence[HeldLease], budget: float) -> None:
        raise OSError("the server is away")

    held = [HeldLease("k", clock.now + 6.0, 3)]
    dog = LoopWatchdog(8.0, lambda: held, count_killed=broken, exit=lambda s: (_ for _ in ()).throw(Fired(s)),
                       clock=clock)
    clock.now += 5
    with pytest.raises(Fired):
        dog.check()


def test_sessions_changing_under_the_watchdog_are_read_again() -> None:
    clock = Clock()
    reads = iter([RuntimeError("dictionary changed size during iteration")])

    def leases() -> list[HeldLease]:
        for error in reads:
            raise error
        return [HeldLease("k", clock.now + 1.0, 3)]

    dog = LoopWatchdog(8.0, leases, exit=lambda s: None, clock=clock)
    clock.now += 5
    assert dog.check()


def test_a_lease_already_past_its_deadline_whose_key_runs_nothing_is_left_to_its_session() -> None:
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [HeldLease("k", clock.now + 1.0, 0)], counted)
    clock.now += 5  # blocked 5 s; the lease ended 4 s ago and nothing of the key runs: nothing to protect
    assert not dog.check()


def test_a_run_going_on_past_its_deadline_stops_the_process_when_the_loop_comes_back() -> None:
    # C code held the GIL (the watchdog could not look) past the lease's deadline; the run goes on.
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [HeldLease("k", clock.now + 1.0, 3, running=True)], counted)
    clock.now += 5
    with pytest.raises(Fired):
        dog.check()
    assert counted == []  # no time is left to count it: the process ends at once


def test_a_run_outliving_its_lost_lease_stops_the_process_though_the_loop_beats() -> None:
    # A sync task's thread runs on after the session lost the lease (renewals failed) and cancelled it.
    clock, counted = Clock(), Counted()
    held = [HeldLease("k", clock.now + 1.0, 3, running=True), HeldLease("idle", clock.now + 0.5, 0)]
    dog = watchdog(clock, held, counted)
    clock.now += 1.0
    dog.beat()
    assert not dog.check()  # at the deadline: the session is stopping what it can
    clock.now += dog.overrun
    dog.beat()
    with pytest.raises(Fired) as fired:
        dog.check()
    assert fired.value.args == (EXIT_BLOCKED,)
    [(in_hand, budget)] = counted
    # The count must end before the kernel's lease alarm would (twice the overrun past the deadline).
    assert [h.key for h in in_hand] == ["k"] and 0.05 <= budget <= dog.overrun


def test_a_run_within_its_lease_is_never_an_overrun() -> None:
    clock, counted = Clock(), Counted()
    dog = watchdog(clock, [HeldLease("k", clock.now + 3.0, 3, running=True)], counted)
    for _ in range(20):
        clock.now += 0.1
        dog.beat()
        assert not dog.check()
