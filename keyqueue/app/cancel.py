"""Cancelling a pending request: the canceller's side (``request_cancel``) and the workers' (``CancelWatch``).

The protocol (docs/decisions.md, "Cancelling a request"):

1. The canceller subscribes to the request's cancel subject, then writes a ``requested`` record
   there (``KQ_Q_RECORDS``, ``kq.Q.cancel.<id>``; created only if there is none).
2. Every worker of the queue follows the queue's cancel subjects (one subscription per worker and
   queue, loaded with the records already stored when it starts, and again after each reconnect:
   every request that starts after a reconnect waits for that one reload). It forgets an id once
   its request finished here or its record has expired, so a long-running worker's set stays the
   size of the cancels still to act on. The holder of the request's key
   checks, on the event loop and just before the request starts, whether it is cancelled: if so it
   never runs, the holder answers ``cancelled`` on the record, replies ``Cancelled`` to a waiting
   caller, and the session removes the request as it removes any finished one (so the key's
   order and exclusivity stay with the holder). A request that started first is not interrupted:
   the worker answers ``running`` (and ``ctx.cancel_requested`` turns true), or ``done`` if it
   finished lately.
3. A delayed request not yet due has its schedule removed by the canceller (it is in no key's
   order yet): ``cancelled``.
4. The canceller waits for that answer, and asks the live workers at once (``kq.Q.ask.<id>``,
   ``RequestRecords.ask_workers``): each takes the cancel in as if its record had arrived (the
   request never starts there) and answers ``running``, ``done``, ``cancelled`` (its holder skipped
   it) or ``idle``. Once every live worker (as the heartbeat records count them) said ``idle``, or
   none listens, or :data:`CANCEL_ANSWER_WAIT` has passed, the request is not running on any live
   worker: if the caller knows its inbox sequence (a receipt does) it looks there: still
   stored means ``pending`` (it will be removed before it starts), gone means ``done``. Without the
   sequence it looks for the request by id (``keyqueue.app.status``): the pending record a
   producer writes for a task that keeps results, a kept result, or the key's backlog when the
   caller names the key. Found nowhere, the answer is ``unknown`` and the cancel record is
   *withdrawn* (workers that loaded it forget it), so the id is not poisoned: a later enqueue with
   it runs.

Both checks run on one event loop, the registration of a starting request before the look-up of
its cancel, and the registration of a cancel before the look-up of a running request, so a
cancel that arrives just as its request starts is either seen by the start (``cancelled``) or
sees the start (``running``): never neither.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from keyqueue.app.heartbeat import answering_workers
from keyqueue.app.status import in_backlog, kept_status, stored_at
from keyqueue.errors import KeyqueueError, StreamNotFound, WrongLastSequence
from keyqueue.jetstream.records import ASK, ASK_CANCEL, ASK_STATUS, CANCEL_STATE, CANCEL_TTL, IDLE, RequestRecords
from keyqueue.jetstream.schedules import ScheduleNames
from keyqueue.jetstream.subjects import QueueNames, request_id_token
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from keyqueue.jetstream.api import JetStreamApi

__all__ = ["CANCEL_ANSWER_WAIT", "CancelState", "CancelWatch", "RunFlag", "request_cancel"]

log = logging.getLogger("keyqueue.cancel")

CancelState = Literal["cancelled", "pending", "running", "done", "unknown"]
"""What ``cancel`` found: ``cancelled`` (removed by its key's holder, it never ran), ``pending`` (it has
not started and never will: its key's holder removes it when it gets there), ``running`` (it had
started; not interrupted, ``ctx.cancel_requested`` is true), ``done`` (it had finished), ``unknown``
(no request with this id was found: nothing was cancelled, and the id stays usable)."""

CANCEL_ANSWER_WAIT: Final = 1.0
"""Seconds at most ``cancel`` waits for the workers' answers before looking at the inbox itself (a
bound: it looks as soon as every live worker has answered)."""

_CLOSE_WAIT: Final = 5.0
"""Seconds ``CancelWatch.close`` lets answers in flight finish."""

_RECENT: Final = 10_000
"""Finished request ids a worker remembers, to answer ``done`` to a late cancel."""


class RunFlag:
    """Whether a cancel was asked for a running request (``ctx.cancel_requested`` reads it)."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested


