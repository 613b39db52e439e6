"""What a queue holds right now: keys with backlog, keys held or waiting, the consumer, the DLQ.

``keyqueue inspect`` prints this and the dashboard's keys page lists it. A key's token is *held*
when the consumer has delivered it (a worker owns the key, or the token waits for redelivery
after a lost lease) and *scheduled* when it waits for a free worker. Who holds a key comes from
its lease record (``kq.<queue>.lease.<key>``, written by ``keyqueue.core.lock.KeyLock``): the
worker's name, when it acquired the key, when it last renewed the record, its fencing number and
the record's TTL. The live workers, idle ones included, come from their heartbeat records
(``keyqueue.admin.workers``).

**Every key, cheaply.** A queue may have 100,000 keys. The report costs a fixed number of reads
whatever their number: the subjects of the token and inbox streams (one paged request each: which
keys have a token, how many requests each key has), the consumer's state (its delivered sequence
separates held tokens from waiting ones), and every lease record in one batched read. A lease
record names the token its holder took, so a held key is recognised without reading the token
stream; only held tokens that no record explains (a key changing hands) are looked up one by one,
and only as many as the consumer says are held.

**Reads happen one after another, not at one instant.** Tokens are read before the inbox (a
producer stores a request before its key's token), so a key cannot show a token and no backlog
because it was enqueued during the reads. The few keys that still disagree (a backlog and no
token, a token and no backlog) are read again; what remains is what the queue really holds and
says so (:attr:`KeyState.condition`): a held token that no lease record names is *changing
hands*, a token without requests is released by its next holder at once, a backlog without a
token waits for the reconciler.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal, TypeVar

from keyqueue.errors import ConsumerNotFound, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.subjects import QueueNames

__all__ = [
    "KEY_LIMIT",
    "Holder",
    "KeyCondition",
    "KeyState",
    "QueueReport",
    "TokenState",
    "holder_of",
    "inspect_queue",
    "last_records",
    "list_queues",
    "parse_time",
]

KEY_LIMIT: Final = 1000
"""Most keys a report lists unless every key is asked for (the counts always cover every key)."""

RECHECK_LIMIT: Final = 200
"""Most keys whose backlog and token are read again because the first reads disagreed."""

HANDOVER_LIMIT: Final = 2000
"""Most held tokens read one by one to find those no lease record names (keys changing hands)."""

BATCH: Final = 5000
"""Messages per batched read."""

OFF_LOOP: Final = 5000
"""Keys from which the report is assembled in a thread."""

T = TypeVar("T")

TokenState = Literal["held", "scheduled", "none"]

KeyCondition = Literal["held", "changing-hands", "waiting", "no-token", "empty-token"]
"""What a key's token, backlog and lease record say together (:attr:`KeyState.condition`)."""


@dataclass(frozen=True, slots=True)
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
    ttl: int | None = None
    """Seconds the server keeps the record after each write: the lease ends ``ttl`` after ``renewed``."""
    token_seq: int | None = None
    """The sequence of the token the holder took (None if the record does not say)."""

    @property
    def lease_ends(self) -> datetime | None:
        """When the server drops the record unless it is renewed (by the server's clock)."""
        if self.renewed is None or self.ttl is None:
            return None
        return datetime.fromtimestamp(self.renewed.timestamp() + self.ttl, UTC)


@dataclass(frozen=True, slots=True)
class KeyState:
    """One key: how many requests wait, where its token is, and who holds it."""

    key: str
    backlog: int
    token: TokenState
    holder: Holder | None = None
    """For a held key with a live lease record, its holder; else None (a held token without a
    record waits for redelivery, or its worker is acquiring or giving back the key right now)."""

    @property
    def condition(self) -> KeyCondition:
        """``held`` (a worker holds it under a lease record), ``changing-hands`` (its token is
        delivered but no lease record names a holder: a worker is taking or giving back the key, or
        its holder's lease lapsed and the token waits for redelivery), ``waiting`` (for a free
        worker), ``no-token`` (requests but no token: the reconciler gives it one), ``empty-token``
        (a token without requests: its next holder finds nothing and gives it back)."""
        if self.token == "held":
            return "held" if self.holder is not None else "changing-hands"
        if self.token == "scheduled":
            return "waiting" if self.backlog else "empty-token"
        return "no-token"


