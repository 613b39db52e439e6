"""What a queue holds right now: keys with backlog, keys held or scheduled, the consumer, the DLQ.

``keyqueue inspect`` prints this. A key's token is *held* when the consumer has delivered it
(a worker owns the key, or the token waits for redelivery after a lost lease) and *scheduled*
when it waits for a free worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["KEY_LIMIT", "KeyState", "QueueReport", "inspect_queue", "list_queues"]

KEY_LIMIT: Final = 1000
"""Most keys a report lists (the counts cover every key)."""

TokenState = Literal["held", "scheduled", "none"]


@dataclass(frozen=True)
class KeyState:
    """One key: how many requests wait, and where its token is."""

    key: str
    backlog: int
    token: TokenState


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
    states = []
    for key in sorted(set(backlog) | set(tokens), key=lambda k: (-backlog.get(k, 0), k))[:KEY_LIMIT]:
        seq = tokens.get(key)
        token: TokenState = "none" if seq is None else "held" if seq <= delivered_through else "scheduled"
        states.append(KeyState(key, backlog.get(key, 0), token))
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
    )


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
