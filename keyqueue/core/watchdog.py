"""The loop watchdog: a thread that ends the worker process before a blocked event loop outlives a lease.

A worker renews its keys' leases on its event loop. A handler that blocks the loop (CPU-bound
work or sync I/O in an ``async def``) starves the renewals; its lease ends on the server while
its code still runs, another worker acquires the key and runs the same request beside it. The
fencing token keeps a stale writer out of the stores that check it, but the user's other side
effects would happen twice.

So a thread watches the loop. It fires when the loop has been blocked for a while *and* some held
key's lease is about to end (a quarter of ``ack_wait`` before its deadline: a loop that runs renews
every third of ``ack_wait``, so a healthy worker never gets that close), and also, blocked or not,
when a key's run still goes on a little past its lease's deadline (its session lost the lease and
cancelled the work, but a sync task's thread cannot be cancelled). Then it

1. counts the attempt that blocked: for each key with a request in hand, one more killed attempt
   of that request in the key's head record (``kq.<queue>.head.<key>``), on a connection of its
   own, within a short budget; the next holder counts it toward the task's ``max_attempts``
   (:meth:`~keyqueue.core.session.KeySession`), so a request that always blocks ends in the DLQ;
2. logs one critical line naming the keys and the requests, and
3. ends the process at once (``os._exit``, status :data:`EXIT_BLOCKED`), before any lease
   could have ended: the next holder starts only after the record expires, or after a
   supervisor that saw the process exit released its keys. Nothing of it runs beside the next.

This thread needs the GIL. C code that holds it (``sum(range(n))``, a huge ``json.loads``) stops
this thread with the loop; so does a SIGSTOP. For those the kernel's lease alarm (core/alarm.py)
ends the process at the lease's kill point, a little later, with no last word and no count.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

log = logging.getLogger("keyqueue.worker")

__all__ = ["EXIT_BLOCKED", "HeldLease", "LoopWatchdog"]

EXIT_BLOCKED: Final = 75
"""The status a worker process ends with when its watchdog stopped it (a supervisor restarts it)."""

CHECK_EVERY: Final = 0.05
"""Seconds between the watchdog's looks."""

MIN_COUNT_BUDGET: Final = 0.1
"""Seconds that must be left before a lease ends (or the lease alarm fires) for the watchdog to try
to count the attempts it stops; with less, it ends the process without counting them."""


@dataclass(frozen=True, slots=True)
class HeldLease:
    """One key held by the worker, as the watchdog sees it."""

    key: str
    deadline: float
    """When its lease ends (``time.monotonic()``)."""
    in_hand: int
    """The inbox sequence of the request being processed, 0 between requests."""
    running: bool = False
    """Whether the key's work (the user's code) is going on: a run the process must not outlive its
    lease with, even once the lease is lost."""


