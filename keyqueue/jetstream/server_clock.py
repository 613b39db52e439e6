"""``ServerClock``: the server's wall clock as a client can know it without reading its own.

nats-server stamps every message it stores with its own wall clock, and fires ``@at`` schedules
by that clock. A client whose decision is "some seconds from the server's now" (the due mover's
re-schedules) or "long past by the server's clock" (a parked key's staleness) must not put its
own wall clock in the server's place: hosts' clocks disagree, by seconds or minutes
(docs/architecture.md, "What depends on time").

Each stamp the client sees was taken before the client saw it, so ``stamp + (time elapsed since
it was seen, on this host's monotonic clock)`` is never ahead of the server's clock, as long as
the two clocks run at the same rate; the largest such value over every stamp seen is the closest
to it. :meth:`ServerClock.now` is that value: it lags the server by the freshest stamp's delivery
delay (milliseconds for a message delivered as it is stored). A server clock stepped back by
NTP puts it ahead by the step until then; stamps never wind it back.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Final

__all__ = ["ServerClock"]

_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class ServerClock:
    """The server's wall clock, from the stamps on what it stored and this host's monotonic clock."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._offset: float | None = None
        """Server seconds since the epoch minus this host's monotonic seconds, at its largest."""

    def saw(self, stamp: dt.datetime | None) -> None:
        """A server timestamp just read from a stored message (None, or a naive one: ignored)."""
        if stamp is None or stamp.tzinfo is None:
            return
        self.saw_seconds((stamp - _EPOCH).total_seconds(), self._monotonic())

    def saw_seconds(self, stamp: float, seen: float) -> None:
        """A server timestamp as Unix seconds (0 or less: ignored), seen at ``seen`` on this host's
        monotonic clock (a token's ``stored_at`` and ``received_at``)."""
        if stamp <= 0:
            return
        offset = stamp - seen
        if self._offset is None or offset > self._offset:
            self._offset = offset

    def now_seconds(self) -> float | None:
        """:meth:`now` as Unix seconds; None before the first stamp."""
        return None if self._offset is None else self._monotonic() + self._offset

    @property
    def known(self) -> bool:
        """Whether a stamp has been seen (before that, :meth:`now` has nothing to go on)."""
        return self._offset is not None

    def now(self) -> dt.datetime:
        """The server's time now, never ahead of it; ``LookupError`` before the first stamp."""
        if self._offset is None:
            raise LookupError("no server timestamp seen yet: the server's time is unknown")
        return _EPOCH + dt.timedelta(seconds=self._monotonic() + self._offset)
