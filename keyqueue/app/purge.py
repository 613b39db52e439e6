"""Removing pending requests: ``keyqueue purge QUEUE [--key K] [--task T]`` and ``App.purge``.

Celery's ``purge`` drops the messages waiting in a queue; here the waiting requests are each key's
backlog in the queue's inbox stream. Without a filter the whole inbox is purged (one call); with
``key`` that key's subject (one call); with ``task`` the backlog is read and the requests of that
task are deleted one by one (by sequence), so the others keep their places and their order.

What a purge does not take back: a request a key's holder has already started, or read ahead of
its current one, may still run (the holder's later removal of it is harmless); delayed requests
that are not due yet wait in the schedules stream (cancel them by id). A purge never touches the
key's token or lease: a holder that finds its backlog gone releases the key as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames, validate_key, validate_queue_name
from keyqueue.wire import headers as H

__all__ = ["PurgeFilter", "count_pending", "purge_pending"]


@dataclass(frozen=True)
class PurgeFilter:
    """Which pending requests of a queue: all, one key's, one task's, or one task's on one key."""

    queue: str
    key: str | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        validate_queue_name(self.queue)
        if self.key is not None:
            validate_key(self.key)

    @property
    def subject(self) -> str:
        names = QueueNames(self.queue)
        return names.inbox(self.key) if self.key is not None else names.inbox_prefix + ">"

    def describe(self) -> str:
        parts = [f"key {self.key}" if self.key is not None else "", f"task {self.task}" if self.task else ""]
        shown = ", ".join(p for p in parts if p)
        return f" ({shown})" if shown else ""


async def _matching(api: JetStreamApi, which: PurgeFilter) -> list[int]:
    """The inbox sequences of the task's requests, oldest first."""
    names = QueueNames(which.queue)
    found: list[int] = []
    seq = 1
    while (msg := await api.get_msg(names.inbox_stream, seq=seq, next_by_subject=which.subject,
                                    direct=False)) is not None:
        if msg.headers.get(H.MESSAGE_TYPE) == which.task:
            found.append(msg.seq)
        seq = msg.seq + 1
    return found


async def count_pending(api: JetStreamApi, which: PurgeFilter) -> int:
    """How many pending requests ``which`` takes (``StreamNotFound`` for a queue that does not exist)."""
    names = QueueNames(which.queue)
    if which.task:
        return len(await _matching(api, which))
    if which.key is not None:
        return sum((await api.subjects(names.inbox_stream, which.subject)).values())
    return int((await api.stream_info(names.inbox_stream))["state"]["messages"])


async def purge_pending(api: JetStreamApi, which: PurgeFilter) -> int:
    """Remove the pending requests ``which`` takes; how many were removed."""
    names = QueueNames(which.queue)
    if not which.task:
        return await api.purge(names.inbox_stream, subject=which.subject if which.key is not None else None)
    removed = 0
    for seq in await _matching(api, which):
        removed += await api.delete_msg(names.inbox_stream, seq)
    return removed
