"""``ServerClock``: the server's time from the stamps it puts on stored messages, never this host's wall clock."""

from __future__ import annotations

import datetime as dt

import pytest

from keyqueue.jetstream.server_clock import ServerClock

T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


class Monotonic:
    def __init__(self) -> None:
        self.value = 1000.0

    def __call__(self) -> float:
        return self.value


def test_it_runs_on_from_the_stamp_by_the_monotonic_clock() -> None:
    mono = Monotonic()
    clock = ServerClock(mono)
    clock.saw(T0)
    mono.value += 7.5
    assert clock.now() == T0 + dt.timedelta(seconds=7.5)


def test_the_freshest_stamp_wins_and_an_older_one_never_winds_it_back() -> None:
    mono = Monotonic()
    clock = ServerClock(mono)
    clock.saw(T0)  # a redelivery, stored long before: the clock lags the server by that much
    assert clock.now() == T0
    clock.saw(T0 + dt.timedelta(seconds=6))  # stored just now: closer to the server's time
    assert clock.now() == T0 + dt.timedelta(seconds=6)
    mono.value += 2
    clock.saw(T0 + dt.timedelta(seconds=1))
    assert clock.now() == T0 + dt.timedelta(seconds=8)


def test_before_any_stamp_the_servers_time_is_unknown() -> None:
    clock = ServerClock(Monotonic())
    clock.saw(None)
    clock.saw(dt.datetime(2026, 11, 27))  # naive: no zone, no server time
    assert not clock.known
    with pytest.raises(LookupError, match="no server timestamp"):
        clock.now()


def test_a_tokens_stamp_in_seconds_bounds_the_servers_clock_from_below() -> None:
    now = [50.0]
    clock = ServerClock(monotonic=lambda: now[0])
    assert clock.now_seconds() is None
    clock.saw_seconds(0.0, 50.0)  # no stamp
    assert clock.now_seconds() is None
    clock.saw_seconds(1_000.0, 40.0)  # stored at 1,000, seen 10 s ago
    assert clock.now_seconds() == 1_010.0
    clock.saw_seconds(1_012.0, 49.0)  # a fresher stamp: the server is at least at 1,013 now
    assert clock.now_seconds() == 1_013.0
    clock.saw_seconds(900.0, 50.0)  # an old one (a redelivered token) never winds it back
    now[0] = 52.0
    assert clock.now_seconds() == 1_015.0
