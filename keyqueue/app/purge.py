"""Removing pending requests: ``keyqueue purge QUEUE [--key K] [--task T]`` and ``App.purge``.

Celery's ``purge`` drops the messages waiting in a queue; here the waiting requests are each key's
backlog in the queue's inbox stream, and the unkeyed requests in its work stream. Without a filter
both are purged (one call each); with ``key`` that key's subject (one call; key ``~``: the work
stream); with ``task`` the backlog is read and the requests of that task are deleted one by one
(by sequence), so the others keep their places and their order, and the task's subject of the
work stream is purged (one call).

What a purge does not take back: a request a key's holder has already started, or read ahead of
its current one, may still run (the holder's later removal of it is harmless), as may an unkeyed
request a worker was delivered already; delayed requests that are not due yet wait in the
schedules stream (cancel them by id). A purge never touches the key's token or lease: a holder
that finds its backlog gone releases the key as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import UNKEYED, QueueNames, validate_queue_name, validate_request_key
from keyqueue.wire import headers as H

__all__ = ["PurgeFilter", "count_pending", "purge_pending"]


@dataclass(frozen=True)
class PurgeFilter:
    """Which pending requests of a queue: all, one key's (``~``: the unkeyed ones), one task's, or
    one task's on one key."""

    queue: str
    key: str | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        validate_queue_name(self.queue)
        if self.key is not None:
            validate_request_key(self.key)

    @property
    def subject(self) -> str:
        """The inbox subject the filter's keyed requests are on."""
        names = QueueNames(self.queue)
        return names.inbox(self.key) if self.key is not None else names.inbox_prefix + ">"

    @property
    def keyed(self) -> bool:
        """Whether it takes requests from the inbox (not only unkeyed ones)."""
        return self.key != UNKEYED

    @property
    def unkeyed(self) -> bool:
        """Whether it takes requests from the work stream."""
        return self.key is None or self.key == UNKEYED

    @property
    def work_subject(self) -> str:
        """The work stream subject the filter's unkeyed requests are on."""
        names = QueueNames(self.queue)
        return names.work(self.task) if self.task else names.work_prefix + ">"

    def describe(self) -> str:
        key = "unkeyed" if self.key == UNKEYED else f"key {self.key}" if self.key is not None else ""
        parts = [key, f"task {self.task}" if self.task else ""]
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
    count = 0
    if which.keyed:
        if which.task:
            count += len(await _matching(api, which))
        elif which.key is not None:
            count += sum((await api.subjects(names.inbox_stream, which.subject)).values())
        else:
            count += int((await api.stream_info(names.inbox_stream))["state"]["messages"])
    if which.unkeyed:
        try:
            count += sum((await api.subjects(names.work_stream, which.work_subject)).values())
        except StreamNotFound:  # no unkeyed request was ever sent to the queue
            if which.key == UNKEYED:
                await api.stream_info(names.inbox_stream)  # StreamNotFound only if the queue itself is missing
    return count


async def purge_pending(api: JetStreamApi, which: PurgeFilter) -> int:
    """Remove the pending requests ``which`` takes; how many were removed."""
    names = QueueNames(which.queue)
    removed = 0
    if which.keyed:
        if not which.task:
            removed += await api.purge(names.inbox_stream, subject=which.subject if which.key is not None else None)
        else:
            for seq in await _matching(api, which):
                removed += await api.delete_msg(names.inbox_stream, seq)
    if which.unkeyed:
        try:
            removed += await api.purge(names.work_stream, subject=which.work_subject if which.task else None)
        except StreamNotFound:  # no unkeyed request was ever sent to the queue: none to remove
            pass
    return removed
