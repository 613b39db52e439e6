"""The purge windows of a worker's key sessions end on one loop timer, in the order they opened."""

from __future__ import annotations

import asyncio
from typing import Any

from keyqueue.core.removals import PurgeWindows


class Ended:
    """Stands in for a session's Removals: notes when its window ends."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail
        self.io: Any = type("IO", (), {"names": type("Names", (), {"queue": "q"})()})()
        self.key = name

    def window_ended(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError("a bug in one window's end")


async def test_windows_end_in_the_order_they_opened_and_a_closed_one_is_not_told() -> None:
    loop = asyncio.get_running_loop()
    windows = PurgeWindows(window=0.02)
    log: list[str] = []
    a, b, c = Ended("a", log), Ended("b", log, fail=True), Ended("c", log)
    timers_before = len(loop._scheduled)  # type: ignore[attr-defined]
    for each in (a, b, c):
        windows.open(each)  # type: ignore[arg-type]
    windows.open(a)  # type: ignore[arg-type]  # open already: unchanged
    assert len(windows) == 3 and a in windows
    assert len(loop._scheduled) == timers_before + 1, "one timer for every window"  # type: ignore[attr-defined]
    windows.close(c)  # type: ignore[arg-type]
    ended = asyncio.Event()

    class Last(Ended):
        def window_ended(self) -> None:
            super().window_ended()
            ended.set()

    d = Last("d", log)
    windows.open(d)  # type: ignore[arg-type]  # opened last: ends last
    await asyncio.wait_for(ended.wait(), 5)
    # b's end raised: logged, and d still ended; c was closed: never told.
    assert log == ["a", "b", "d"]
    assert len(windows) == 0
