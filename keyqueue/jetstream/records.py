"""Per-request records of a queue: kept results and cancel requests, found by request id alone.

One stream per queue ``Q``, ``KQ_Q_RECORDS``, holds at most one message per subject:

- ``kq.Q.result.<id>``: for a task that keeps results, first a *pending* record written by the
  producer once the request is stored (``X-KQ-Status: pending``, only where the subject is still
  empty, kept for :data:`CANCEL_TTL`), so that a request is found by its id alone; then a
  finished request's reply (its ``X-KQ-Status`` headers and body), written
  by the worker that ran it when its task keeps results, with a per-message TTL (``Nats-TTL``) of
  the task's ``result_ttl``. When that TTL passes the server replaces it with a *subject delete
  marker* (a message without ``X-KQ-Status``) that lives for :data:`EXPIRED_MARKER_TTL`, so a
  reader can tell "expired" from "not there yet".
- ``kq.Q.result.<id>.progress``: the last progress the request's task reported
  (``ctx.progress``), written by the worker running it, coalesced to about one write a second
  (``keyqueue.app.progress``), with a TTL of a day (or the task's ``result_ttl`` if longer). Under
  the results' wildcard, so it needs no subject, permission or reader of its own.
- ``kq.Q.cancel.<id>``: a cancel request and its answer (``X-KQ-Cancel``: ``requested``, then
  ``cancelled``, ``running`` or ``done`` from the worker that holds the request's key), kept for
  :data:`CANCEL_TTL`; ``withdrawn`` when the canceller found no such request (the id stays usable).
- ``kq.Q.runs.<task>.<key>``: the start times of a rate-limited task's recent runs on a key (a JSON
  list of Unix seconds), written by the key's holder by compare-and-set before each run, kept for
  the limit's period.

``<id>`` is :func:`~keyqueue.jetstream.subjects.request_id_token` of the request id. The stream
is created by whoever first needs it (a writer or a reader), like the other streams of a queue.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import JetStreamError, StreamNotFound, TopologyMismatch, WrongLastSequence
from keyqueue.jetstream.api import JetStreamApi, StoredMsg, parse_pub_ack, wait_stored
from keyqueue.jetstream.kv import EXPECTED_LAST_SUBJECT_SEQUENCE
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.subjects import request_id_token, validate_queue_name
from keyqueue.jetstream.topology import NS
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["ASK", "ASK_CANCEL", "ASK_STATUS", "CANCEL_STATE", "CANCEL_TTL", "EXPIRED_MARKER_TTL", "IDLE", "PENDING",
           "RequestRecords"]

ASK: Final = "X-KQ-Ask"
"""Header of a question to the workers (``ask_workers``): ``status`` or ``cancel``. A question
without it (an older asker) is answered only by the worker running the request."""
ASK_STATUS: Final = "status"
ASK_CANCEL: Final = "cancel"
IDLE: Final = "idle"
"""A worker's answer to a question about a request it does not run."""

CAS_TRIES: Final = 10
"""Tries of a compare-and-set on a record that others write too, reading again after each lost race."""

EXPIRED_MARKER_TTL: Final = 24 * 3600
"""Seconds the server keeps the marker it leaves where a kept result expired ("expired", not "missing")."""

CANCEL_TTL: Final = 7 * 24 * 3600
"""Seconds a cancel record is kept: longer than any request should wait for its key."""

CANCEL_STATE: Final = "X-KQ-Cancel"
"""Header of a cancel record: ``requested``, ``cancelled``, ``running``, ``done`` or ``withdrawn``."""

PENDING: Final = "pending"
"""``X-KQ-Status`` of the record a producer writes for a stored request whose task keeps results."""

WITHDRAWN_TTL: Final = 3600
"""Seconds a withdrawn cancel record is kept (workers that missed it reload the records)."""

TTL: Final = "Nats-TTL"
"""Publish header: this message's time to live (nats-server >= 2.11, at least one second)."""