class LoopWatchdog:
    """Watches one event loop (its :meth:`beat` is called from the loop) and the leases held under it.

    ``leases`` is called from the watchdog's thread: it must tolerate the loop's thread mutating
    what it reads (a blocked loop mutates nothing; a loop that runs is not the watchdog's concern).
    ``count_killed`` and ``exit`` are what it does when it fires (injectable for tests).
    """

    def __init__(self, ack_wait: float, leases: Callable[[], Sequence[HeldLease]], *,
                 count_killed: Callable[[Sequence[HeldLease], float], None] | None = None,
                 exit: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic,
                 check_every: float = CHECK_EVERY) -> None:
        self.ack_wait = ack_wait
        self.leases = leases
        self.count_killed = count_killed
        self.exit = exit
        self.clock = clock
        self.check_every = check_every
        self.ahead = ack_wait / 4
        """Fire this long before the earliest deadline of a held lease."""
        self.blocked_after = min(1.0, ack_wait / 8)
        """The loop counts as blocked once it has not beaten for this long."""
        self.overrun = min(1.0, ack_wait * 0.1) / 4
        """A run still going on this long after its lease's deadline is one its session could not
        stop (a thread, a handler that ignored its cancellation): a quarter of the lease's safety
        margin, half the time left before the kernel's lease alarm (core/alarm.py) would end it."""
        self.last_beat = clock()
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The loop ran: call this from the loop, often (the worker's loop-lag monitor does, every 0.1 s)."""
        self.last_beat = self.clock()

    def start(self) -> None:
        if self._thread is None:
            self.last_beat = self.clock()
            self._thread = threading.Thread(target=self._run, name="keyqueue-loop-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            if self.check():
                return

    def due(self) -> list[HeldLease] | None:
        """The held leases, if the watchdog must fire now; else None.

        It fires when the loop is blocked and a lease whose key's run goes on, or one still valid, is
        about to end; or when, blocked or not, a run goes on past its lease's deadline (its session
        could not stop it: only ending the process does)."""
        now = self.clock()
        for _ in range(3):  # the loop's thread may change the sessions while we read them
            try:
                held = list(self.leases())
                break
            except RuntimeError:
                continue
        else:
            return None
        if any(h.running and now >= h.deadline + self.overrun for h in held):
            return held
        if now - self.last_beat < self.blocked_after:
            return None
        # A lease past its deadline whose key runs nothing is lost harmlessly: its session stops at
        # its next check. One whose run goes on is what the process must not outlive.
        held = [h for h in held if h.deadline > now or h.running]
        if not held or min(h.deadline for h in held) - now > self.ahead:
            return None
        return held

    def check(self) -> bool:
        """One look; True if it fired (the process is ending)."""
        held = self.due()
        if held is None:
            return False
        self.fired = True
        now = self.clock()
        blocked = now - self.last_beat
        overrun = [h for h in held if h.running and now >= h.deadline + self.overrun]
        # What is left before a lease ends (for the overrun, before the kernel's lease alarm): the
        # count must not keep the process alive past it.
        ends = [h.deadline + 2 * self.overrun for h in overrun] or [h.deadline for h in held]
        left = min(ends) - now
        in_hand = [h for h in held if h.in_hand]
        if left < MIN_COUNT_BUDGET:
            log.error("loop watchdog: no time left to count the attempts it stops (%.0f ms)", max(0.0, left) * 1000)
        elif self.count_killed is not None and in_hand:
            try:
                self.count_killed(in_hand, min(0.5, left / 2))
            except Exception as e:  # the attempt goes uncounted; the stop must not wait for it
                log.error("loop watchdog: could not count the blocked attempts: %r", e)
        requests = ", ".join(f"{h.key} (seq {h.in_hand})" for h in in_hand[:5]) or "none in hand"
        if overrun and blocked < self.blocked_after:
            keys = ", ".join(h.key for h in overrun[:5])
            self.end_process(f"{len(overrun)} run(s) still going on after their leases ended (keys {keys}; "
                             f"requests in hand: {requests}): the lease could not be renewed (see the renewal "
                             "warnings above) while a sync task ran in a thread, which nothing can stop, and it must "
                             "not run beside the key's next holder (with --pool processes the run alone is stopped)")
        else:
            self.end_process(f"event loop blocked for {blocked:.1f}s with {len(held)} key(s) held, a lease ending in "
                             f"{left:.1f}s; requests in hand: {requests}. A handler is blocking the loop: make it "
                             "async, or a sync function (it runs in a thread)")
        return True

    def end_process(self, why: str) -> None:
        """End the process now (status :data:`EXIT_BLOCKED`), saying why, so that no other worker runs
        its keys beside work it cannot stop; its leases end on the server."""
        self.fired = True
        log.critical("%s: stopping this worker process now (exit status %d) so that no other worker runs its keys "
                     "beside it", why, EXIT_BLOCKED)
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:
                pass
        sys.stderr.flush()
        self.exit(EXIT_BLOCKED)
