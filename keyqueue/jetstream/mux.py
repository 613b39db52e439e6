"""Many requests in flight on one reply subscription, without a timer per request.

nats-py's ``request`` wraps every call in ``asyncio.wait_for``; on the hot path (a delete per
processed request, a batched read per key) keyqueue sends through this mux instead and awaits
the futures with one deadline. Replies that end with a status line (a batched direct get ends
with ``204 EOB``) are gathered until that line.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import ConnectionFailed, KeyqueueTimeout

STATUS = "Status"


class _Pending:
    __slots__ = ("future", "msgs", "multi")

    def __init__(self, future: asyncio.Future[list[Msg]], multi: bool) -> None:
        self.future = future
        self.msgs: list[Msg] = []
        self.multi = multi


class RequestMux:
    """Sends requests with unique reply subjects under one wildcard subscription."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub: Any = None
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def _ensure(self) -> None:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    self._prefix = self.nc.new_inbox() + "."
                    self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        pending = self._pending.get(msg.subject)
        if pending is None or pending.future.done():
            return
        status = (msg.headers or {}).get(STATUS)
        if pending.multi and not status:
            pending.msgs.append(msg)
            return
        pending.msgs.append(msg)
        del self._pending[msg.subject]
        pending.future.set_result(pending.msgs)

    async def send(self, subject: str, payload: bytes, *, multi: bool = False,
                   headers: Mapping[str, str] | None = None) -> asyncio.Future[list[Msg]]:
        """Publish now; the future resolves with the reply (or, with ``multi``, every reply up to a status)."""
        await self._ensure()
        reply = f"{self._prefix}{next(self._ids)}"
        future: asyncio.Future[list[Msg]] = asyncio.get_running_loop().create_future()
        self._pending[reply] = _Pending(future, multi)
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=dict(headers) if headers else None)
        except Exception as e:
            self._pending.pop(reply, None)
            raise ConnectionFailed(f"cannot publish to {subject}: {e}") from e
        future.add_done_callback(lambda _: self._pending.pop(reply, None))
        return future

    async def request(self, subject: str, payload: bytes, *, timeout: float, multi: bool = False) -> list[Msg]:
        future = await self.send(subject, payload, multi=multi)
        return await wait(future, timeout, subject)

    async def close(self) -> None:
        if self._sub is not None:
            for pending in self._pending.values():
                pending.future.cancel()
            self._pending.clear()
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None


async def wait(future: asyncio.Future[list[Msg]], timeout: float, what: str) -> list[Msg]:
    """Await a mux future with a deadline; a timeout cancels it."""
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError as e:
        raise KeyqueueTimeout(f"no reply to {what} within {timeout}s") from e
