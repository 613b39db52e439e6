"""The reconciler: every key with stored requests and no token gets a token.

It covers a producer that died between its two publishes, a token publish that failed, and
anything else that could strand a request. Publishing a token for a key that already has one is
refused by the server (10077), so running it anywhere, any time, is safe; but scanning every
subject of a big queue from every worker is waste, so one worker of the fleet is elected for it
with the same lease records that lock keys (core/lock.py, subject ``kq.<queue>.role.reconciler``).
When the elected worker dies, its record expires and another takes over within two intervals.
"""

from __future__ import annotations

import asyncio
import logging

from keyqueue.core.key_io import ReconcilerIO
from keyqueue.core.lock import KeyLock, StaleRecordWatch
from keyqueue.errors import KeyqueueError, LeaseLost

log = logging.getLogger("keyqueue.reconciler")


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
        """Reconcile now and then every ``interval`` seconds until cancelled."""
        while True:
            try:
                if await self.elected():
                    await self.reconcile()
            except KeyqueueError as e:
                log.warning("queue %s: reconcile pass failed: %s", self.io.names.queue, e)
            except Exception:
                # Not an outage: a bug. It must not end the pass after it, nor the worker's key
                # sessions (they share the worker's task group).
                log.exception("queue %s: reconcile pass failed unexpectedly; trying again in %gs", self.io.names.queue,
                              self.interval)
            await asyncio.sleep(self.interval)
