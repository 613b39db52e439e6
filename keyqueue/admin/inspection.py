"""What a queue holds right now: keys with backlog, keys held or scheduled, the consumer, the DLQ.

``keyqueue inspect`` prints this. A key's token is *held* when the consumer has delivered it
(a worker owns the key, or the token waits for redelivery after a lost lease) and *scheduled*
when it waits for a free worker. Who holds a key comes from its lease record
(``kq.<queue>.lease.<key>``, written by ``keyqueue.core.lock.KeyLock``): the worker's name, when
it acquired the key, and when it last renewed the record. The live workers, idle ones included,
come from their heartbeat records (``keyqueue.admin.workers``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["KEY_LIMIT", "Holder", "KeyState", "QueueReport", "inspect_queue", "list_queues", "parse_time"]

KEY_LIMIT: Final = 1000
"""Most keys a report lists (the counts cover every key)."""

TokenState = Literal["held", "scheduled", "none"]


@dataclass(frozen=True)
class Holder:
    """The worker holding a key, as its lease record says."""

    worker: str | None
    """The worker's name (``host:pid`` unless it was given one); None if the record has none."""
    since: datetime | None
    """When it acquired the key (the record's ``since``); None if the record does not say."""
    renewed: datetime | None
    """When the record was last written (the server's timestamp): the last renewal."""
    fence: int | None
    """The holder's fencing number (the sequence of the record that acquired the key)."""


@dataclass(frozen=True)
class KeyState:
    """One key: how many requests wait, where its token is, and who holds it."""

    key: str
    backlog: int
    token: TokenState
    holder: Holder | None = None
    """For a held key with a live lease record, its holder; else None (a held token without a
    record waits for redelivery, or its worker is acquiring the key right now)."""


@dataclass(frozen=True)
class QueueReport:
    """A snapshot of one queue."""

    queue: str
    keys: list[KeyState]
    """Keys with a backlog or a token, most backlog first (at most ``KEY_LIMIT``)."""
    requests: int
    """Requests stored in the inbox, all keys."""
    keys_with_backlog: int
    keys_held: int
    pending_tokens: int
    """Tokens no worker has taken yet (the consumer's ``num_pending``)."""
    dlq_size: int
    consumer: dict[str, Any]
    """The consumer's state: ack_pending, redelivered, waiting pulls, ack_wait, ..."""
    workers: dict[str, int]
    """Worker name -> how many of the listed keys it holds, most first."""

    @property
    def truncated(self) -> bool:
        return len(self.keys) >= KEY_LIMIT


async def list_queues(api: JetStreamApi) -> list[str]:
    """Every queue on the server (one per ``KQ_<queue>_INBOX`` stream), sorted."""
    queues: set[str] = set()
    offset = 0
    while True:
        page = await api.request("STREAM.NAMES", {"offset": offset, "subject": "kq.*.in.>"})
        names = page.get("streams") or []
        queues.update(n[len("KQ_"):-len("_INBOX")] for n in names if n.startswith("KQ_") and n.endswith("_INBOX"))
        offset += len(names)
        if not names or offset >= int(page.get("total", 0)):
            return sorted(queues)


