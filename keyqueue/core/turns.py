"""Turns on the event loop for busy key sessions, so that a key that just arrived goes first.

A busy session (one with requests read ahead and deletes pipelined) can run request after
request without waiting for I/O, so it yields to the loop after each one while requests are left
for it to read (after its last one it waits for a reply anyway: a cold key's session takes no
turn). With a hundred such sessions, one loop iteration runs a hundred requests before anything
else gets its next step, and a new key needs about ten steps (its token, the lease record, the
first read, the handler), each one iteration apart: it waited a hundred milliseconds and more
behind the busy keys.

While some session is on its way to its first request (it is *hurrying*), :class:`Turns` lets
at most ``per_iteration`` busy sessions go on in one loop iteration; the others wait, in the
order they asked, for a later iteration. Everything else (the hurrying session's steps, replies,
keepalives, the token puller) runs in every iteration, so iterations stay short and the new key
gets each of its steps promptly. With nobody hurrying, a turn is a plain yield: many short
iterations cost loop overhead per request, which busy keys alone should not pay.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Final

PER_ITERATION: Final = 4
"""Busy sessions that may go on in one loop iteration while a session hurries."""


class Turns:
    """Shares loop iterations between busy key sessions (one per worker)."""

    def __init__(self, per_iteration: int = PER_ITERATION) -> None:
        self.per_iteration = per_iteration
        self.hurrying = 0
        """Sessions on their way to their first request (see :meth:`hurry`)."""
        self._granted = 0
        """Turns given in the current iteration."""
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._tick_pending = False

    def hurry(self, on: bool) -> None:
        """A session starts (``True``) or stops (``False``) hurrying to its first request."""
        self.hurrying += 1 if on else -1

    async def take(self) -> None:
        """Yield to the loop between two requests. While a session hurries: go on in the next
        iteration if it has a turn left, else wait for a later one, behind those that asked first."""
        if not self._waiting and (not self.hurrying or self._granted < self.per_iteration):
            if self.hurrying:
                self._granted += 1
                self._schedule_tick()
            await asyncio.sleep(0)
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._schedule_tick()
        await turn

    def _schedule_tick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """Once per loop iteration while turns are counted: count afresh, and give this
        iteration's turns to the sessions waiting longest (they run in the next iteration)."""
        self._tick_pending = False
        self._granted = 0
        limit = self.per_iteration if self.hurrying else len(self._waiting)
        while self._waiting and self._granted < limit:
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled session gives its turn to the next
                turn.set_result(None)
                self._granted += 1
        if self._waiting or (self._granted and self.hurrying):
            self._schedule_tick()
