"""The SerialDvuTask: DVU runs one at a time beside request processing, coalescing triggers.

    request applied ──signal()──►  wake ─► owed()? ── yes ─► run ─► owed()? ── yes ─► run ...
                                                 └─ no ─► idle (wait for a signal)

``signal`` only wakes the task; whether to run is decided by ``owed()``, which reads the
change set's state (pending roots). A run takes all the roots there are, so any number of
requests applied while a run is going leave roots that one more run covers: N triggers during a
run give exactly one more run, never N and never zero. Nothing latches: a signal that finds no
DVU owed is simply forgotten.

Failures: a run that raises is retried with capped exponential backoff; after ``max_failures``
in a row the task stops and :meth:`SerialDvuTask.wait_idle` raises, so the key session ends
without acking and the DVU, still owed in the stored state, runs on the key's next holder. A
lost lease stops the task at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

from keyqueue import LeaseLost

from .errors import DvuFailed

__all__ = ["SerialDvuTask"]

log = logging.getLogger("keyqueue.rebaser.dvu")


class SerialDvuTask:
    """One key's DVU runner; owned by its processor (started in ``open``, stopped in ``close``)."""

    def __init__(self, key: str, *, owed: Callable[[], bool], run: Callable[[], Awaitable[None]],
                 lease_valid: Callable[[], bool], max_failures: int = 5, base_delay: float = 0.1,
                 max_delay: float = 5.0, lease_poll: float = 0.25) -> None:
        self.key = key
        self._owed = owed
        self._run = run
        self._lease_valid = lease_valid
        self.max_failures = max_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        # The key session does not tell its processor when the lease is lost mid-request (it
        # only skips ``close``), so an idle task looks at the lease this often and ends itself.
        self.lease_poll = lease_poll
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.running = False
        self.runs = 0
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"dvu:{self.key}")

    def signal(self) -> None:
        """A request left dependent-value roots: make sure a run covers them."""
        self._idle.clear()
        self._wake.set()

    async def wait_idle(self) -> None:
        """Return once no DVU is running or owed; raise what stopped the task, if it stopped."""
        self.signal()
        while True:
            if self._task is None or self._task.done():
                raise self.error or DvuFailed(f"change set {self.key}: the DVU task is not running")
            if self._idle.is_set() and not self.running and not self._owed():
                return
            idle = asyncio.ensure_future(self._idle.wait())
            try:
                await asyncio.wait({idle, self._task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()

    async def stop(self) -> None:
        """Cancel the task and wait for it (a run cut off here is still owed in the stored state)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        failures = 0
        try:
            while True:
                if not self._lease_valid():
                    raise LeaseLost(f"change set {self.key}: lease lost; the DVU stops here")
                if not self._owed():
                    self._idle.set()
                    # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives as the
                    # wake-up completes, and stop() would then wait for this loop forever.
                    waiter = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait({waiter}, timeout=self.lease_poll)
                    finally:
                        waiter.cancel()
                    self._wake.clear()
                    continue
                self._idle.clear()
                self._wake.clear()
                self.running = True
                try:
                    await self._run()
                    self.runs += 1
                    failures = 0
                except (LeaseLost, asyncio.CancelledError):
                    raise
                except Exception as e:
                    failures += 1
                    if failures >= self.max_failures:
                        raise DvuFailed(f"change set {self.key}: the DVU failed {failures} times in a row, "
                                        f"last with {type(e).__name__}: {e}; it stays owed for the next holder") from e
                    delay = min(self.max_delay, self.base_delay * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
                    log.warning("change set %s: DVU failed (%s: %s); retry %d/%d in %.2fs", self.key,
                                type(e).__name__, e, failures, self.max_failures - 1, delay)
                    await asyncio.sleep(delay)
                finally:
                    self.running = False
        except asyncio.CancelledError:
            raise
        except LeaseLost as e:
            self.error = e
        except Exception as e:
            log.error("change set %s: %s", self.key, e)
            self.error = e
