"""Progress messages of the keys whose page is open (what tasks publish with ``ctx.progress``).

Progress goes out as plain core NATS messages on ``kq.<queue>.progress.<key>`` (nothing stores
it), so the dashboard can only show what it received: a key's page subscribes to that key's
subject when it is first rendered and keeps the last ``KEPT`` messages; every render (each live
refresh of the page) keeps the subscription on, and one nobody rendered for ``IDLE`` seconds is
dropped. At most ``WATCHED`` keys are followed at once (the longest unviewed goes first), so
the dashboard never follows every key of a busy queue.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import KeyqueueError, WireError
from keyqueue.jetstream.subjects import QueueNames, validate_key
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["IDLE", "KEPT", "WATCHED", "ProgressFeed", "ProgressMessage"]

log = logging.getLogger("keyqueue.dashboard")

KEPT: Final = 20
"""Progress messages kept per followed key."""

IDLE: Final = 60.0
"""Seconds after its page's last render that a key's progress is no longer followed."""

WATCHED: Final = 100
"""Keys whose progress is followed at once."""


@dataclass(frozen=True)
class ProgressMessage:
    """One progress message as a key's page shows it."""

    ts: float
    """When the dashboard received it (Unix seconds)."""
    request_id: str | None
    text: str
    """The value as JSON."""


@dataclass
class _Followed:
    subscription: Any
    viewed: float
    messages: deque[ProgressMessage] = field(default_factory=lambda: deque(maxlen=KEPT))


class ProgressFeed:
    """Follows the progress subjects of the keys being looked at."""

    def __init__(self, nc: Client, *, idle: float = IDLE, limit: int = WATCHED) -> None:
        self.nc = nc
        self.idle = idle
        self.limit = limit
        self._followed: dict[tuple[str, str], _Followed] = {}

    async def watch(self, queue: str, key: str) -> list[ProgressMessage] | None:
        """The key's progress received so far, newest first, following it from now on if it was
        not yet; None if it cannot be followed now (a key with wildcards, the server away)."""
        now = time.monotonic()
        followed = self._followed.get((queue, key))
        if followed is None:
            try:
                subject = QueueNames(queue).progress(validate_key(key))
            except KeyqueueError:
                return None
            while len(self._followed) >= self.limit:
                oldest = min(self._followed, key=lambda k: self._followed[k].viewed)
                await self._drop(oldest)
            # Registered before the first await, so a render of the same page meanwhile finds it.
            followed = self._followed[(queue, key)] = _Followed(None, now)
            try:
                followed.subscription = await self.nc.subscribe(subject, cb=functools.partial(_received, followed))
                # The server has the subscription once the flush returns: progress published after
                # this render reaches the page.
                await self.nc.flush(timeout=5)
            except Exception as exc:  # the server away: the next render tries again
                log.debug("dashboard: following the progress of %s/%s failed: %r", queue, key, exc)
                await self._drop((queue, key))
                return None
        followed.viewed = now
        return list(reversed(followed.messages))

    def following(self, queue: str, key: str) -> bool:
        return (queue, key) in self._followed

    async def expire(self) -> None:
        """Stop following keys whose page nobody rendered for ``idle`` seconds."""
        cutoff = time.monotonic() - self.idle
        for stale in [k for k, f in self._followed.items() if f.viewed < cutoff]:
            await self._drop(stale)

    async def close(self) -> None:
        for followed in list(self._followed):
            await self._drop(followed)

    async def _drop(self, which: tuple[str, str]) -> None:
        followed = self._followed.pop(which, None)
        if followed is not None and followed.subscription is not None:
            with contextlib.suppress(Exception):
                await followed.subscription.unsubscribe()


async def _received(followed: _Followed, msg: Msg) -> None:
    headers = msg.headers or {}
    try:
        value: Any = loads(msg.data, headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
        text = json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)
    except WireError as exc:
        text = f"<undecodable: {exc}>"
    followed.messages.append(ProgressMessage(time.time(), headers.get(H.REQUEST_ID), text))
