"""The reconciler: every key with stored requests and no token gets a token.

It covers a producer that died between its two publishes, a token publish that failed, and
anything else that could strand a request. Publishing a token for a key that already has one is
refused by the server (10077), so running it anywhere, any time, is safe.
"""

from __future__ import annotations

import asyncio
import logging

from keyqueue.errors import KeyqueueError
from keyqueue.jetstream.queue_io import QueueIO

log = logging.getLogger("keyqueue.reconciler")


class Reconciler:
    """Schedules stranded keys of one queue, once or on an interval."""

    def __init__(self, io: QueueIO, *, interval: float = 30.0) -> None:
        self.io = io
        self.interval = interval
        self.scheduled_total = 0

    async def reconcile(self) -> list[str]:
        """One pass; returns the keys it scheduled."""
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
                await self.reconcile()
            except KeyqueueError as e:
                log.warning("queue %s: reconcile pass failed: %s", self.io.names.queue, e)
            await asyncio.sleep(self.interval)
