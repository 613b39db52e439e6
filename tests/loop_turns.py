"""How often the event loop got to run other tasks while a test awaited something: the proof that
a wait yielded (a thread, a reconnect) rather than held the loop."""

from __future__ import annotations

import asyncio
from types import TracebackType


class LoopTurns:
    """``async with LoopTurns(every) as turns``: ``turns.count`` is how many times a task on the loop
    ran (every ``every`` seconds; 0: at each turn of the loop) while the block ran."""

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _count(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(self.every)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._count())
        await asyncio.sleep(0)  # the counter is running before the block starts
        self.count = 0
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
