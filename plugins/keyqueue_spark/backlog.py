"""Backfills that do not flood: a writer waits for workers while the queue's backlog is high.

With ``maxPending`` N the sink keeps the queue's backlog (the requests its inbox stream holds:
every key's, whoever enqueued them) at or under N. Each Spark task publishes in chunks of a
fixed size ``c`` and sends a chunk only when the backlog it reads, plus ``W * c``, is at most N,
where W is the number of tasks that write at once (``maxPendingWriters``). That bound holds
however the tasks interleave: a backlog read misses at most the chunks of the other W - 1 tasks
that are still in flight, each at most ``c``, and the reader's own chunk makes W. A chunk is
``N // (2W)`` rows (at least 1, at most ``batchRows``), so a task sends again once workers have
taken the backlog down to about N / 2.

Requests that others enqueue meanwhile count in the backlog (the writer waits for them too) but
are not held back: the bound is on what this job adds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError

POLL_SECONDS: Final = 0.25
"""How often a waiting task reads the backlog again."""


@dataclass(frozen=True, slots=True)
class BacklogLimit:
    """At most ``max_pending`` requests in the queue, with ``writers`` tasks writing at once."""

    max_pending: int
    writers: int
    batch_rows: int

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ConfigError(f"max-pending must be at least 1, got {self.max_pending}")
        if self.writers < 1:
            raise ConfigError(f"maxPendingWriters must be at least 1, got {self.writers}")
        if self.max_pending < self.writers:
            raise ConfigError(
                f"max-pending {self.max_pending} is less than the {self.writers} tasks that write at once: "
                f"raise it to at least {self.writers}, or write with fewer partitions (--partitions)")

    @property
    def chunk(self) -> int:
        """Rows a task publishes at a time."""
        return max(1, min(self.batch_rows, self.max_pending // (2 * self.writers)))

    def allows(self, backlog: int) -> bool:
        """Whether a task that reads ``backlog`` may publish its next chunk (of at most :attr:`chunk`)."""
        return backlog + self.writers * self.chunk <= self.max_pending


class BacklogGate:
    """One task's side of a :class:`BacklogLimit`: ``await gate.room()`` before each chunk.

    ``read_backlog`` reads the queue's backlog (the inbox stream's message count); ``on_wait``
    is called with each backlog read while the task waits and the seconds waited so far, this
    wait included (the progress report). ``waited`` adds up the seconds spent waiting.
    """

    def __init__(self, limit: BacklogLimit, read_backlog: Callable[[], Awaitable[int]],
                 on_wait: Callable[[int, float], Awaitable[None]] | None = None, *, poll: float = POLL_SECONDS) -> None:
        self.limit = limit
        self.read_backlog = read_backlog
        self.on_wait = on_wait
        self.poll = poll
        self.waited = 0.0
        self.highest = 0

    async def room(self) -> None:
        """Return once the next chunk may go (at once if the backlog allows it)."""
        backlog = await self.read_backlog()
        self.highest = max(self.highest, backlog)
        if self.limit.allows(backlog):
            return
        started = time.monotonic()
        try:
            while not self.limit.allows(backlog):
                if self.on_wait is not None:
                    await self.on_wait(backlog, self.waited + time.monotonic() - started)
                await asyncio.sleep(self.poll)  # workers drain the inbox; nothing announces it
                backlog = await self.read_backlog()
                self.highest = max(self.highest, backlog)
        finally:
            self.waited += time.monotonic() - started
