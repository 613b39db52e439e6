"""The lease: how long this worker may still act for a key it holds.

The server deletes the key's lease record (core/lock.py) ``ack_wait`` after the holder last
wrote it, and it accepts a stale holder's ack (docs/architecture.md, "Fencing"), so a holder must
stop acting for its key before the record can have expired: by its own clock. A keepalive counts
only if its reply arrived before the current deadline (then the server certainly got it in
time); the new deadline runs from when it was *sent*. Everything is on the monotonic clock, less
a safety margin.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from keyqueue.errors import LeaseLost


class Lease:
    """Deadline bookkeeping for one held token. Pure logic; the clock is injectable."""

    __slots__ = ("ack_wait", "clock", "deadline", "lost_reason", "margin")

    def __init__(self, ack_wait: float, received_at: float, *, margin: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ack_wait = ack_wait
        self.margin = self.default_margin(ack_wait) if margin is None else margin
        self.clock = clock
        self.deadline = received_at + ack_wait - self.margin
        self.lost_reason: str | None = None

    @staticmethod
    def default_margin(ack_wait: float) -> float:
        """The safety margin taken off every deadline: 10% of ``ack_wait``, at most 1 s."""
        return min(1.0, ack_wait * 0.1)

    @property
    def interval(self) -> float:
        """How often to send a keepalive."""
        return self.ack_wait / 3

    def remaining(self) -> float:
        return self.deadline - self.clock()

    @property
    def kill_point(self) -> float:
        """When a run of this key that is still going on must end with its process
        (core/alarm.py): half the margin after :attr:`deadline`, so the session has that long to
        stop a run it can stop, and still before the server can expire the lease record."""
        return self.deadline + self.margin / 2

    def valid(self) -> bool:
        if self.lost_reason is None and self.clock() >= self.deadline:
            self.lost_reason = "lease expired: no keepalive confirmed in time"
        return self.lost_reason is None

    def check(self) -> None:
        """Raise LeaseLost unless this worker still owns the key."""
        if not self.valid():
            raise LeaseLost(self.lost_reason)

    def confirmed(self, sent_at: float, replied_at: float) -> bool:
        """Record a keepalive's reply; True if it extended the lease."""
        if not self.valid():
            return False
        if replied_at >= self.deadline:
            self.lost_reason = "keepalive confirmed after the lease deadline"
            return False
        self.deadline = max(self.deadline, sent_at + self.ack_wait - self.margin)
        return True

    def lose(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason
