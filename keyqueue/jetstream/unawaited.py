"""Lease records' deletes sent without waiting for their answers, and sent again when none comes.

A key given back on one server removes its lease record with a delete nobody waits for
(``QueueIO.forget_record``): the next holder must not find the record, but nothing the session
does next depends on when the delete is carried out. nats-server carries out a request without a
reply subject all the same, with one exception: its JetStream API queue. Once
``request_queue_limit`` requests (10,000 by default) wait in it, the server drops every request
waiting and answers none (``jetstream_api.go``; ``tests/integration/test_unawaited_deletes.py``
shows it with a limit of 100, where 1,798 of 3,000 deletes sent in a burst were lost). A delete
dropped so would leave the record until its TTL (the lease, 30 s by default), and the key's next
request waiting as long while its key is free.

So each delete carries a reply subject on one shared subscription, and its answer is looked for,
not awaited: the answers are handled as they are read (no future, no task, no timer each), and a
delete not answered within :data:`ANSWER_WITHIN` seconds is sent again, then after twice as long
each time (at most :data:`LONGEST_PATIENCE`: a server whose queue is full must not get every late
delete again each second), until it is answered or until the record has expired by itself. A
delete is by sequence, so one sent again late removes nothing else: a record written since, by
anyone, has another sequence.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.jetstream.api import MESSAGE_GONE
from keyqueue.jetstream.fastpub import publish_plain
from keyqueue.jetstream.mux import SyncDispatch

__all__ = ["ANSWER_WITHIN", "UnawaitedDeletes"]

log = logging.getLogger("keyqueue.session")

ANSWER_WITHIN: Final = 1.0
"""Seconds a delete has for its answer before it is sent again (then twice as long each time)."""

LONGEST_PATIENCE: Final = 8.0
"""The longest a delete sent again waits for its answer before it is sent once more."""

_DONE: Final = b'"success":true'
"""What the answer of a delete that was carried out holds."""

_STREAM_GONE: Final = 10059
"""The lease stream is gone, and its records with it."""


class UnawaitedDeletes:
    """The deletes of lease records by sequence on one stream (see the module docstring)."""

    def __init__(self, nc: Client, subject: str) -> None:
        """``subject``: the stream's ``$JS.API.STREAM.MSG.DELETE.<stream>``."""
        self.nc = nc
        self.subject = subject
        self.sent_again = 0
        """Deletes sent again because no answer came in time (a lost one, or a slow server)."""
        self._prefix: str | None = None
        self._sub: Any = None
        self._subscribing = asyncio.Lock()
        self._waiting: dict[int, tuple[float, float, float]] = {}
        """Sequence -> (when to send its delete again, when to give up, how long it waited last)."""
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    @property
    def waiting(self) -> int:
        """Deletes sent and not answered yet."""
        return len(self._waiting)

    async def send(self, seq: int, ttl: float) -> None:
        """Delete record ``seq`` (which expires by itself ``ttl`` seconds after its last write)."""
        if self._prefix is None:
            await self._listen()
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._waiting[seq] = (now + ANSWER_WITHIN, now + 2 * ttl, ANSWER_WITHIN)
        await self._publish(seq)
        timer = self._timer
        if timer is None or timer.when() > now + ANSWER_WITHIN:  # (one armed for a delete sent again)
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(now + ANSWER_WITHIN, self._look)

    async def close(self) -> None:
        """Stop looking for answers (the connection is going)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting.clear()
        sub, self._sub, self._prefix = self._sub, None, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def _publish(self, seq: int) -> None:
        await publish_plain(self.nc, self.subject, b'{"seq":%d,"no_erase":true}' % seq, f"{self._prefix}{seq}")

    async def _listen(self) -> None:
        async with self._subscribing:
            if self._prefix is None:
                prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(prefix + "*", cb=_never_called)
                SyncDispatch.install(self._sub, self._answered)
                self._prefix = prefix

    def _answered(self, msg: Msg) -> None:
        prefix = self._prefix
        if prefix is None or not msg.subject.startswith(prefix):
            return
        try:
            seq = int(msg.subject[len(prefix):])
        except ValueError:
            return
        if seq in self._waiting and _carried_out(msg.data):
            del self._waiting[seq]

    def _look(self) -> None:
        """Send again every delete whose answer is late; give up on those whose record has expired."""
        self._timer = None
        if self.nc.is_closed:
            self._waiting.clear()
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        connected = self.nc.is_connected
        again: list[int] = []
        for seq, (due, give_up, patience) in list(self._waiting.items()):
            if due > now:
                continue
            if give_up <= now:
                del self._waiting[seq]
            elif connected:
                patience = min(LONGEST_PATIENCE, 2 * patience)
                self._waiting[seq] = (now + patience, give_up, patience)
                again.append(seq)
            else:  # sent again once connected
                self._waiting[seq] = (now + ANSWER_WITHIN, give_up, patience)
        if again:
            self.sent_again += len(again)
            log.debug("%d lease record deletes on %s got no answer in time: sent again", len(again), self.subject)
            task = loop.create_task(self._send_again(again))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        if self._waiting:
            self._timer = loop.call_at(min(due for due, _, _ in self._waiting.values()), self._look)

    async def _send_again(self, seqs: list[int]) -> None:
        try:
            for seq in seqs:
                await self._publish(seq)
        except Exception as e:  # not sent: still waiting, so the next look sends it again
            log.debug("sending lease record deletes on %s again failed: %r", self.subject, e)


def _carried_out(data: bytes) -> bool:
    """Whether a delete's answer says the record is gone (removed now, or before, or with its stream)."""
    if _DONE in data:
        return True
    try:
        error = json.loads(data).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and (error.get("err_code") in MESSAGE_GONE or error.get("err_code") == _STREAM_GONE)


async def _never_called(msg: Msg) -> None:
    """nats-py wants a coroutine callback; :class:`SyncDispatch` hands every message to the handler."""
