"""The acks of many released tokens confirmed by one reply: what releasing sessions send first.

A session that gives its key back acks its token and waits until the token is gone (so that a
token a producer publishes next is stored, not refused by ours: docs/architecture.md, "Giving a key
back"). Asked per key, that is one double ack and one reply per key. On one server a consumer's
acks are handled in the order they arrive, and the token is removed before an ack's reply is sent
(shared/DESIGN.md section 9, checked 1,000 times out of 1,000 with 200 tokens; and
tests/integration/test_release.py): so when sessions release in the same turn of the event loop,
every ack but the last goes as a plain ``+ACK`` and the last one as a double ack on the same
connection; its reply says that every token of the batch is gone. A replicated stream answers an
ack before it removes the token, so it does not use this (``QueueIO.release_token``).

There is no task of its own: the first session to ask in a turn of the loop waits for that turn
to end and sends the batch on behalf of everyone who asked meanwhile; a failure (or its
cancellation) is every one's answer, and each session tries again as its release does (an ack
sent again is harmless).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from keyqueue.errors import ReplyLost

__all__ = ["AckBarrier"]

Send = Callable[[str], Awaitable[None]]
"""Publish a plain ``+ACK`` to an ack subject (no reply asked)."""
Ask = Callable[[str, float], Awaitable[None]]
"""Send a double ack to an ack subject and wait, at most the given seconds, for its reply."""


class AckBarrier:
    """Acks tokens in batches: plain acks, then one double ack whose reply confirms them all."""

    def __init__(self, send: Send, ask: Ask) -> None:
        self._send = send
        self._ask = ask
        self._asked: list[tuple[str, asyncio.Future[None]]] = []

    async def ack(self, reply_subject: str, timeout: float) -> None:
        """Ack the token delivered with ``reply_subject``; returns once it is gone (one server)."""
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._asked.append((reply_subject, answer))
        if len(self._asked) == 1:
            await self._send_for_everyone(timeout)
        await answer

    async def _send_for_everyone(self, timeout: float) -> None:
        batch: list[tuple[str, asyncio.Future[None]]] = []
        try:
            await asyncio.sleep(0)  # the rest of this turn: the other sessions releasing now ask too
            batch, self._asked = self._asked, []
            *plain, (last, _) = batch
            for subject, _ in plain:
                await self._send(subject)
            await self._ask(last, timeout)
            for _, answer in batch:
                if not answer.done():
                    answer.set_result(None)
        except BaseException as e:
            if not batch:  # cut off before it sent anything: everyone who asked asks again
                batch, self._asked = self._asked, []
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(e if isinstance(e, Exception) else ReplyLost("the ack was cut off"))
                    answer.exception()  # retrieved: the session that asked sees it from its await
            if not isinstance(e, Exception):
                raise
