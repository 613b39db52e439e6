"""Turns between busy key sessions (core/turns.py): who goes on in which loop iteration.

Loop iterations are counted, not timed: a callback rescheduled with ``call_soon`` runs once per
iteration, so the iteration in which each session went on is known exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from keyqueue.core.turns import Turns


class Iterations:
    """Counts event loop iterations while it runs."""

    def __init__(self) -> None:
        self.now = 0
        self._handle: asyncio.Handle | None = None

    def __enter__(self) -> Callable[[], int]:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)
        return lambda: self.now

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def _tick(self) -> None:
        self.now += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)


async def busy(turns: Turns, name: str, steps: int, log: list[tuple[str, int]], now: Callable[[], int]) -> None:
    """A busy session: a request (logged with the iteration it ran in), then a turn, ``steps`` times."""
    for _ in range(steps):
        log.append((name, now()))
        await turns.take()


def per_iteration(log: list[tuple[str, int]]) -> list[int]:
    counts: dict[int, int] = {}
    for _, iteration in log:
        counts[iteration] = counts.get(iteration, 0) + 1
    return [counts[i] for i in sorted(counts)]


async def test_without_a_hurrying_session_every_busy_session_goes_on_in_every_iteration() -> None:
    turns = Turns(per_iteration=2)
    log: list[tuple[str, int]] = []
    with Iterations() as now:
        await asyncio.gather(*(busy(turns, f"s{i}", 3, log, now) for i in range(6)))
    assert per_iteration(log) == [6, 6, 6]


async def test_while_a_session_hurries_only_a_few_busy_ones_go_on_per_iteration_in_turn() -> None:
    turns = Turns(per_iteration=2)
    log: list[tuple[str, int]] = []
    turns.hurry(True)
    with Iterations() as now:
        await asyncio.gather(*(busy(turns, f"s{i}", 3, log, now) for i in range(6)))
    counts = per_iteration(log)
    assert counts[0] == 6, "every session runs its first request before asking for a turn"
    assert max(counts[1:]) <= 2 and sum(counts) == 18
    # Turns go round in the order asked: no session runs its third request before every session
    # ran its second.
    ran: dict[str, list[int]] = {}
    for name, iteration in log:
        ran.setdefault(name, []).append(iteration)
    assert max(r[1] for r in ran.values()) <= min(r[2] for r in ran.values())


async def test_when_the_hurrying_session_has_started_the_waiting_ones_all_go_on() -> None:
    turns = Turns(per_iteration=1)
    log: list[tuple[str, int]] = []
    turns.hurry(True)
    with Iterations() as now:
        sessions = [asyncio.ensure_future(busy(turns, f"s{i}", 2, log, now)) for i in range(5)]
        for _ in range(3):  # every first request runs; the sessions then wait for turns
            await asyncio.sleep(0)
        assert 6 <= len(log) < 10
        turns.hurry(False)
        released = now()
        await asyncio.gather(*sessions)
    assert len(log) == 10
    assert all(i <= released + 2 for _, i in log), "the waiting sessions were not let go at once"


async def test_a_cancelled_waiting_session_gives_its_turn_to_the_next() -> None:
    turns = Turns(per_iteration=1)
    turns.hurry(True)
    await turns.take()  # uses this iteration's turn
    first = asyncio.ensure_future(turns.take())
    second = asyncio.ensure_future(turns.take())
    await asyncio.sleep(0)
    first.cancel()
    async with asyncio.timeout(5):
        await second
    assert first.cancelled()
