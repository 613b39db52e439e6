"""``Delay``: when a request may start, from ``options(countdown=...)`` or ``options(eta=...)``.

A delayed request is stored at once (on the server, by its message schedules) and joins its key's
order at its due time: a request enqueued without delay after it, but due before it, runs first.
The due time is computed by whoever stores the request (``now`` is the server path's wall clock,
or the fake clock of ``keyqueue.testing``), so a countdown counts from the enqueue.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from keyqueue.errors import InvalidSchedule

__all__ = ["Delay"]


@dataclass(frozen=True, slots=True)
class Delay:
    """A countdown in seconds, or an aware due time (exactly one of them)."""

    countdown: float | None = None
    eta: dt.datetime | None = None

    def __post_init__(self) -> None:
        if (self.countdown is None) == (self.eta is None):
            raise InvalidSchedule("give countdown= or eta=, not both")
        if self.countdown is not None:
            c = self.countdown
            if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c):
                raise InvalidSchedule(f"countdown must be a number of seconds, not {c!r}")
            if c < 0:
                raise InvalidSchedule(f"countdown must be >= 0 seconds, got {c}")
        if self.eta is not None:
            if not isinstance(self.eta, dt.datetime):
                raise InvalidSchedule(f"eta must be a datetime, not {type(self.eta).__name__}")
            if self.eta.tzinfo is None or self.eta.utcoffset() is None:
                raise InvalidSchedule(f"eta {self.eta.isoformat()} is naive: give it a time zone "
                                      "(datetime.now(timezone.utc) + ..., or .replace(tzinfo=...))")

    @classmethod
    def of(cls, countdown: float | None, eta: dt.datetime | None) -> Delay | None:
        """The delay the options ask for, or None for none (``InvalidSchedule`` for bad ones)."""
        if countdown is None and eta is None:
            return None
        return cls(countdown, eta)

    def due(self, now: dt.datetime) -> dt.datetime:
        """The due time, in UTC, for a request stored at ``now``."""
        if self.eta is not None:
            return self.eta.astimezone(dt.UTC)
        assert self.countdown is not None
        return (now + dt.timedelta(seconds=self.countdown)).astimezone(dt.UTC)