@dataclass(frozen=True)
class QueueReport:
    """A snapshot of one queue."""

    queue: str
    keys: list[KeyState]
    """Keys with a backlog or a token, most backlog first (at most ``KEY_LIMIT`` unless every key was asked for)."""
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
    """Worker name -> how many keys it holds, most first."""
    keys_total: int = 0
    """Keys with a backlog or a token, all of them (``keys`` may list fewer)."""
    oldest_request: datetime | None = None
    """When the oldest stored request was stored (None with an empty inbox)."""
    delivered_through: int = 0
    """The token consumer's delivered stream sequence: tokens at or below it are held."""
    inbox_last_seq: int = 0
    """The inbox's last sequence, read just before the keys' backlogs: every request those
    backlogs count that was stored before the read has a sequence at or below it."""
    unkeyed: int = 0
    """Requests of unkeyed tasks stored in the work stream, running or not (0: none, or no work stream)."""
    unkeyed_running: int = 0
    """Of those, how many a worker has taken and not yet finished (the work consumer's ack pending)."""
    oldest_unkeyed: datetime | None = None
    """When the oldest stored unkeyed request was stored (None with none)."""

    @property
    def truncated(self) -> bool:
        return self.keys_total > len(self.keys)


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


async def inspect_queue(api: JetStreamApi, queue: str, *, every_key: bool = False, keys: bool = True) -> QueueReport:
    """A snapshot of ``queue`` (``StreamNotFound`` if it was never created); ``every_key`` lists
    every key instead of the first ``KEY_LIMIT``; ``keys=False`` reads only the counts (a few
    reads, however many keys: ``keys`` is then empty and ``workers`` unknown)."""
    names = QueueNames(queue)
    consumer = await api.consumer_info(names.token_stream, names.consumer)
    delivered = int((consumer.get("delivered") or {}).get("stream_seq", 0))
    ack_pending = int(consumer.get("num_ack_pending", 0))
    tokens: set[str] = set()
    holders: dict[str, Holder] = {}
    held: set[str] = set()
    backlog: dict[str, int] = {}
    if keys:
        tokens = set(await _off_loop(_keys_of, names.token_prefix,
                                     await api.subjects(names.token_stream, names.token_prefix + ">")))
        holders = await _holders(api, names)
        held = {k for k, h in holders.items() if k in tokens and h.token_seq is not None and h.token_seq <= delivered}
        if ack_pending > len(held):
            held |= await _held_without_record(api, names, delivered, ack_pending, held)
    inbox = await api.stream_info(names.inbox_stream)
    if keys:
        stored = await api.subjects(names.inbox_stream, names.inbox_prefix + ">")
        backlog = await _off_loop(_keys_of, names.inbox_prefix, stored)
        await _recheck(api, names, delivered, tokens, held, backlog)
    try:
        dlq = int((await api.stream_info(names.dlq_stream))["state"].get("messages", 0))
    except StreamNotFound:
        dlq = 0
    unkeyed, unkeyed_running, oldest_unkeyed = await _unkeyed(api, names)
    every, states = await _off_loop(_key_states, tokens, backlog, held, holders, every_key)
    workers = Counter(h.worker for key, h in holders.items() if key in held and h.worker)
    config = consumer.get("config") or {}
    state = inbox.get("state") or {}
    return QueueReport(
        queue=queue,
        keys=states,
        requests=int(state.get("messages", 0)),
        keys_with_backlog=len(backlog) if keys else int(state.get("num_subjects", 0)),
        keys_held=max(ack_pending, len(held)),
        pending_tokens=int(consumer.get("num_pending", 0)),
        dlq_size=dlq,
        consumer={
            "ack_pending": ack_pending,
            "redelivered": int(consumer.get("num_redelivered", 0)),
            "waiting_pulls": int(consumer.get("num_waiting", 0)),
            "ack_wait_s": int(config.get("ack_wait", 0)) / 1e9,
            "max_ack_pending": config.get("max_ack_pending"),
            "priority_policy": config.get("priority_policy", "none"),
            "pinned": ", ".join(f"{g.get('group')}={g['pinned_client_id']} since {g.get('pinned_ts', '?')}"
                                for g in consumer.get("priority_groups") or [] if g.get("pinned_client_id")),
        },
        workers=dict(workers.most_common()),
        keys_total=len(every),
        oldest_request=parse_time(state.get("first_ts")) if int(state.get("messages", 0)) else None,
        delivered_through=delivered,
        inbox_last_seq=int(state.get("last_seq", 0)),
        unkeyed=unkeyed,
        unkeyed_running=unkeyed_running,
        oldest_unkeyed=oldest_unkeyed,
    )


async def _unkeyed(api: JetStreamApi, names: QueueNames) -> tuple[int, int, datetime | None]:
    """Unkeyed requests stored, of those taken by a worker, and when the oldest was stored: from the
    work stream and its consumer, created by the first unkeyed enqueue or worker (none yet: zeros)."""
    try:
        state = (await api.stream_info(names.work_stream)).get("state") or {}
    except StreamNotFound:
        return 0, 0, None
    stored = int(state.get("messages", 0))
    try:
        running = int((await api.consumer_info(names.work_stream, names.consumer)).get("num_ack_pending", 0))
    except (StreamNotFound, ConsumerNotFound):
        running = 0
    return stored, min(running, stored), parse_time(state.get("first_ts")) if stored else None


