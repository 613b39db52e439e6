"""Giving a key back: the last steps of a key session (docs/architecture.md, "Giving a key back").

A key with nothing left to do goes back with the token's ack, one release marker on its inbox
subject (which removes the requests handled and is refused exactly when one arrived), then its
lease record. Without markers, or when the marker is refused or its fate unknown, the slow way:
removals settled, the record removed, the token released, then the inbox read once more and the
key's token published again if a request remains. A session that failed or is drained settles its
removals and naks its token (after a short delay when it failed, so that a failure cannot spin).

Every step is tried again after a lost connection while the lease holds; past the lease nothing
more is sent for the key. A hand-back never raises: whatever fails, the record's TTL frees the key,
and a key whose token may be gone with a request left is handed to the worker to re-check
(``recheck_later``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from keyqueue.core.key_io import KeyIO
from keyqueue.core.lease import Lease
from keyqueue.core.lock import KeyLock
from keyqueue.core.observer import Outcome
from keyqueue.core.outage import Deadline, ride_out
from keyqueue.core.removals import Removals
from keyqueue.errors import LeaseLost
from keyqueue.jetstream.pull import Token

log = logging.getLogger("keyqueue.session")

FAILED_SESSION_DELAY: Final = 1.0
"""Seconds before a key whose session failed is delivered again (so a failure cannot spin)."""

HAND_BACK_TIMEOUT: Final = 5.0
"""Bound, in seconds, on each step of giving a key back (settling deletes, the ack)."""


class HandBack:
    """The give-back of one key session. It runs in the session's own task (:meth:`run`: no task,
    future or shield per key); the worker does not cancel a session giving its key back, and one
    cut off all the same gives it back again as a task of its own (:meth:`begin`), which runs to its
    end even when the session is cut off."""

    __slots__ = ("_cursor", "_forgive_head", "_forgiven", "_lease", "_marker", "_recheck_later", "_steady",
                 "_token", "_token_released", "ack_wait", "begun", "ended", "io", "key", "lock", "outcome",
                 "removals", "republished", "task")

    def __init__(self, io: KeyIO, key: str, lock: KeyLock, removals: Removals, *, lease: Callable[[], Lease],
                 token: Callable[[], Token], cursor: Callable[[], int], marker: Callable[[], int],
                 steady: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
                 forgive_head: Callable[[], Awaitable[None]],
                 recheck_later: Callable[[Token, int], None] | None, ack_wait: float) -> None:
        self.io = io
        self.key = key
        self.lock = lock
        self.removals = removals
        self._lease = lease
        self._token = token
        self._cursor = cursor
        self._marker = marker
        self._steady = steady
        self._forgive_head = forgive_head
        self._recheck_later = recheck_later
        self.ack_wait = ack_wait
        self.republished = False
        """Whether the give-back published the key's token again (a request remained)."""
        self.begun = False
        """Whether the give-back has begun (in the session's task, or as a task of its own)."""
        self.ended = False
        """Whether the give-back run in the session's task (:meth:`run`) reached its end."""
        self.outcome: Outcome | None = None
        """The session's outcome the key is given back after."""
        self.task: asyncio.Future[None] | None = None
        """The give-back as a task of its own (:meth:`begin`), which runs to its end even when the
        session is cut off; None while it runs in the session's task, or has not begun."""
        self._token_released = False
        self._forgiven = False

    async def run(self, outcome: Outcome) -> None:
        """Give the key back after a session that ended with ``outcome``, in the caller's task. A
        cancel that cuts it short leaves it unfinished (:attr:`ended` False): the session then
        gives the key back again with :meth:`begin`."""
        self.begun, self.outcome = True, outcome
        await self._give_back(outcome)
        self.ended = True

    def begin(self, outcome: Outcome) -> asyncio.Future[None]:
        """Give the key back as a task of its own, which a cancel of the session does not reach:
        after a session cut off before it gave its key back, or while it did (then from the start,
        each step being safe to take twice: the token's ack and the record's delete are
        idempotent; a release marker already stored refuses the second, which the slow way
        follows; the head request's crash count is forgiven once)."""
        self.begun, self.outcome = True, outcome
        self.task = asyncio.ensure_future(self._give_back(outcome))
        return self.task

    async def _give_back(self, outcome: Outcome) -> None:
        if not self._lease().valid():
            return  # another worker may own the key now: nothing more is sent for it
        if outcome == Outcome.RELEASED and self.io.release_markers:
            await self._quiet()
            return
        if outcome not in (Outcome.FAILED, Outcome.HANDED_OFF):
            await self._slow(token_gone=False)
            return
        if not await self._settled():
            return
        # The key may still have work that only its processor knows of (an owed DVU): the token goes
        # back as it is, for another worker at once (a drain) or after a short delay (a failure, so
        # that it cannot spin).
        if not self._forgiven:  # once: a give-back begun again must not count the head twice
            self._forgiven = True
            await self._forgive_head()
        delay = FAILED_SESSION_DELAY if outcome == Outcome.FAILED else 0.0
        await asyncio.gather(self._steady(self.lock.release),
                             self._steady(functools.partial(self.io.nak, self._token(), delay)),
                             return_exceptions=True)

    async def _settled(self) -> bool:
        """Settle the removals before the key is given back; False if the lease ended meanwhile
        (nothing more may be sent). An unconfirmed removal may land or not: a request not removed
        runs again (at least once)."""
        try:
            await self.removals.settle()
        except LeaseLost:
            return False
        except Exception as e:
            log.warning("queue %s key %s: %d delete(s) unconfirmed at release: %r", self.io.names.queue,
                        self.key, len(self.removals.deletes), e)
        return self._lease().valid()

    async def _quiet(self) -> None:
        """Give back a key with nothing left to do: the token removed, then one write, the key's
        release marker (:meth:`~keyqueue.jetstream.queue_io.QueueIO.mark_released`), which removes
        the requests handled and is refused exactly when a request arrived after the last one this
        session read; then the lease record. The marker replaces the purge and the re-check: a
        request stored before it makes it fail (then the key is re-checked and scheduled, the slow
        way), and one stored after it finds no token in the way of its own (ours is gone first).
        The lease record goes last: the next holder must not read the requests handled here."""
        if not self._token_released:  # (a give-back begun again after a cut-off may find it released)
            try:
                await self._steady(functools.partial(self.io.release_token, self._token(), HAND_BACK_TIMEOUT))
            except Exception as e:
                log.debug("queue %s key %s: releasing the token: %r", self.io.names.queue, self.key, e)
                await self._slow(token_gone=False)
                return
            self._token_released = True
        marked = False
        try:
            last = await self.removals.last_stored(self._marker())
            lease = self._lease()
            if lease.valid():
                marked = await self.io.mark_released(self.key, last, timeout=min(HAND_BACK_TIMEOUT, lease.remaining()))
        except Exception as e:  # the marker's fate unknown, or a removal unconfirmed: the slow way
            log.debug("queue %s key %s: release marker: %r", self.io.names.queue, self.key, e)
        if not marked:
            await self._slow(token_gone=True)
            return
        self.removals.covered_by_marker()
        try:
            # Its answer is not awaited where a lost delete is redone after the reconnect (one
            # server): the worker notes each key given back (QueueWorker._note_released).
            await self._steady(functools.partial(self.lock.release, unanswered=True))
        except Exception as e:  # the record's TTL frees the key
            log.debug("queue %s key %s: releasing the lease record: %r", self.io.names.queue, self.key, e)

    async def _slow(self, *, token_gone: bool) -> None:
        """The rest of a give-back without a release marker: removals settled, the lease record
        removed, the token released (unless gone already), then the inbox re-checked."""
        if not await self._settled():
            if token_gone:
                self.recheck_later()  # a request may have arrived with our token in its way
            return
        token_gone = token_gone or self._token_released
        steps = [self._steady(self.lock.release)]
        if not token_gone:
            steps.append(self._steady(functools.partial(self.io.release_token, self._token(), HAND_BACK_TIMEOUT)))
        results = await asyncio.gather(*steps, return_exceptions=True)
        if len(results) > 1 and not isinstance(results[1], BaseException):
            self._token_released = True
        for what, result in zip(("lease record", "token"), results, strict=False):
            if isinstance(result, BaseException):
                log.debug("queue %s key %s: releasing the %s: %r", self.io.names.queue, self.key, what, result)
        if len(results) > 1 and isinstance(results[1], BaseException):
            self.recheck_later()
            return
        await self.recheck()

    async def recheck(self) -> None:
        """A request stored after our last read had its token publish refused (ours still existed):
        look again now that our token is gone, and schedule the key if one remains. Harmless at any
        time (a token is a hint), so it is tried again after a lost connection, lease or not, and
        handed to the worker if the connection stays down."""
        try:
            await ride_out(self._recheck_once, Deadline(self.ack_wait, "the re-check"), self.io)
        except Exception as e:
            log.warning("queue %s key %s: re-check after release failed (%r); the worker re-checks the key once "
                        "connected", self.io.names.queue, self.key, e)
            self.recheck_later()

    async def _recheck_once(self) -> None:
        if await self.io.request_remains(self.key, self._cursor()):
            token = self._token()
            self.republished = await self.io.schedule(self.key)
            if not self.republished and self.io.replicated and await self.io.token_stored(token):
                # Refused by our own token: on R3 it was seen still stored (rarely, under load) after
                # release_token returned. Remove it again and publish the key's token.
                await self.io.delete_token(token)
                self.republished = await self.io.schedule(self.key)

    def recheck_later(self) -> None:
        """Hand the re-check to the worker (it removes the token for sure, then re-checks once connected)."""
        if self._recheck_later is not None:
            self._recheck_later(self._token(), self._cursor())
