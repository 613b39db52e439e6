"""Re-checks of many keys' inboxes in one round trip: what a releasing session asks last.

A session that gave its key back asks whether a request was stored after its last read (the
quiescence race: docs/architecture.md, "Quiescence and release"). Asked per key, that is one read
per key; asked by many sessions in the same turn of the event loop (a worker releasing cold keys
releases dozens at once), it is one batched direct get of the last message of each of their inbox
subjects (``multi_last``). A request remains at or after the session's cursor exactly when the
subject's last message is at or after it (:func:`remains`): everything before the cursor was read
and removed by the session, and sequences only grow.

There is no task of its own: the first session to ask in a turn of the loop waits for that turn
to end, sends the batch on behalf of everyone who asked meanwhile, and answers them all; a failure
(or its cancellation) is every one's answer, and each session tries again as its re-check does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from keyqueue.errors import ReplyLost

__all__ = ["BATCH_KEYS", "InboxRechecks", "remains"]

BATCH_KEYS: Final = 256
"""Keys one batched read asks about at most (a larger turn sends several, pipelined)."""

LastSequences = Callable[[list[str]], Awaitable[Mapping[str, int]]]
"""Keys -> the inbox sequence of each one's last stored request (keys with none left out)."""


def remains(last_seq: int | None, cursor: int) -> bool:
    """Whether a key whose last stored request is at ``last_seq`` (None: it has none) holds one at or
    after ``cursor``."""
    return last_seq is not None and last_seq >= cursor


class InboxRechecks:
    """Answers "does a request remain at or after the cursor?" for many keys with one read per turn."""

    def __init__(self, last_sequences: LastSequences, *, batch_keys: int = BATCH_KEYS) -> None:
        self._last_sequences = last_sequences
        self._batch_keys = batch_keys
        self._asked: list[tuple[str, int, asyncio.Future[bool]]] = []

    async def remains(self, key: str, cursor: int) -> bool:
        """Whether ``key``'s inbox holds a request at or after ``cursor``; raises as the read does."""
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._asked.append((key, cursor, answer))
        if len(self._asked) == 1:
            await self._send_for_everyone(answer)
        return await answer

    async def _send_for_everyone(self, own: asyncio.Future[bool]) -> None:
        batch: list[tuple[str, int, asyncio.Future[bool]]] = []
        try:
            await asyncio.sleep(0)  # the rest of this turn: the other sessions releasing now ask too
            batch, self._asked = self._asked, []
            keys = list(dict.fromkeys(key for key, _, _ in batch))
            chunks = [keys[i:i + self._batch_keys] for i in range(0, len(keys), self._batch_keys)]
            found: dict[str, int] = {}
            for last in await asyncio.gather(*(self._last_sequences(chunk) for chunk in chunks)):
                found.update(last)
            for key, cursor, answer in batch:
                if not answer.done():
                    answer.set_result(remains(found.get(key), cursor))
        except BaseException as e:
            if not batch:  # cut off before it sent anything: everyone who asked asks again
                batch, self._asked = self._asked, []
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(e if isinstance(e, Exception) else ReplyLost("the re-check was cut off"))
                    answer.exception()  # retrieved: the session that asked sees it from its await
            raise
