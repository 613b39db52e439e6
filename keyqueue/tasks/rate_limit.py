"""Per-key rate limits: ``@app.task(key=..., rate_limit="10/m")``.

A rate limit allows at most ``count`` runs of the task per key in any window of ``period``
seconds, across the whole fleet. The key's holder enforces it before a run starts: it keeps the
start times of the key's recent runs (a sliding-window log, at most ``count`` entries) where the
next holder finds them, and when the window is full it waits, holding the key (so its later
requests keep their order behind it), until the oldest run leaves the window. Other keys are not
affected. This module is the pure part: parsing, and when the next run may start.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError

__all__ = ["RateLimit", "parse_rate_limit"]

_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE: Final = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*$")


@dataclass(frozen=True)
class RateLimit:
    """At most ``count`` runs per key in any ``period`` seconds."""

    count: int
    period: float
    text: str = ""
    """As declared (``"10/m"``)."""

    def __post_init__(self) -> None:
        if self.count < 1 or not self.period > 0:
            raise ConfigError(f"a rate limit allows at least 1 run per positive period, "
                              f"got {self.count}/{self.period}s")

    def __str__(self) -> str:
        return self.text or f"{self.count}/{self.period:g}s"

    def window(self, starts: Sequence[float], now: float) -> list[float]:
        """The start times of ``starts`` still inside the window ending at ``now``, oldest first."""
        return sorted(t for t in starts if t > now - self.period)[-self.count:]

    def wait(self, starts: Sequence[float], now: float) -> float:
        """Seconds until one more run may start (0: now), given the key's recent run start times."""
        recent = self.window(starts, now)
        if len(recent) < self.count:
            return 0.0
        return max(0.0, recent[-self.count] + self.period - now)


def parse_rate_limit(text: str) -> RateLimit:
    """``"N/s"``, ``"N/m"`` or ``"N/h"`` (N >= 1 runs per second, minute or hour); ``ConfigError`` otherwise."""
    match = _RATE.match(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"rate_limit {text!r} is not a rate: write N/s, N/m or N/h with N >= 1 (e.g. '10/m')")
    return RateLimit(int(match.group(1)), _UNITS[match.group(2)], text.strip())