class CancelWatch:
    """One worker's view of a queue's cancel requests, and its answers to them.

    Owns one subscription and the answer writes in flight; ``close`` ends both.
    """

    def __init__(self, records: RequestRecords) -> None:
        self.records = records
        self.cancelled: dict[str, float] = {}
        """Request ids with a cancel record (``requested`` or ``cancelled``): they must never start.
        Each maps to the loop time by which its record has expired for sure (:data:`CANCEL_TTL`
        after this worker learned of it), in that order; ids past it are dropped, as are ids whose
        request finished here (see :meth:`is_cancelled`)."""
        self.running: dict[str, RunFlag] = {}
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.skipped: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Cancelled ids whose request this worker skipped (the last :data:`_RECENT`): refused
        again if the request is read again before its removal landed (a lease lost meanwhile)."""
        self._answers: set[asyncio.Task[None]] = set()
        self._sub: object | None = None
        self._asks: object | None = None
        self._loaded = -1
        """The connection's reconnect count when the loaded set was read (-1: never)."""
        self._reloading: asyncio.Task[None] | None = None
        self._changed: dict[str, bool] | None = None
        """While a reload is in flight: the ids the subscription added (True) or withdrew (False) meanwhile."""

    async def start(self) -> None:
        """Follow the queue's cancel subjects, then load the records stored so far (no gap between);
        answer status questions about the requests running here (``keyqueue.app.status``)."""
        self._sub = await self.records.nc.subscribe(self.records.cancel_wildcard, cb=self._on_record)
        self._asks = await self.records.nc.subscribe(self.records.ask_wildcard, cb=self._on_ask)
        await self.refresh()

    def stale(self) -> bool:
        """Whether the connection was lost since the records were read (:meth:`refresh` reads them again)."""
        return self._reconnect_count() != self._loaded

    async def refresh(self) -> None:
        """Load the stored records again if the connection was lost since they were read (records sent
        meanwhile never reached the subscription). Every caller waits for the one reload in flight,
        so no request starts on a set older than the last reconnect. Raises what the read raises
        (``ConnectionFailed``, ``KeyqueueTimeout``): the caller tries again within its lease."""
        while self.stale():
            if self._reloading is None:
                self._reloading = asyncio.get_running_loop().create_task(self._reload())
                self._reloading.add_done_callback(_retrieve)
            # Shielded: one caller's cancellation (its lease lost) must not cancel the others' reload.
            await asyncio.shield(self._reloading)

    async def _reload(self) -> None:
        """Replace the set with the stored records (records expired or withdrawn since drop out), keeping
        what the subscription says meanwhile (it is newer than the read)."""
        count = self._reconnect_count()
        self._changed = {}
        try:
            stored = await self.records.pending_cancels()
            changed = self._changed
            before, self.cancelled = self.cancelled, {}
            for request_id in stored:
                if request_id not in changed and request_id not in self.skipped:
                    self._add(request_id)
            self.cancelled.update((i, before[i]) for i, added in changed.items() if added and i in before)
            self._loaded = count
        finally:
            self._changed = None
            self._reloading = None

    def _reconnect_count(self) -> int:
        return int(self.records.nc.stats.get("reconnects", 0))

    def is_cancelled(self, request_id: str) -> bool:
        """Whether ``request_id`` must not start (a cancel record names it, or this worker skipped it)."""
        return request_id in self.cancelled or request_id in self.skipped

    def _add(self, request_id: str) -> None:
        """Remember a cancelled id (at the end: the latest deadline) and drop the ids whose record has expired."""
        now = asyncio.get_running_loop().time()
        self.cancelled.pop(request_id, None)
        self.cancelled[request_id] = now + CANCEL_TTL
        while True:
            oldest = next(iter(self.cancelled))
            if self.cancelled[oldest] > now:
                break
            del self.cancelled[oldest]

    async def close(self) -> None:
        if self._reloading is not None:
            self._reloading.cancel()
            await asyncio.gather(self._reloading, return_exceptions=True)
        for sub in (self._sub, self._asks):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()  # type: ignore[attr-defined]
        self._sub = self._asks = None
        # Let answers in flight land (each is one API call, bounded by its timeout): a canceller waits for them.
        if self._answers:
            await asyncio.wait(list(self._answers), timeout=_CLOSE_WAIT)
        for task in list(self._answers):
            task.cancel()
        await asyncio.gather(*self._answers, return_exceptions=True)

    # --- the holder's side ---

    def start_run(self, request_id: str) -> RunFlag | None:
        """Register ``request_id`` as starting; None if it is cancelled (then it must not run)."""
        flag = self.running[request_id] = RunFlag()
        if self.is_cancelled(request_id):
            del self.running[request_id]
            if self.cancelled.pop(request_id, None) is not None:
                _remember(self.skipped, request_id)
            return None
        return flag

    def end_run(self, request_id: str) -> None:
        flag = self.running.pop(request_id, None)
        if flag is not None:
            _remember(self.recent, request_id)
            if flag.requested:  # answered ``running``: no reload loads it again, the set need not keep it
                self.cancelled.pop(request_id, None)

    async def answer(self, request_id: str, state: str) -> None:
        """:meth:`write_answer`, its failure logged (the canceller then looks for the request itself)."""
        try:
            await self.write_answer(request_id, state)
        except KeyqueueError as exc:
            log.warning("could not answer the cancel of request %s (%s): %s", request_id, state, exc)

    async def write_answer(self, request_id: str, state: str) -> None:
        """Write ``state`` over a ``requested`` record of ``request_id`` (no record, or another answer:
        nothing). Idempotent; raises what the API raises (``ConnectionFailed``, ``KeyqueueTimeout``)."""
        try:
            current = await self.records.cancel_state(request_id)
            if current is not None and current[0] == "requested":
                await self.records.answer_cancel(request_id, state, current[1])
        except WrongLastSequence:
            pass  # answered meanwhile (another worker finished it, or it was cancelled there)

    # --- the subscription ---

    async def _on_ask(self, msg: Msg) -> None:
        """Answer a question about a request (``RequestRecords.ask_workers``): ``running`` if it runs
        here; to every other asker that says what it asks (``X-KQ-Ask``), ``idle`` too, so the asker
        need not wait for workers that have nothing to say. A cancel's question counts as its
        record: answered here, the request never starts here (both run on this event loop)."""
        headers = msg.headers or {}
        request_id = headers.get(H.REQUEST_ID)
        if not request_id or not msg.reply:
            return
        asked = headers.get(ASK)
        if asked == ASK_CANCEL:
            answer = self._cancel_asked(request_id)
        elif request_id in self.running:
            answer = "running"
        elif asked == ASK_STATUS:
            answer = IDLE
        else:
            return  # an older asker waits only for the worker running it
        with contextlib.suppress(Exception):
            await msg.respond(answer.encode())

    def _cancel_asked(self, request_id: str) -> str:
        """What this worker says to a cancel's question, having acted on it as on a ``requested`` record."""
        if request_id in self.skipped:
            return "cancelled"  # its key's holder here skipped it (its answer is on the record)
        flag = self.running.get(request_id)
        if flag is not None:
            if not flag.requested:
                flag.requested = True
                self._spawn(request_id, "running")
            return "running"
        if request_id in self.recent:
            return "done"  # finished here; the record's answer is written when its record arrives
        self._add(request_id)
        if self._changed is not None:
            self._changed[request_id] = True
        return IDLE

    async def _on_record(self, msg: Msg) -> None:
        headers = msg.headers or {}
        state = headers.get(CANCEL_STATE)
        request_id = headers.get(H.REQUEST_ID)
        if request_id and state == "withdrawn":  # the canceller found no such request: the id is usable again
            self.cancelled.pop(request_id, None)
            if self._changed is not None:
                self._changed[request_id] = False
            return
        if not request_id or state not in ("requested", "cancelled"):
            return
        if request_id in self.skipped:
            return  # refused here already (this is likely its own answer)
        if state == "requested" and request_id in self.recent and request_id not in self.running:
            self._spawn(request_id, "done")  # it finished here: nothing to refuse, the record is answered
            return
        self._add(request_id)
        if self._changed is not None:
            self._changed[request_id] = True
        if state != "requested":
            return
        flag = self.running.get(request_id)
        if flag is not None:
            flag.requested = True
            self._spawn(request_id, "running")

    def _spawn(self, request_id: str, state: str) -> None:
        task = asyncio.get_running_loop().create_task(self.answer(request_id, state))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)


