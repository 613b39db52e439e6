"""Deleting a queue: every stream that holds its subjects, for ``keyqueue delete-queue``.

A queue ``Q`` lives in the streams named ``KQ_Q_<PART>`` whose subjects are ``kq.Q.…``: the inbox,
tokens (with the workers' consumer), dead letters, leases (with the worker registry), records
(results, progress, cancels), schedules, events, and the dashboard's history and audit log. They
are found on the server rather than listed here, by both marks at once (a stream of another queue
``Q_x`` has the name prefix but not the subjects; a user's stream that captures ``kq.>`` has the
subjects but not the name), so one created by a later version is deleted too.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames, validate_queue_name

__all__ = ["QueueContents", "delete_queue", "queue_contents"]


@dataclass(frozen=True)
class QueueContents:
    """What deleting a queue removes: its streams, and what the main ones hold."""

    queue: str
    streams: list[str]
    requests: int
    """Requests stored in its inbox (pending, or running now)."""
    dead_letters: int


async def _queue_streams(api: JetStreamApi, queue: str) -> list[str]:
    prefix = f"KQ_{queue}_"
    found: list[str] = []
    offset = 0
    while True:
        page = await api.request("STREAM.NAMES", {"offset": offset, "subject": f"kq.{queue}.>"})
        names = page.get("streams") or []
        found += [n for n in names if n.startswith(prefix)]
        offset += len(names)
        if not names or offset >= int(page.get("total", 0)):
            return sorted(set(found))


async def _messages(api: JetStreamApi, stream: str) -> int:
    try:
        return int(((await api.stream_info(stream)).get("state") or {}).get("messages", 0))
    except StreamNotFound:
        return 0


async def queue_contents(api: JetStreamApi, queue: str) -> QueueContents:
    """The queue's streams and how many requests and dead letters they hold (no streams: none found)."""
    validate_queue_name(queue)
    streams = await _queue_streams(api, queue)
    names = QueueNames(queue)
    requests = await _messages(api, names.inbox_stream) if names.inbox_stream in streams else 0
    dead = await _messages(api, names.dlq_stream) if names.dlq_stream in streams else 0
    return QueueContents(queue, streams, requests, dead)


async def delete_queue(api: JetStreamApi, contents: QueueContents) -> list[str]:
    """Delete the streams of ``contents`` (as :func:`queue_contents` found them) and any the queue has
    gained since; the names deleted. A stream already gone is skipped."""
    deleted = []
    for stream in sorted(set(contents.streams) | set(await _queue_streams(api, contents.queue))):
        try:
            await api.delete_stream(stream)
        except StreamNotFound:
            continue
        deleted.append(stream)
    return deleted