def _keys_of(prefix: str, subjects: dict[str, int]) -> dict[str, int]:
    """Key -> count, from a stream's subjects on ``prefix`` + key."""
    cut = len(prefix)
    return {subject[cut:]: count for subject, count in subjects.items()}


def _key_states(tokens: set[str], backlog: dict[str, int], held: set[str], holders: dict[str, Holder],
                every_key: bool) -> tuple[list[str], list[KeyState]]:
    """Every key, most backlog first then by name, and the states of those listed."""
    every = sorted(tokens | backlog.keys())
    every.sort(key=lambda k: backlog.get(k, 0), reverse=True)  # stable: names stay in order within a backlog
    listed = every if every_key else every[:KEY_LIMIT]
    states = [KeyState(key, backlog.get(key, 0), "held" if key in held else "scheduled" if key in tokens else "none",
                       holders.get(key) if key in held else None)
              for key in listed]
    return every, states


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread when the work is big enough to hold the event loop (every key of a
    large queue), else here: on a dashboard the loop also serves the pages."""
    size = max((len(a) for a in args if isinstance(a, dict | set)), default=0)
    return await asyncio.to_thread(fn, *args) if size > OFF_LOOP else fn(*args)


async def last_records(api: JetStreamApi, stream: str, subject_filter: str) -> list[StoredMsg]:
    """Every message of ``stream`` on subjects matching ``subject_filter``, in stream order: on a
    stream that keeps one message per subject (the lease stream), the last of each subject."""
    found: list[StoredMsg] = []
    async for page in api.pages(stream, subject_filter, batch=BATCH):
        found.extend(page)
    return found


async def _holders(api: JetStreamApi, names: QueueNames) -> dict[str, Holder]:
    """Key -> holder, from every lease record of the queue."""
    try:
        records = await last_records(api, names.lease_stream, names.lease_prefix + ">")
    except StreamNotFound:
        return {}
    return {names.key_of(record.subject): holder_of(record) for record in records}


async def _held_without_record(api: JetStreamApi, names: QueueNames, delivered: int, held: int,
                               explained: set[str]) -> set[str]:
    """Keys whose token is held although no lease record names it: read the held tokens in order
    (at most ``HANDOVER_LIMIT``) until every held token is accounted for."""
    found: set[str] = set()
    seq, reads = 1, 0
    while reads < HANDOVER_LIMIT and len(explained) + len(found) < held:
        msg = await api.get_msg(names.token_stream, seq=seq, next_by_subject=names.token_prefix + ">", direct=False)
        reads += 1
        if msg is None or msg.seq > delivered:
            break
        key = names.key_of(msg.subject)
        if key not in explained:
            found.add(key)
        seq = msg.seq + 1
    return found


async def _recheck(api: JetStreamApi, names: QueueNames, delivered: int, tokens: set[str], held: set[str],
                   backlog: dict[str, int]) -> None:
    """Read again the keys whose token and backlog disagree (a request or a token that moved
    between the reads), and correct ``tokens``, ``held`` and ``backlog`` in place."""
    doubtful = [k for k in backlog if k not in tokens][:RECHECK_LIMIT]
    doubtful += [k for k in tokens if k not in backlog and k not in held][:RECHECK_LIMIT]

    async def again(key: str) -> tuple[str, StoredMsg | None, int]:
        token = await api.get_msg(names.token_stream, last_by_subject=names.token(key), direct=False)
        count = sum((await api.subjects(names.inbox_stream, names.inbox(key))).values())
        return key, token, count

    for key, token, count in await asyncio.gather(*(again(k) for k in doubtful)):
        if token is None:
            tokens.discard(key)
            held.discard(key)
        else:
            tokens.add(key)
            if token.seq <= delivered:
                held.add(key)
        if count:
            backlog[key] = count
        else:
            backlog.pop(key, None)


def holder_of(record: StoredMsg) -> Holder:
    """A lease record's holder: ``KeyLock`` writes the worker's fields (``worker``, ``token``,
    ``delivered``) and its own (``nonce``, ``fence``, ``since``, ``ttl``) as one JSON object."""
    try:
        body = json.loads(record.data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    worker, fence, ttl, token = body.get("worker"), body.get("fence"), body.get("ttl"), body.get("token")
    if fence == 0:
        fence = record.seq  # the record that acquired the key is written before its sequence is known
    return Holder(
        worker=worker if isinstance(worker, str) and worker else None,
        since=parse_time(body.get("since")),
        renewed=parse_time(record.timestamp),
        fence=fence if isinstance(fence, int) and fence > 0 else None,
        ttl=ttl if isinstance(ttl, int) and ttl > 0 else None,
        token_seq=token if isinstance(token, int) and token > 0 else None,
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
    if parsed.year < 1971:  # JetStream's zero time: "0001-01-01T00:00:00Z"
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