def _remember(ids: collections.OrderedDict[str, None], request_id: str) -> None:
    """Add ``request_id`` to a bounded record of finished ids (the oldest beyond :data:`_RECENT` forgotten)."""
    ids[request_id] = None
    ids.move_to_end(request_id)
    if len(ids) > _RECENT:
        ids.popitem(last=False)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a reload's error as seen (its waiters got it; none may be left to)."""
    if not task.cancelled():
        task.exception()


async def _unschedule(api: JetStreamApi, queue: str, request_id: str) -> bool:
    """Remove a delayed request's schedule before it is due; False if it has none (not delayed, or due already).

    The canceller may remove it itself: a delayed request joins no key's order before it is due.
    Once the server has fired it, it is in the inbox (or on its way there), where the key's holder
    finds the cancel record.
    """
    names = ScheduleNames(queue)
    try:
        return await api.purge(names.stream, subject=names.at_prefix + request_id_token(request_id)) > 0
    except StreamNotFound:
        return False


async def request_cancel(records: RequestRecords, api: JetStreamApi, request_id: str, seq: int | None,
                         wait: float = CANCEL_ANSWER_WAIT, *, key: str | None = None) -> CancelState:
    """Ask for ``request_id`` to be cancelled and say what became of it (see the module docstring).

    ``seq`` is where it was stored (a receipt's ``seq``): in its key's inbox, or for an unkeyed
    request (``key`` ``~``) in the queue's work stream."""
    answered: asyncio.Future[CancelState] = asyncio.get_running_loop().create_future()

    async def on_answer(msg: Msg) -> None:
        state = (msg.headers or {}).get(CANCEL_STATE)
        if state in ("cancelled", "running", "done") and not answered.done():
            answered.set_result(state)  # type: ignore[arg-type]

    sub = await records.nc.subscribe(records.cancel_subject(request_id), cb=on_answer)
    try:
        state, seq_of_record = await records.request_cancel(request_id)
        if state in ("cancelled", "running", "done"):
            return state  # type: ignore[return-value]
        if await _unschedule(api, records.queue, request_id):
            with contextlib.suppress(WrongLastSequence):
                await records.answer_cancel(request_id, "cancelled", seq_of_record)
            return "cancelled"
        # The holder's answer on the record, or the live workers' answers to a question: whichever
        # comes first. When every live worker said it does not run the request, each has taken the
        # cancel in (it will not start it), so the look-up below answers without waiting out ``wait``.
        live = functools.partial(answering_workers, api, records.queue)
        asked = asyncio.ensure_future(records.ask_workers(request_id, wait, live, cancel=True))
        first: list[asyncio.Future[Any]] = [answered, asked]
        try:
            await asyncio.wait(first, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asked.cancel()
            said = (await asyncio.gather(asked, return_exceptions=True))[0]
        if answered.done():
            return answered.result()
        if said in ("cancelled", "running", "done"):
            return cast("CancelState", said)
        if seq is not None:
            stored = await stored_at(api, QueueNames(records.queue), seq, request_id, records.replicas == 1, key)
            return "pending" if stored else "done"
        kept = await records.get_result(request_id)
        if kept is not None:
            final = kept_status(kept.headers)
            if final is None:
                return "pending"  # a producer's pending record: stored, not started (the holder skips it)
            found: CancelState = "cancelled" if final == "cancelled" else "done"
        elif key is not None and await in_backlog(api, QueueNames(records.queue), key, request_id,
                                                  records.replicas == 1):
            return "pending"
        else:
            found = "unknown"
        # Nothing will start under this id that needs the record: withdraw it, so the id is not poisoned.
        try:
            await records.withdraw_cancel(request_id, seq_of_record)
        except WrongLastSequence:
            now = await records.cancel_state(request_id)  # a worker answered meanwhile
            if now is not None and now[0] in ("cancelled", "running", "done"):
                return now[0]  # type: ignore[return-value]
        return found
    finally:
        await sub.unsubscribe()
