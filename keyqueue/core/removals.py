"""Removing a key's handled requests from its inbox: what a key session owes the stream.

A request handled is removed (so a later holder does not run it again) by a purge of the key's
subject up to it. Purges are coalesced and pipelined: the requests done one after another are
removed together, by one purge sent after :data:`PURGE_EVERY` of them, before the session waits for
a long while, or once a later request has run for :data:`PURGE_WINDOW` (so a slow request after
fast ones does not keep them stored); their replies are confirmed later, at most
:data:`MAX_UNCONFIRMED_DELETES` in flight. With release markers (docs/architecture.md, "Giving a
key back") the last requests done before the key is given back are left to the marker.

What a processor stores beside a request (a kept result) is confirmed before any removal of the
requests handled so far (``RequestContext.hold_removal``): the removal waits for those *owed*
confirmations. The key session (core/session.py) owns the read position; this object owns every
removal sent and what each waits for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from keyqueue.core.key_io import KeyIO
from keyqueue.core.lease import Lease
from keyqueue.core.outage import RETRIED

log = logging.getLogger("keyqueue.session")

MAX_UNCONFIRMED_DELETES: Final = 8
"""Deletes (and purges) in flight before the session waits for their confirmations."""

MAX_UNCONFIRMED_REQUESTS: Final = 24
"""Requests done whose removal is sent but not confirmed, before the session waits for the
confirmations. They are what runs again if the connection is lost without a word (its removals
never reach the server): a session reading ahead runs its next requests without any I/O, so
without this bound it ran :data:`MAX_UNCONFIRMED_DELETES` purges of :data:`PURGE_EVERY` requests,
64, on a connection already dead."""

PURGE_EVERY: Final = 8
"""Requests done one after another that one purge removes at most."""

PURGE_WINDOW: Final = 0.002
"""Seconds a later request may run before the requests done before it are purged."""

Steady = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""Runs an idempotent NATS step again after an outage, within the lease (``KeySession._steady``)."""


class PurgeWindows:
    """The purge windows of a worker's key sessions, on one loop timer, not one per session.

    A session opens its window when a request starts while requests done before it are still
    stored (:meth:`Removals.arm`). Every window lasts :data:`PURGE_WINDOW`, so windows end in the
    order they were opened and one timer, armed for the oldest, is enough: opening and closing one
    is a dict entry. (With a timer per session, a hundred busy keys pushed and popped about one
    timer per two requests on the loop's heap, nearly all of them to no purpose: a loop iteration
    of a hundred busy sessions outlasts the window, so it ended between two requests.)"""

    __slots__ = ("_open", "_timer", "window")

    def __init__(self, window: float = PURGE_WINDOW) -> None:
        self.window = window
        self._open: dict[Removals, float] = {}
        """The sessions' removals whose window is open, oldest first, with when it ends (loop time)."""
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, removals: object) -> bool:
        return removals in self._open

    def open(self, removals: Removals) -> None:
        """Open ``removals``' window (it is told :meth:`Removals.window_ended` when it ends) unless
        it is open."""
        if removals in self._open:
            return
        loop = asyncio.get_running_loop()
        self._open[removals] = ends = loop.time() + self.window
        if self._timer is None:
            self._timer = loop.call_at(ends, self._end_due)

    def close(self, removals: Removals) -> None:
        """Close ``removals``' window, if open, without telling it."""
        self._open.pop(removals, None)

    def _end_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._open:
            removals, ends = next(iter(self._open.items()))
            if ends > now:
                self._timer = loop.call_at(ends, self._end_due)
                return
            del self._open[removals]
            try:
                removals.window_ended()
            except Exception:  # a bug: the other windows still end
                log.exception("queue %s key %s: the purge window's end failed", removals.io.names.queue,
                              removals.key)


