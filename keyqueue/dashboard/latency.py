"""Wait and run times of a queue over the last few minutes, and their percentiles.

*Wait* is from enqueue to handler start (the ``wait`` of a ``started`` event), *run* is the
handler's seconds (the ``run`` of a ``succeeded`` or ``dead_lettered`` event). Each queue keeps
one ``Latencies`` per kind: a ring of ``BUCKET``-second slots over ``WINDOW`` seconds, each slot
a histogram with logarithmic bins (``RATIO`` apart, so a percentile is off by at most ~4.5%).
Memory stays bounded whatever the rate (a few hundred counters per slot at most), and adding
a time is a dictionary increment: the dashboard follows every event of every queue.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Final

__all__ = ["BUCKET", "RATIO", "RECENT", "WINDOW", "Latencies", "bin_of", "bin_value", "quantile_of"]

BUCKET: Final = 10.0
"""Seconds per slot: one point of a chart."""

WINDOW: Final = 300.0
"""Seconds kept: what a chart spans."""

RECENT: Final = 60.0
"""Seconds the figures next to a chart cover."""

RATIO: Final = 2 ** (1 / 8)
"""Ratio between two neighbouring bins' upper edges."""

SMALLEST: Final = 1e-5
"""The first bin's upper edge (seconds); shorter times go into it."""


def bin_of(seconds: float) -> int:
    """The histogram bin of a time (bins are ``RATIO`` apart; 0 holds everything up to ``SMALLEST``)."""
    if seconds <= SMALLEST:
        return 0
    return math.ceil(math.log(seconds / SMALLEST, RATIO))


def bin_value(index: int) -> float:
    """A bin's representative: the geometric middle of its edges."""
    return SMALLEST * RATIO ** (index - 0.5) if index > 0 else SMALLEST


class Latencies:
    """Times (seconds) seen over the last ``window`` seconds, in ``bucket``-second slots."""

    def __init__(self, *, bucket: float = BUCKET, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket = bucket
        self.slots = max(1, round(window / bucket))
        self.clock = clock
        self._ring: deque[tuple[int, Counter[int]]] = deque()
        """(slot number, bin -> count), oldest first; slots without a time are absent."""

    def add(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        slot = self._slot()
        if not self._ring or self._ring[-1][0] != slot:
            self._ring.append((slot, Counter()))
            self._trim(slot)
        self._ring[-1][1][bin_of(seconds)] += 1

    def quantile(self, q: float, over: float = RECENT) -> float | None:
        """The ``q`` quantile (0.5: median) of the times of the last ``over`` seconds; None without any."""
        now = self._slot()
        first = now - max(1, math.ceil(over / self.bucket)) + 1
        return quantile_of((counts for slot, counts in self._ring if slot >= first), q)

    def count(self, over: float = RECENT) -> int:
        """How many times the last ``over`` seconds hold."""
        first = self._slot() - max(1, math.ceil(over / self.bucket)) + 1
        return sum(sum(counts.values()) for slot, counts in self._ring if slot >= first)

    def series(self, q: float) -> list[float | None]:
        """The ``q`` quantile of each slot of the window, oldest first (None: nothing then)."""
        now = self._slot()
        self._trim(now)
        by_slot = dict(self._ring)
        return [quantile_of([by_slot[s]], q) if s in by_slot else None for s in range(now - self.slots + 1, now + 1)]

    def _slot(self) -> int:
        return int(self.clock() // self.bucket)

    def _trim(self, now: int) -> None:
        while self._ring and self._ring[0][0] <= now - self.slots:
            self._ring.popleft()


def quantile_of(slots: Iterable[Counter[int]], q: float) -> float | None:
    """The ``q`` quantile of the times counted in ``slots`` (bin -> count), None without any."""
    merged: Counter[int] = Counter()
    for counts in slots:
        merged.update(counts)
    total = sum(merged.values())
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(merged):
        seen += merged[index]
        if seen >= rank:
            return bin_value(index)
    return bin_value(max(merged))
