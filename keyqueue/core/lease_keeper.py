"""Keeping a held key's lease: its record renewed beside the work, the work cut off when it is lost.

While a key session works, its lease record (core/lock.py) is rewritten every third of the lease
from a timer: a renewal runs as a task only while its reply is awaited, so thousands of held keys
keep no task each for it. Each renewal also sends the token a ``+WPI`` (a hint that keeps the
server from redelivering it). A renewal that finds the lease lost, or cannot confirm one before the
lease ends, cancels the work, as a task group would, and the session then sends nothing more for
the key (``KeySession._run`` tells a cut from an outside cancel by :attr:`LeaseKeeper.cut`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final

from keyqueue.core.key_io import KeyIO
from keyqueue.core.lease import Lease
from keyqueue.core.lock import KeyLock
from keyqueue.core.outage import RETRIED
from keyqueue.errors import Disconnected, LeaseLost, ReplyLost
from keyqueue.jetstream.pull import Token

log = logging.getLogger("keyqueue.session")

RENEW_AGAIN: Final = 0.05
"""Seconds before a renewal is tried again after it lost a race to the record (which is still ours)."""


class LeaseKeeper:
    """Renews one key's lease record while its work runs; cancels the work when the lease is lost."""

    __slots__ = ("_lease", "_renewal", "_timer", "_token", "_work", "cut", "failure", "io", "key", "lock")

    def __init__(self, lock: KeyLock, io: KeyIO, key: str, *, lease: Callable[[], Lease],
                 token: Callable[[], Token]) -> None:
        self.lock = lock
        self.io = io
        self.key = key
        self._lease = lease
        self._token = token
        """The token's newest delivery (a session adopts a redelivery: its keepalives go there)."""
        self._work: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Future[None] | None = None
        self.cut = False
        """A renewal found the lease lost and cancelled the work."""
        self.failure: Exception | None = None
        """Why the last renewal failed, if it did (each failure is retried and logged at debug; the
        lease-lost warning says it: without it a lost lease reads "expired" alone)."""

    def start(self, work: asyncio.Task[Any]) -> None:
        """Renew from now on, cancelling ``work`` if the lease is lost."""
        self._work = work
        self._schedule()

    async def stop(self) -> None:
        """No renewal after this (one in flight is cancelled and awaited)."""
        self._work = None
        renewal, self._renewal = self._renewal, None
        if renewal is not None and not renewal.done():
            renewal.cancel()
            await asyncio.wait([renewal])
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def lost_reason(self) -> str:
        """Why the lease was lost, with why its last renewal failed if it did."""
        reason = self._lease().lost_reason or "lease lost"
        if self.failure is not None:
            reason += f"; the last renewal failed: {type(self.failure).__name__}: {self.failure}"
        return reason

    def _schedule(self, after: float | None = None) -> None:
        lease = self._lease()
        delay = min(lease.interval if after is None else after, max(0.0, lease.remaining()))
        self._timer = asyncio.get_running_loop().call_later(delay, self._start_renewal)

    def _start_renewal(self) -> None:
        self._timer = None
        self._renewal = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        """One renewal of the lease record (and a ``+WPI`` for the token); the next is scheduled
        after it. A lost lease cancels the work.

        A renewal that could not be sent, or whose reply never came, is tried again as soon as the
        connection is up (within the lease): a holder that reconnects while its lease is valid
        keeps its key under its own record. One that lost a race to its still-own record (a
        replicated stream's 10164) is tried again shortly."""
        lease = self._lease()
        again: float | None = None
        while True:
            try:
                extended = await self.lock.renew()
                again = None if extended else RENEW_AGAIN
                self.failure = None
                break
            except LeaseLost:
                break
            except Exception as e:
                log.debug("lease renewal for %s failed: %r", self.key, e)
                self.failure = e
                if not isinstance(e, RETRIED) or not lease.valid():
                    break
                connected = await self.io.wait_connected(lease.remaining())
                if not lease.valid():
                    break
                if connected and not isinstance(e, Disconnected | ReplyLost):
                    again = RENEW_AGAIN  # the server did not answer in time: soon, not at once
                    break
        if not lease.valid():
            self.cut = True
            if self._work is not None:
                self._work.cancel()
            return
        if again is None:
            with contextlib.suppress(Exception):
                await self.io.keepalive(self._token())
        if self._work is not None:
            self._schedule(again)
