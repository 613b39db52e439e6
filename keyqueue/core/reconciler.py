"""The reconciler: every key with stored requests and no token gets a token.

It covers a producer that died between its two publishes, a token publish that failed, and
anything else that could strand a request. Publishing a token for a key that already has one is
refused by the server (10077), so running it anywhere, any time, is safe; but scanning every
subject of a big queue from every worker is waste, so one worker of the fleet is elected for it
with the same lease records that lock keys (core/lock.py, subject ``kq.<queue>.role.reconciler``).
When the elected worker dies, its record expires and another takes over within two intervals.

A pass that fails (an outage: a stream with no leader, a connection down) is tried again after
half a second, then twice as long each time up to the interval: a token publish refused during an
outage is repaired as soon as the streams answer again, not an interval later. The worker also
wakes the reconciler when its token pulls are answered again after refusals (503 with no leader,
409), or its connection is back: the moments after which tokens may be missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from keyqueue.core.key_io import ReconcilerIO
from keyqueue.core.lock import KeyLock, StaleRecordWatch
from keyqueue.errors import KeyqueueError, LeaseLost

log = logging.getLogger("keyqueue.reconciler")

RETRY_FIRST: Final = 0.5
"""Seconds before a failed pass is tried again (doubling up to the interval)."""


class Reconciler:
    """Schedules stranded keys of one queue, once or on an interval."""

    def __init__(self, io: ReconcilerIO, *, interval: float = 30.0, worker: str = "") -> None:
        self.io = io
        self.interval = interval
        self.worker = worker
        self.scheduled_total = 0
        self.passes = 0
        """Passes this worker ran (only while elected)."""
        self._expiry = StaleRecordWatch()
        """What this worker saw of the elected worker's record, across its tries to be elected."""
        self._lock = self._new_claim()
        self._woken = asyncio.Event()
        self._began = 0.0
        """When the current pass began (the event loop's clock)."""

    def wake(self) -> None:
        """Run a pass now (if elected) rather than at the end of the interval: tokens may be missing
        (a token stream back from an outage, a connection back)."""
        self._woken.set()

    def _new_claim(self) -> KeyLock:
        claim = KeyLock(self.io, self.io.names.role("reconciler"), max(1.0, 2 * self.interval),
                        holder={"worker": self.worker, "role": "reconciler"})
        claim.expiry = self._expiry
        return claim

    async def elected(self) -> bool:
        """True while this worker holds the queue's reconciler role (acquiring it if free)."""
        if self._lock.held:
            try:
                await self._lock.renew()
                return True
            except LeaseLost:
                pass
        self._lock = self._new_claim()
        if await self._lock.try_acquire():
            return True
        await self._lock.clear_expired()  # the server may keep a dead holder's record (core/lock.py)
        return False

    async def reconcile(self) -> list[str]:
        """One pass; returns the keys it scheduled."""
        self.passes += 1
        with_requests = await self.io.keys_with_requests()
        with_tokens = await self.io.keys_with_tokens()
        scheduled = []
        for key in with_requests.keys() - with_tokens:
            if await self.io.schedule(key):
                scheduled.append(key)
        if scheduled:
            self.scheduled_total += len(scheduled)
            log.info("queue %s: reconciler scheduled %d stranded key(s): %s", self.io.names.queue,
                     len(scheduled), ", ".join(sorted(scheduled)[:10]))
        return scheduled

    async def run(self) -> None:
        """Reconcile now and then every ``interval`` seconds (sooner after a failed pass, or when
        woken) until cancelled."""
        retry = RETRY_FIRST
        while True:
            self._woken.clear()
            self._began = asyncio.get_running_loop().time()
            delay = self.interval
            try:
                if await self.elected():
                    await self.reconcile()
                retry = RETRY_FIRST
            except KeyqueueError as e:
                first = retry == RETRY_FIRST
                delay, retry = min(self.interval, retry), min(self.interval, 2 * retry)
                # One warning per outage (and one per interval while it lasts), not per retry.
                log.log(logging.WARNING if first or delay == self.interval else logging.DEBUG,
                        "queue %s: reconcile pass failed: %s; trying again in %gs", self.io.names.queue, e, delay)
            except Exception:
                # Not an outage: a bug. It must not end the pass after it, nor the worker's key
                # sessions (they share the worker's task group).
                log.exception("queue %s: reconcile pass failed unexpectedly; trying again in %gs", self.io.names.queue,
                              self.interval)
            await self._pause(delay)

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or until woken (passes stay ``RETRY_FIRST`` apart however often
        the worker wakes it)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._woken.wait()
        await asyncio.sleep(max(0.0, self._began + RETRY_FIRST - asyncio.get_running_loop().time()))
