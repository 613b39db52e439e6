"""A request's status by its id: what ``App.status``, ``receipt.status()`` and ``keyqueue status`` answer.

::

    unknown    keyqueue finds no trace of it (see below)
    pending    stored, not started
    scheduled  delayed (countdown / eta): waiting in the schedules stream for its due time
    running    a live worker runs it now
    done       finished (its result, if kept, is there; a superseded request counts as done)
    failed     dead-lettered (its error, if kept, is there)
    cancelled  cancelled before it started: it never runs
    expired    its kept result's result_ttl has passed, or it expired before it started (expires=)

Where each answer comes from, in this order:

1. The request's record in the queue's records stream (``keyqueue.jetstream.records``): the kept
   result says done / failed / cancelled / expired; the *pending* record a producer writes for a
   task that keeps results says the request is stored.
2. Its cancel record (``cancelled``, or ``requested``: it will not start).
3. Its schedule (``kq.Q.at.<id>``): scheduled.
4. A question to the live workers (``kq.Q.ask.<id>``, core NATS): the one running it answers
   ``running``, every other one ``idle``, so the answer is known as soon as every live worker (as
   the heartbeat records count them, ``keyqueue.app.heartbeat``) has answered, or at once when no
   worker listens; :data:`ASK_WAIT` bounds it (a worker listed live that died).
5. The inbox, when the caller knows where to look: the receipt's ``seq`` (still stored means
   pending, gone means done), or the request's ``key`` (its backlog is read for the id).

So a request of a task that keeps results (``result_ttl``) is told apart in every state from its
id alone. For a task that keeps none, a stored request that has not started is found only through
its receipt (``seq``) or its key: by the id alone it reads ``unknown`` (JetStream has no index by
message id, and writing one for every request would cost every producer a write).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from keyqueue.app.heartbeat import answering_workers
from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.records import PENDING
from keyqueue.jetstream.schedules import ScheduleNames
from keyqueue.jetstream.subjects import QueueNames, request_id_token
from keyqueue.tasks.arguments import CANCELLED_BY, EXPIRED_BY
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.jetstream.api import JetStreamApi
    from keyqueue.jetstream.records import RequestRecords
    from keyqueue.tasks.context import Progress

__all__ = ["ASK_WAIT", "STATUSES", "RequestStatus", "StatusReport", "in_backlog", "kept_status", "request_status"]

RequestStatus = Literal["unknown", "pending", "scheduled", "running", "done", "failed", "cancelled", "expired"]
"""What ``status`` says of a request (see the module docstring)."""


@dataclass(frozen=True)
class StatusReport:
    """What ``App.status(request_id, progress=True)`` answers: where the request is, and the last
    progress its task reported (``keyqueue.app.progress``), for a progress bar in one call."""

    status: RequestStatus
    progress: Progress | None
    """The last ``ctx.progress`` value kept for the request (with its task, attempt and time), or None."""


STATUSES: Final = ("unknown", "pending", "scheduled", "running", "done", "failed", "cancelled", "expired")

ASK_WAIT: Final = 0.25
"""Seconds the live workers have to answer whether they run a request. A bound, not a wait: the
question ends when every live worker has answered (``RequestRecords.ask_workers``)."""

_KEY_SCAN_LIMIT: Final = 10_000
"""Most requests of a key read while looking for an id."""


def kept_status(headers: dict[str, str]) -> RequestStatus | None:
    """The status a kept record says, or None for a producer's pending record."""
    status = headers.get(H.STATUS)
    if not status:
        return "expired"  # the server's marker where a kept result expired
    if status == PENDING:
        return None
    if status == H.STATUS_OK:
        return "done"
    if status == H.STATUS_SUPERSEDED:
        by = headers.get(H.SUPERSEDED_BY)
        return "cancelled" if by == CANCELLED_BY else "expired" if by == EXPIRED_BY else "done"
    return "failed"


async def request_status(records: RequestRecords, api: JetStreamApi, request_id: str, *, seq: int | None = None,
                         key: str | None = None, ask_wait: float = ASK_WAIT) -> RequestStatus:
    """The status of ``request_id`` in ``records.queue`` (see the module docstring)."""
    names = QueueNames(records.queue)
    direct = records.replicas == 1
    kept = await records.get_result(request_id)
    stored = kept is not None  # a pending record: the request is stored
    if kept is not None:
        final = kept_status(kept.headers)
        if final is not None:
            return final
    cancel = await records.cancel_state(request_id)
    if cancel is not None and cancel[0] == "cancelled":
        return "cancelled"
    schedules = ScheduleNames(records.queue)
    with contextlib.suppress(StreamNotFound):
        if await api.get_msg(schedules.stream, last_by_subject=schedules.at_prefix + request_id_token(request_id),
                             direct=False) is not None:
            return "cancelled" if cancel is not None and cancel[0] == "requested" else "scheduled"
    live = functools.partial(answering_workers, api, records.queue)
    if await records.ask_workers(request_id, ask_wait, live) == "running":
        return "running"
    if cancel is not None and cancel[0] == "running":
        return "done"  # it was running when the cancel came, and no worker runs it now
    if not stored and seq is not None:
        msg = await api.get_msg(names.inbox_stream, seq=seq, direct=direct)
        stored = msg is not None and msg.headers.get(H.MSG_ID) == request_id
        if not stored:
            return "done"  # it was stored at seq (a receipt says so) and is gone: it ran
    if not stored and key is not None:
        stored = await in_backlog(api, names, key, request_id, direct)
    if stored:
        return "cancelled" if cancel is not None and cancel[0] == "requested" else "pending"
    if cancel is not None and cancel[0] == "done":
        return "done"
    return "unknown"


async def in_backlog(api: JetStreamApi, names: QueueNames, key: str, request_id: str, direct: bool) -> bool:
    """Whether the key's backlog holds ``request_id`` (read one request at a time, oldest first)."""
    subject, seq = names.inbox(key), 1
    for _ in range(_KEY_SCAN_LIMIT):
        msg = await api.get_msg(names.inbox_stream, seq=seq, next_by_subject=subject, direct=direct)
        if msg is None:
            return False
        if msg.headers.get(H.MSG_ID) == request_id:
            return True
        seq = msg.seq + 1
    return False

