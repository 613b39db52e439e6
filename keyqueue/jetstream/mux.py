"""Many requests in flight on one reply subscription, without a timer per request.

nats-py's ``request`` wraps every call in ``asyncio.wait_for``; on the hot path (a delete per
processed request, a batched read per key) keyqueue sends through this mux instead and awaits
the futures with one deadline. Replies that end with a status line (a batched direct get ends
with ``204 EOB``) are gathered until that line.

A request nobody waits for any more (its caller gave up, or never awaited the future) must not
be remembered for ever: every request expires ``expire_after`` seconds after it was sent, its
future failing with :class:`~keyqueue.errors.KeyqueueTimeout`. Requests expire in the order they
were sent, so one timer, armed for the oldest, is enough.

When the connection drops (a connection opened by ``keyqueue.jetstream.connect``), every request
still awaiting its reply fails at once with :class:`~keyqueue.errors.ReplyLost`: its reply will
never come, and its sender may retry once reconnected instead of waiting out a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import ConnectionFailed, KeyqueueTimeout, ReplyLost
from keyqueue.jetstream.connect import CONNECTION_DOWN, link_of, not_sent
from keyqueue.jetstream.fastpub import header_block, publish_block, publish_plain

log = logging.getLogger("keyqueue.connection")

STATUS = "Status"


class SyncDispatch:
    """Stands in for a nats-py subscription's message queue so that each message is handed to
    ``handle`` at once, from the connection's read loop: no queue entry, no task wake-up and no
    coroutine per message (nats-py would put each one on an ``asyncio.Queue`` that a task of the
    subscription drains, awaiting its callback for each). ``handle`` must not block or raise.

    It relies on what nats-py 2.x does with a subscription (``Client._process_msg``: adds the size
    to ``sub._pending_size``, then ``sub._pending_queue.put_nowait(msg)``; the subscription's task
    awaits ``_pending_queue.get()``; ``unsubscribe`` asks ``empty()``, ``drain`` awaits ``join()``):
    tests/integration/test_sync_dispatch.py pins it, so an upgrade that changes it fails loudly."""

    __slots__ = ("handle", "sub")

    def __init__(self, sub: Any, handle: Callable[[Msg], None]) -> None:
        self.sub = sub
        self.handle = handle

    @classmethod
    def install(cls, sub: Any, handle: Callable[[Msg], None]) -> None:
        sub._pending_queue = cls(sub, handle)

    def put_nowait(self, msg: Msg) -> None:
        self.sub._pending_size -= len(msg.data)  # handled now: nothing of it is pending
        try:
            self.handle(msg)
        except Exception:  # a bug: it must not reach nats-py's read loop (the connection would end)
            log.exception("a reply on %s could not be handled", msg.subject)

    async def get(self) -> Msg:
        await asyncio.get_running_loop().create_future()  # never: every message went to handle
        raise AssertionError("unreachable")

    def empty(self) -> bool:
        return True

    def qsize(self) -> int:
        return 0

    def task_done(self) -> None:
        return None

    async def join(self) -> None:
        return None

EXPIRE_AFTER: Final = 60.0
"""Seconds after which a request with no reply is forgotten (longer than any caller waits)."""


class _Pending:
    __slots__ = ("deadline", "future", "msgs", "multi", "subject")

    def __init__(self, future: asyncio.Future[list[Msg]], multi: bool, subject: str, deadline: float) -> None:
        self.future = future
        self.msgs: list[Msg] = []
        self.multi = multi
        self.subject = subject
        self.deadline = deadline


class RequestMux:
    """Sends requests with unique reply subjects under one wildcard subscription."""

    def __init__(self, nc: Client, *, expire_after: float = EXPIRE_AFTER) -> None:
        self.nc = nc
        self.expire_after = expire_after
        self._prefix = ""
        self._sub: Any = None
        self._pending: dict[str, _Pending] = {}
        """By reply subject, in the order sent (so also in deadline order)."""
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._unlisten: Any = None

    @property
    def in_flight(self) -> int:
        """Requests sent whose reply has not arrived and that nobody gave up on (none expired)."""
        return sum(not pending.future.done() for pending in self._pending.values())

    async def _ensure(self) -> None:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    self._prefix = self.nc.new_inbox() + "."
                    self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_reply_async)
                    SyncDispatch.install(self._sub, self._on_reply)
                    link = link_of(self.nc)
                    if link is not None:
                        self._unlisten = link.on_down(self._dropped)

    def _dropped(self) -> None:
        """The connection dropped: no request sent before has a reply coming."""
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(ReplyLost(
                    f"the connection to NATS dropped before the reply to a request to {entry.subject} came"))
                entry.future.exception()  # retrieved: a future nobody awaits must not log it

    async def _on_reply_async(self, msg: Msg) -> None:
        self._on_reply(msg)  # never called while SyncDispatch stands in (nats-py wants a coroutine callback)

    def _on_reply(self, msg: Msg) -> None:
        pending = self._pending.get(msg.subject)
        if pending is None:
            return
        if pending.future.done():  # given up on (a shorter deadline, a cancel): forgotten now
            del self._pending[msg.subject]
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
        try:
            await self._ensure()
        except CONNECTION_DOWN as e:
            raise not_sent(e, f"a request to {subject}") from e
        reply = f"{self._prefix}{next(self._ids)}"
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Msg]] = loop.create_future()
        self._pending[reply] = _Pending(future, multi, subject, loop.time() + self.expire_after)
        block = header_block(headers) if headers else None
        try:
            if block is not None:
                assert headers is not None
                await publish_block(self.nc, subject, payload, block, headers, reply=reply)
            elif not headers:
                await publish_plain(self.nc, subject, payload, reply)
            else:
                await self.nc.publish(subject, payload, reply=reply, headers=dict(headers))
        except CONNECTION_DOWN as e:
            self._pending.pop(reply, None)
            raise not_sent(e, f"a request to {subject}") from e
        except Exception as e:
            self._pending.pop(reply, None)
            raise ConnectionFailed(f"cannot publish to {subject}: {e}") from e
        # No done callback per request (it would cost a loop callback each): a reply, the expiry
        # and a dropped connection remove the entry; one whose future ended otherwise (its waiter's
        # shorter deadline, or a cancel) is removed when its reply comes or it expires.
        if self._timer is None:
            self._arm()
        return future

    def _arm(self) -> None:
        """Schedule the expiry of the oldest request, if any."""
        oldest = next(iter(self._pending.values()), None)
        if oldest is not None:
            self._timer = asyncio.get_running_loop().call_at(oldest.deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        while self._pending:
            reply, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                break
            del self._pending[reply]
            if not pending.future.done():
                pending.future.set_exception(KeyqueueTimeout(
                    f"no reply to a request to {pending.subject} within {self.expire_after}s"))
                pending.future.exception()  # retrieved: a future nobody awaits must not log it
        self._arm()

    async def request(self, subject: str, payload: bytes, *, timeout: float, multi: bool = False) -> list[Msg]:
        future = await self.send(subject, payload, multi=multi)
        return await wait(future, timeout, subject)

    async def close(self) -> None:
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
    """Await a mux future with a deadline; at the deadline the future fails with
    :class:`~keyqueue.errors.KeyqueueTimeout` (so the mux forgets the request), and so does this.

    One timer handle per wait, and none for a reply already in: the session awaits several replies
    per key, and ``asyncio.timeout`` (a context object, the current task, a reschedule) cost several
    times as much. A cancel of the waiting task cancels the future, as awaiting it directly does.
    (Not ``wait_for``: on Python 3.11 ``wait_for`` drops a cancel that arrives as the future completes,
    and the task it was meant to stop runs on.)"""
    if future.done():
        return future.result()
    timer = asyncio.get_running_loop().call_later(timeout, _time_out, future, timeout, what)
    try:
        return await future
    finally:
        timer.cancel()


def _time_out(future: asyncio.Future[list[Msg]], timeout: float, what: str) -> None:
    if not future.done():
        future.set_exception(KeyqueueTimeout(f"no reply to {what} within {timeout}s"))