class RequestRecords:
    """The records stream of one queue on one connection: ``ensure`` once, then read and write."""

    def __init__(self, nc: Client, queue: str, *, replicas: int = 1) -> None:
        self.nc = nc
        self.queue = validate_queue_name(queue)
        self.replicas = replicas
        self.api = JetStreamApi(nc)
        self.stream = f"KQ_{queue}_RECORDS"
        self._mux: RequestMux | None = None
        """Results in flight (:meth:`send_result`), made on first use."""

    def result_subject(self, request_id: str) -> str:
        return f"kq.{self.queue}.result.{request_id_token(request_id)}"

    def progress_subject(self, request_id: str) -> str:
        """Where the request's last progress is kept: beside its result, under the results' wildcard."""
        return f"{self.result_subject(request_id)}.progress"

    def cancel_subject(self, request_id: str) -> str:
        return f"kq.{self.queue}.cancel.{request_id_token(request_id)}"

    @property
    def cancel_wildcard(self) -> str:
        return f"kq.{self.queue}.cancel.>"

    def ask_subject(self, request_id: str) -> str:
        """Where a status question about a request goes: the worker running it answers (core NATS, not stored)."""
        return f"kq.{self.queue}.ask.{request_id_token(request_id)}"

    @property
    def ask_wildcard(self) -> str:
        return f"kq.{self.queue}.ask.>"

    async def ask_workers(self, request_id: str, wait: float, count: Callable[[], Awaitable[int]], *,
                          cancel: bool = False) -> str | None:
        """What the live workers say of ``request_id``: ``running`` (one runs it), for a cancel also
        ``done`` / ``cancelled`` (one finished or skipped it), else None (none runs it).

        Every worker answers (``idle`` when it does not run it), so the question ends as soon as
        the answer is known: at the first answer other than ``idle``, once as many workers said
        ``idle`` as ``count()`` says are live (read while the question is out; a count that fails
        or says 0 is no count), at once when no worker listens (the server's no-responders
        status), else after ``wait`` seconds (a worker counted live that died, one of a version
        that answers only when it runs the request, no count). ``cancel``: the question is a
        cancel's, so each worker first treats the request as cancelled (it will not start it).
        """
        answers: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_answer(msg: Msg) -> None:
            answers.put_nowait(msg)

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_answer)
        counting: asyncio.Future[int] | None = None
        getting: asyncio.Future[Msg] | None = None
        try:
            await self.nc.publish(self.ask_subject(request_id), b"", reply=inbox,
                                  headers={H.REQUEST_ID: request_id, ASK: ASK_CANCEL if cancel else ASK_STATUS})
            counting = asyncio.ensure_future(count())
            expected, idle = 0, 0
            async with asyncio.timeout(wait):
                while True:
                    if counting is not None and counting.done():
                        expected = counting.result() if counting.exception() is None else 0
                        counting = None
                    if expected and idle >= expected:
                        return None
                    getting = getting or asyncio.ensure_future(answers.get())
                    await asyncio.wait([f for f in (getting, counting) if f is not None],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if not getting.done():
                        continue  # the count came first
                    msg, getting = getting.result(), None
                    if (msg.headers or {}).get("Status") == "503":
                        return None  # no worker listens
                    answer = msg.data.decode(errors="replace")
                    if answer != IDLE:
                        return answer
                    idle += 1
        except TimeoutError:
            return None
        finally:
            for future in (counting, getting):
                if future is not None:
                    future.cancel()
            await asyncio.gather(*(f for f in (counting, getting) if f is not None), return_exceptions=True)
            await sub.unsubscribe()

    def config(self) -> dict[str, Any]:
        return {
            "name": self.stream,
            "subjects": [f"kq.{self.queue}.result.>", self.cancel_wildcard, f"kq.{self.queue}.runs.>"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_msgs_per_subject": 1,
            "discard": "old",
            "allow_msg_ttl": True,
            "subject_delete_marker_ttl": EXPIRED_MARKER_TTL * NS,
            "allow_direct": self.replicas == 1,
        }

    async def ensure(self) -> None:
        """Create the stream if it is missing, else check what its readers rely on."""
        wanted = self.config()
        existing = await self.api.stream_or_create(wanted)
        for field in ("subjects", "max_msgs_per_subject", "allow_msg_ttl"):
            if existing.get(field) != wanted[field]:
                raise TopologyMismatch(f"stream {self.stream}", field, existing.get(field), wanted[field],
                                       f"delete it (nats stream rm {self.stream}); it holds only results and cancels")

    async def _publish(self, subject: str, headers: Mapping[str, str], body: bytes, ttl: float,
                       expected_last: int | None = None) -> int:
        sent = {**headers, TTL: f"{max(1, math.ceil(ttl))}s"}
        if expected_last is not None:
            sent[EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last)
        return parse_pub_ack(await self.api._request(subject, body, None, sent)).seq

    async def _last(self, subject: str) -> StoredMsg | None:
        return await self.api.get_msg(self.stream, last_by_subject=subject, direct=self.replicas == 1)

    # --- results ---

    async def put_result(self, request_id: str, headers: Mapping[str, str], body: bytes, ttl: float) -> int:
        """Keep a finished request's reply for ``ttl`` seconds (rounded up to whole seconds)."""
        return await self._publish(self.result_subject(request_id), headers, body, ttl)

    async def send_result(self, request_id: str, headers: Mapping[str, str], body: bytes,
                          ttl: float) -> asyncio.Future[list[Msg]]:
        """:meth:`put_result` sent now, its reply not awaited: many results are in flight on one reply
        subscription (no inbox or timer each). :meth:`stored` reads the reply. Raises as a publish
        that could not be sent does (``Disconnected``)."""
        if self._mux is None:
            self._mux = RequestMux(self.nc)
        sent = {**headers, TTL: f"{max(1, math.ceil(ttl))}s"}
        return await self._mux.send(self.result_subject(request_id), body, headers=sent)

    async def close(self) -> None:
        """Forget the results still in flight (their writers see them fail) and the reply subscription."""
        mux, self._mux = self._mux, None
        if mux is not None:
            await mux.close()

    async def stored(self, sent: asyncio.Future[list[Msg]]) -> int:
        """The sequence a :meth:`send_result` was stored at, once the server says so (``ReplyLost``,
        ``KeyqueueTimeout``, a ``JetStreamError`` otherwise)."""
        [reply] = await wait(sent, self.api.timeout, f"a result in {self.stream}")
        return parse_pub_ack(reply).seq

    async def put_pending(self, request_id: str, ttl: float = CANCEL_TTL) -> None:
        """Say that ``request_id`` is stored and not finished, unless its subject holds something
        already (its result, written by a fast worker, must not be overwritten)."""
        try:
            await self._publish(self.result_subject(request_id), {H.STATUS: PENDING, H.REQUEST_ID: request_id}, b"",
                                ttl, expected_last=0)
        except WrongLastSequence:
            pass

    async def get_result(self, request_id: str) -> StoredMsg | None:
        """The kept reply, the marker of an expired one (no ``X-KQ-Status``), a producer's pending
        record (``X-KQ-Status: pending``), or None."""
        return await self._last(self.result_subject(request_id))

    async def wait_result(self, request_id: str, timeout: float) -> tuple[dict[str, str], bytes] | None:
        """The kept reply (or an expiry marker's empty headers), waiting up to ``timeout`` seconds; None
        if none came. It is read back from the stream (:func:`~keyqueue.jetstream.api.wait_stored`),
        so once it is returned every reader, ``status`` too, finds it."""
        stored = await wait_stored(self.nc, self.result_subject(request_id), self._last,
                                   lambda msg: msg.headers.get(H.STATUS) != PENDING, timeout)
        return (stored.headers, stored.data) if stored is not None else None

    # --- progress ---

    async def put_progress(self, request_id: str, headers: Mapping[str, str], body: bytes, ttl: float) -> int:
        """Keep ``body`` as the request's last progress for ``ttl`` seconds (it replaces the one before)."""
        return await self._publish(self.progress_subject(request_id), headers, body, ttl)

    async def get_progress(self, request_id: str) -> StoredMsg | None:
        """The request's last kept progress (or the server's marker where it expired), or None."""
        return await self._last(self.progress_subject(request_id))

    # --- rate limits ---

    def runs_subject(self, task: str, key: str) -> str:
        return f"kq.{self.queue}.runs.{request_id_token(task)}.{key}"

    async def get_runs(self, task: str, key: str) -> tuple[list[float], int]:
        """The recent run start times of ``task`` on ``key`` and the record's sequence (0: none)."""
        stored = await self._last(self.runs_subject(task, key))
        if stored is None or not stored.data:
            return [], stored.seq if stored is not None else 0
        return [float(t) for t in json.loads(stored.data)], stored.seq

    async def put_runs(self, task: str, key: str, starts: list[float], expected_last: int, ttl: float) -> int:
        """Store the run start times over the record read at ``expected_last`` (``WrongLastSequence`` if it changed)."""
        return await self._publish(self.runs_subject(task, key), {}, json.dumps(starts).encode(), ttl,
                                   expected_last=expected_last)

    # --- cancels ---

    async def request_cancel(self, request_id: str) -> tuple[str, int]:
        """Record a cancel request unless one exists: ``(state, seq)`` of the record now stored.

        Another write may come first (another canceller, or the holder answering); on a replicated
        stream it may still be in flight when ours is refused (10164): read again after a pause."""
        subject = self.cancel_subject(request_id)
        pause = 0.01
        for _ in range(CAS_TRIES):
            existing = await self._last(subject)
            if existing is not None and existing.headers.get(CANCEL_STATE):
                return existing.headers[CANCEL_STATE], existing.seq
            try:
                seq = await self._publish(subject, {CANCEL_STATE: "requested", H.REQUEST_ID: request_id}, b"",
                                          CANCEL_TTL, expected_last=existing.seq if existing is not None else 0)
            except WrongLastSequence:
                await asyncio.sleep(pause)
                pause = min(0.5, pause * 2)
                continue
            return "requested", seq
        raise JetStreamError(f"the cancel record of request {request_id} kept changing while it was being written")

    async def answer_cancel(self, request_id: str, state: str, expected_last: int) -> int:
        """The holder's answer to a cancel request, written only over the record it read
        (``WrongLastSequence`` if it changed since)."""
        return await self._publish(self.cancel_subject(request_id), {CANCEL_STATE: state, H.REQUEST_ID: request_id},
                                   b"", CANCEL_TTL, expected_last=expected_last)

    async def withdraw_cancel(self, request_id: str, expected_last: int) -> None:
        """Take back a ``requested`` cancel record (read at ``expected_last``) whose request does not
        exist, so the id stays usable; workers that loaded it forget it (``WrongLastSequence`` if it
        was answered meanwhile)."""
        await self._publish(self.cancel_subject(request_id), {CANCEL_STATE: "withdrawn", H.REQUEST_ID: request_id},
                            b"", WITHDRAWN_TTL, expected_last=expected_last)

    async def cancel_state(self, request_id: str) -> tuple[str, int] | None:
        """``(state, seq)`` of the request's cancel record, or None."""
        stored = await self._last(self.cancel_subject(request_id))
        if stored is None or not stored.headers.get(CANCEL_STATE):
            return None
        return stored.headers[CANCEL_STATE], stored.seq

    async def pending_cancels(self) -> set[str]:
        """Request ids whose cancel record says ``requested`` or ``cancelled``: they must not start.

        Read a page of records per round trip (batched direct gets; one read per record only where
        the stream allows no direct gets): the stream keeps one message per subject, so every
        message on the cancel subjects is a record's current state."""
        found: set[str] = set()
        try:
            async for page in self.api.pages(self.stream, self.cancel_wildcard):
                found.update(stored.headers.get(H.REQUEST_ID, "") for stored in page
                             if stored.headers.get(CANCEL_STATE) in ("requested", "cancelled"))
        except StreamNotFound:
            return set()
        found.discard("")
        return found