class Removals:
    """The removals of one key session: sent, coalesced, confirmed."""

    __slots__ = ("_beside", "_cursor", "_in_hand", "_lease", "_steady", "_windows", "deletes", "io", "key", "owed",
                 "purged_through", "unconfirmed", "unpurged")

    def __init__(self, io: KeyIO, key: str, *, lease: Callable[[], Lease], cursor: Callable[[], int],
                 in_hand: Callable[[], int], steady: Steady, windows: PurgeWindows | None = None) -> None:
        self.io = io
        self.key = key
        self._lease = lease
        self._cursor = cursor
        """The session's read position: every request below it is handled (or dead-lettered)."""
        self._in_hand = in_hand
        """The inbox sequence of the request being processed (0 between requests)."""
        self._steady = steady
        self.deletes: list[asyncio.Future[Any]] = []
        """Deletes (and purges) sent and not yet confirmed."""
        self.owed: list[Callable[[], Awaitable[None]]] = []
        """Confirmations of the processor's writes (kept results) that must settle before the requests
        handled so far are removed (``ctx.hold_removal``)."""
        self.unpurged = 0
        """Requests done and not yet removed: the next purge of the key's subject removes them."""
        self.purged_through = 0
        """The last inbox sequence a removal sent so far covers (confirmed or not)."""
        self.unconfirmed = 0
        """Requests covered by the removals sent and not known to be confirmed."""
        self._windows = windows if windows is not None else PurgeWindows()
        """The worker's purge windows (one timer for all its sessions)."""
        self._beside: asyncio.Future[None] | None = None
        """The purge sent at the end of the purge window while the session worked on (see :meth:`window_ended`)."""

    # --- as requests are handled -----------------------------------------------------------------

    def arm(self) -> None:
        """A request starts while requests done before it are still stored: purge them beside it if
        it runs for :data:`PURGE_WINDOW`."""
        if self.unpurged:
            self._windows.open(self)

    async def done_one(self, *, more_read: bool) -> None:
        """One request done (the one just below the cursor); ``more_read``: requests were read ahead."""
        self.unpurged += 1
        # With release markers, the last requests done before the key is given back are removed
        # by the marker (one write), not by a purge of their own.
        if self.unpurged >= PURGE_EVERY or (not more_read and not self.io.release_markers):
            await self.after_beside()
            await self.purge()
            if len(self.deletes) >= MAX_UNCONFIRMED_DELETES or self.unconfirmed >= MAX_UNCONFIRMED_REQUESTS:
                await self.settle()

    async def done_through(self, through: int) -> None:
        """Requests done up to ``through`` together (a batch): removed now, confirmed."""
        await self.after_beside()
        await self.settle_owed()
        await self._steady(functools.partial(self.io.purge_through, self.key, through))
        self.purged_through = max(self.purged_through, through)

    def hold(self, confirm: Callable[[], Awaitable[None]]) -> None:
        """Await ``confirm()`` before any removal of the requests handled so far."""
        self.owed.append(confirm)

    async def before_wait(self, linger: float, long_wait: float) -> None:
        """The session is about to wait for a request for ``linger`` seconds: requests done and left
        for a release marker are removed now if that may be long (more than ``long_wait``); the
        confirmed removals are forgotten (the read just before was answered after them)."""
        if self.unpurged and linger > long_wait:
            await self.purge()
        self.deletes = [d for d in self.deletes if not self.io.confirmed(d)]
        if not self.deletes:
            self.unconfirmed = 0

    # --- sending ---------------------------------------------------------------------------------

    async def purge(self) -> None:
        """Send the purge of the requests done and not yet removed (all stored below the cursor)."""
        self.close_window()
        done, self.unpurged = self.unpurged, 0  # requests done while the purge is sent count for the next
        if not done:
            return
        through = self._cursor() - 1
        try:
            await self.settle_owed()
            self.deletes.append(await self._steady(functools.partial(self.io.purge_soon, self.key, through)))
            self.purged_through = max(self.purged_through, through)
            self.unconfirmed += done
        except BaseException:
            self.unpurged += done  # still stored: the settle sends it again
            raise

    async def after_beside(self) -> None:
        """Wait for the purge sent beside the work, if one is in flight: it is still confirming the
        kept results of the requests it removes, and a later removal covers those requests too."""
        if self._beside is not None:
            await asyncio.shield(self._beside)

    async def settle_owed(self) -> None:
        """Await what the processor stores before its requests leave the inbox (kept results): sent
        beside the work, confirmed here, before the removal of every request handled so far."""
        if not self.owed:
            return
        # Those owed now cover every request handled so far (a processor holds the removal while it
        # handles the request); one held later, by the request in hand, waits for the next removal.
        owed, self.owed = self.owed, []
        while owed:
            await owed.pop(0)()  # a confirmation that raises (a lost lease) ends the session
        self._lease().check()

    def close_window(self) -> None:
        """Close the purge window (the requests it was for are being removed)."""
        self._windows.close(self)

    def window_ended(self) -> None:
        """A request has run for PURGE_WINDOW while requests done before it are still stored: send
        their purge beside it, if this worker still holds the key. (Ended between requests, it
        does nothing: the session goes on to its next removal, or opens it again.)"""
        if self.unpurged and self._in_hand() and self._beside is None and self._lease().valid():
            self._beside = asyncio.ensure_future(self._purge_beside())

    async def _purge_beside(self) -> None:
        try:
            await self.purge()
        except Exception as e:  # sent again by the settle, or the requests run again (at least once)
            log.debug("queue %s key %s: purge not sent: %r", self.io.names.queue, self.key, e)
        finally:
            self._beside = None

    # --- confirming ------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Send what is done and not yet removed, then wait until every removal is confirmed."""
        await self.after_beside()
        if self._lease().valid():
            await self.purge()
        else:
            self.close_window()
        deletes, self.deletes = self.deletes, []
        try:
            await self.io.settle(deletes)
        except RETRIED:
            # A removal's reply was lost with the connection, or is late: remove everything done
            # again, in one purge, once connected (a purge is safe to repeat).
            cursor = self._cursor()
            if cursor > 1:
                await self._steady(functools.partial(self.io.purge_through, self.key, cursor - 1))
                self.purged_through = max(self.purged_through, cursor - 1)
        self.unconfirmed = 0

    async def last_stored(self, marker_seq: int) -> int:
        """The inbox sequence of the last message on the key's subject, if no request arrived after
        those read (0: none), for the release marker's compare-and-set; ``marker_seq``: a former
        holder's marker read on the subject. Waits for the processor's owed writes first (the
        marker removes the requests they belong to)."""
        await self.after_beside()
        await self.settle_owed()
        self.close_window()
        cursor = self._cursor()
        if self.unpurged:
            return cursor - 1  # done and still stored: the last message (a marker lies before it)
        last_read = max(cursor - 1, marker_seq)
        if last_read and self.purged_through >= last_read:
            # Everything read is removed, or on its way: once confirmed, the subject holds nothing known.
            await self.settle()
            return 0
        return last_read

    def covered_by_marker(self) -> None:
        """The release marker removed every request handled: the purges still in flight do not matter."""
        for sent in self.deletes:
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.deletes = []
        self.unconfirmed = 0
        self.unpurged = 0
