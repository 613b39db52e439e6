"""Riding out an outage: a NATS step tried again after a lost connection or no answer, for as long
as the caller can wait.

A key session's steps are idempotent (a read, a purge, a reply, a record's delete), so a step whose
connection dropped, whose reply was lost, or that nobody answered (a replicated stream electing a
leader) is simply sent again: at once once the connection is back, or after a short, growing pause
when the server did not answer. How long it may go on is the caller's: a lease (nothing may be sent
for a key once it ends), or a deadline. :func:`ride_out` is that loop, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, TypeVar

from keyqueue.errors import (
    ConnectionFailed,
    Disconnected,
    JetStreamUnavailable,
    KeyqueueTimeout,
    ReplyLost,
)

__all__ = ["RETRIED", "RETRY_PAUSE", "Deadline", "Link", "Patience", "ride_out"]

T = TypeVar("T")

RETRY_PAUSE: Final = (0.02, 1.0)
"""First and longest pause, in seconds, before a NATS step that got no answer on a live connection
(a replicated stream electing a leader, say) is tried again."""

RETRIED: Final = (ConnectionFailed, KeyqueueTimeout, JetStreamUnavailable)
"""What a step is tried again after: the connection down or dropped (``Disconnected``, ``ReplyLost``),
no responders, no reply in time, JetStream temporarily unavailable (10008) or a stream's ingest
queue full (10167)."""


class Patience(Protocol):
    """How long a caller can wait: a :class:`~keyqueue.core.lease.Lease`, or a :class:`Deadline`."""

    def remaining(self) -> float: ...

    def check(self) -> None:
        """Raise once no time is left."""


class Link(Protocol):
    """The connection a step goes through, as far as waiting for it goes (``QueueIO`` is one)."""

    @property
    def closed(self) -> bool: ...

    async def wait_connected(self, timeout: float) -> bool: ...


class Deadline:
    """Patience until a moment on the monotonic clock; :meth:`check` raises ``KeyqueueTimeout``."""

    __slots__ = ("at", "what")

    def __init__(self, seconds: float, what: str) -> None:
        self.at = time.monotonic() + seconds
        self.what = what

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self) -> None:
        if self.remaining() <= 0:
            raise KeyqueueTimeout(f"{self.what}: gave up after the connection stayed down or unanswered")


async def ride_out(step: Callable[[], Awaitable[T]], patience: Patience, link: Link) -> T:
    """Run ``step``, and again after a lost connection, a lost reply or no answer, for as long as
    ``patience`` allows; then what its ``check`` raises. A connection closed for good ends it at once
    (with the step's error): it never comes back."""
    pause, longest = RETRY_PAUSE
    while True:
        try:
            return await step()
        except RETRIED as e:
            patience.check()
            if link.closed:
                raise
            if not await link.wait_connected(max(0.0, patience.remaining())):
                patience.check()  # the time ran out while the connection was down
                raise  # (a link that gives up sooner than asked: the step's own error)
            if not isinstance(e, Disconnected | ReplyLost):  # connected, yet no answer: not at once
                await asyncio.sleep(min(pause, max(0.0, patience.remaining())))
                pause = min(longest, pause * 2)
            patience.check()