async def inspect_queue(api: JetStreamApi, queue: str) -> QueueReport:
    """A snapshot of ``queue`` (``StreamNotFound`` if it was never created)."""
    names = QueueNames(queue)
    inbox = await api.stream_info(names.inbox_stream)
    subjects = await api.subjects(names.inbox_stream, names.inbox_prefix + ">")
    backlog = {names.key_of(s): n for s, n in subjects.items()}
    consumer = await api.consumer_info(names.token_stream, names.consumer)
    delivered_through = int((consumer.get("delivered") or {}).get("stream_seq", 0))
    tokens = await _token_seqs(api, names)
    try:
        dlq = int((await api.stream_info(names.dlq_stream))["state"].get("messages", 0))
    except StreamNotFound:
        dlq = 0
    listed = sorted(set(backlog) | set(tokens), key=lambda k: (-backlog.get(k, 0), k))[:KEY_LIMIT]
    held = [key for key in listed if key in tokens and tokens[key] <= delivered_through]
    holders = await _holders(api, names, held)
    states = []
    for key in listed:
        seq = tokens.get(key)
        token: TokenState = "none" if seq is None else "held" if seq <= delivered_through else "scheduled"
        states.append(KeyState(key, backlog.get(key, 0), token, holders.get(key)))
    workers = Counter(holder.worker for holder in holders.values() if holder.worker)
    config = consumer.get("config") or {}
    return QueueReport(
        queue=queue,
        keys=states,
        requests=int(inbox["state"].get("messages", 0)),
        keys_with_backlog=len(backlog),
        keys_held=sum(1 for seq in tokens.values() if seq <= delivered_through),
        pending_tokens=int(consumer.get("num_pending", 0)),
        dlq_size=dlq,
        consumer={
            "ack_pending": int(consumer.get("num_ack_pending", 0)),
            "redelivered": int(consumer.get("num_redelivered", 0)),
            "waiting_pulls": int(consumer.get("num_waiting", 0)),
            "ack_wait_s": int(config.get("ack_wait", 0)) / 1e9,
            "max_ack_pending": config.get("max_ack_pending"),
            "priority_policy": config.get("priority_policy", "none"),
            "pinned": ", ".join(f"{g.get('group')}={g['pinned_client_id']} since {g.get('pinned_ts', '?')}"
                                for g in consumer.get("priority_groups") or [] if g.get("pinned_client_id")),
        },
        workers=dict(workers.most_common()),
    )


async def _holders(api: JetStreamApi, names: QueueNames, keys: list[str]) -> dict[str, Holder]:
    """Key -> holder, from the lease records of ``keys`` (keys without a record are left out)."""

    async def record(key: str) -> StoredMsg | None:
        return await api.get_msg(names.lease_stream, last_by_subject=names.lease(key), direct=False)

    try:
        records = await asyncio.gather(*(record(key) for key in keys))
    except StreamNotFound:
        return {}
    return {key: _holder(msg) for key, msg in zip(keys, records, strict=True) if msg is not None}


def _holder(record: StoredMsg) -> Holder:
    """A lease record's holder: ``KeyLock`` writes the worker's fields (``worker``, ``token``,
    ``delivered``) and its own (``nonce``, ``fence``, ``since``, ``ttl``) as one JSON object."""
    try:
        body = json.loads(record.data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    worker, fence = body.get("worker"), body.get("fence")
    if fence == 0:
        fence = record.seq  # the record that acquired the key is written before its sequence is known
    return Holder(
        worker=worker if isinstance(worker, str) and worker else None,
        since=parse_time(body.get("since")),
        renewed=parse_time(record.timestamp),
        fence=fence if isinstance(fence, int) and fence > 0 else None,
    )


def parse_time(text: object) -> datetime | None:
    """An RFC 3339 time (JetStream's have nanoseconds, cut to micro here) in UTC; None if it is not one."""
    if not isinstance(text, str) or not text:
        return None
    stamp = text.replace("Z", "+00:00")
    if "." in stamp:
        whole, rest = stamp.split(".", 1)
        digits = len(rest) - len(rest.lstrip("0123456789"))
        stamp = f"{whole}.{rest[:min(digits, 6)]}{rest[digits:]}"
    try:
        parsed = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)


async def _token_seqs(api: JetStreamApi, names: QueueNames) -> dict[str, int]:
    """Key -> sequence of its token, walking the token stream in order (at most ``KEY_LIMIT``)."""
    found: dict[str, int] = {}
    seq = 1
    while len(found) < KEY_LIMIT:
        msg = await api.get_msg(names.token_stream, seq=seq, next_by_subject=names.token_prefix + ">", direct=False)
        if msg is None:
            break
        found[names.key_of(msg.subject)] = msg.seq
        seq = msg.seq + 1
    return found
