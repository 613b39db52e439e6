"""A worker's slots: how many of its key sessions may work at once, and which are parked.

A session waiting out a retry's backoff or a rate limit does no work: it is *parked*. It keeps its
key (its lease record is renewed as ever, so nothing behind its request runs, and no other worker
takes the key), but gives its slot back, so that an unrelated key can run meanwhile. To go on it
takes a slot again, before any new key: while a parked session waits for one, the worker pulls no
new token. So a worker holds at most ``capacity`` working sessions, plus any number of parked
ones; parking changes which keys wait, never exclusivity or order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

__all__ = ["Slots"]


class Slots:
    """``capacity`` slots shared by a worker's sessions (``held()`` says how many it holds, parked or not)."""

    def __init__(self, capacity: int, held: Callable[[], int], freed: Callable[[], None] = lambda: None) -> None:
        """``freed()`` is called when a slot is given back by a parking session (to pull a token for it)."""
        self.capacity = capacity
        self.held = held
        self.freed = freed
        self.parked = 0
        """Sessions that hold a key but no slot (waiting out a backoff or a rate limit, or for a slot)."""
        self.resuming = 0
        """Parked sessions waiting for a slot to go on: they come before new keys."""
        self._changed = asyncio.Condition()

    def free(self) -> int:
        """Slots for new keys: the capacity less the working sessions and the sessions waiting to go on."""
        return self.capacity - (self.held() - self.parked) - self.resuming

    def _has_room(self) -> bool:
        return self.held() - self.parked < self.capacity

    async def changed(self) -> None:
        """A session ended or parked: a waiting one may go on."""
        async with self._changed:
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def parked_while(self, stopping: asyncio.Event) -> AsyncIterator[None]:
        """Give the slot back for the block; afterwards take one again, first in line (at once if
        ``stopping`` is set: a draining session goes on to give its key back, and takes no new work)."""
        self.parked += 1
        await self.changed()
        self.freed()
        try:
            yield
        finally:
            self.resuming += 1
            try:
                async with self._changed:
                    await self._changed.wait_for(lambda: stopping.is_set() or self._has_room())
            finally:
                self.resuming -= 1
                self.parked -= 1
