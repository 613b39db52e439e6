"""Dead-lettering a key's request, and counting the sessions that died on it.

A request that will not run again (rejected, not retried, out of attempts, or at the head of a
crash loop) is copied to the queue's dead-letter stream with headers saying why, then removed
from the inbox, then its caller (if it waits for a reply) is told. The copy is stored once however
often it is sent (its id is the request's inbox sequence) and the delete is safe to repeat: both
are tried again after a lost connection, within the lease. The processor's writes owed for the
requests handled before it (kept results) are confirmed before it leaves the inbox.

A *head run* is a session of a redelivered token that started on a request: a worker that keeps
dying (or losing its lease) on the same request would otherwise take the key down with it for ever.
Each such session counts one on the request (a compare-and-set record beside the lease records);
a session that hands the key back with the request in hand (a drain, a failure) takes its count
back: it did not die on it.
"""

from __future__ import annotations

import functools
import json
import logging
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Final

from keyqueue.core.key_io import KeyIO
from keyqueue.core.lease import Lease
from keyqueue.core.observer import DeadLetterReason
from keyqueue.core.removals import Removals
from keyqueue.errors import InvalidSubject, KeyqueueError
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.subjects import validate_subject
from keyqueue.wire import headers as H

log = logging.getLogger("keyqueue.session")

TRACEBACK_KEPT: Final = 8000
"""Characters of a dead request's traceback kept in its DLQ copy (the end, where the error is)."""


class DeadLettering:
    """Moves one key's requests to its dead-letter queue, and keeps its crash-loop counts."""

    __slots__ = ("_lease", "_steady", "io", "key", "removals")

    def __init__(self, io: KeyIO, key: str, removals: Removals, *, lease: Callable[[], Lease],
                 steady: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> None:
        self.io = io
        self.key = key
        self.removals = removals
        self._lease = lease
        self._steady = steady

    async def move(self, msg: StoredMsg, error: BaseException, attempts: int, reason: DeadLetterReason) -> None:
        """Copy ``msg`` to the DLQ saying why, remove it from the inbox, and answer its caller."""
        self._lease().check()
        why = dead_letter_reasons(error, reason, attempts, msg.subject, msg.seq)
        await self._steady(functools.partial(self.io.dead_letter, self.key, msg, why))
        await self.removals.settle_owed()
        self._lease().check()
        await self._steady(functools.partial(self.io.delete, msg.seq))
        inbox = msg.headers.get(H.REPLY_INBOX)
        if inbox and answerable(inbox):
            self._lease().check()
            answer = {H.STATUS: "dead-lettered", H.REQUEST_ID: msg.headers.get(H.MSG_ID, ""),
                      H.ERROR_TYPE: type(error).__name__, H.ERROR_MESSAGE: H.header_safe(str(error)),
                      H.DLQ_REASON: reason}
            await self._steady(functools.partial(self.io.reply, inbox, answer, b""))

    async def add_head_runs(self, seq: int, delta: int) -> tuple[int, int]:
        """Add ``delta`` to the crash-loop count of request ``seq`` (a count of another request
        starts over); the new counts of sessions and of attempts a loop watchdog stopped. A counter
        is a heuristic: a failure never blocks the key."""
        try:
            return await self.io.add_head_runs(self.key, seq, runs=delta)
        except (KeyqueueError, ValueError) as e:
            log.debug("crash-loop counter for %s: %r", self.key, e)
            return max(1, delta), 0


def dead_letter_reasons(error: BaseException, reason: DeadLetterReason, attempts: int, subject: str,
                        seq: int) -> dict[str, str]:
    """The ``X-KQ-DLQ-*`` headers of the copy of the request stored at ``seq`` on ``subject``: why
    it is dead, after how many attempts, when, and (but for a rejection) the last traceback. The
    key session's and the unkeyed lane's (``keyqueue.core.unkeyed``) dead letters say it alike."""
    why = {
        H.DLQ_REASON: reason,
        H.DLQ_ERROR_TYPE: type(error).__name__,
        H.ERROR_MESSAGE: H.header_safe(str(error)),
        H.DLQ_ATTEMPTS: str(attempts),
        H.DLQ_ORIGINAL_SUBJECT: subject,
        H.DLQ_ORIGINAL_SEQ: str(seq),
        H.DLQ_TIME: datetime.now(UTC).isoformat(),
    }
    if reason != DeadLetterReason.REJECTED:  # a rejection is expected input: its traceback says nothing
        why[H.DLQ_TRACEBACK] = traceback_header(error)
    return why


def answerable(inbox: str) -> bool:
    """Whether a reply may be published to ``inbox``: one NATS cannot carry is never answered (the
    server would close the connection)."""
    try:
        validate_subject(inbox, "a reply inbox")
    except InvalidSubject:
        return False
    return True


def traceback_header(error: BaseException) -> str:
    text = "".join(traceback.format_exception(error))
    if len(text) > TRACEBACK_KEPT:
        text = "...\n" + text[-TRACEBACK_KEPT:]
    return json.dumps(text)
