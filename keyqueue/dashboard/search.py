"""Find any request: an index of each queue's pending and dead requests, searched on the server.

A search by request id, key, task or argument text must answer in well under a second on a queue
of 100,000 keys, and reading that many stored requests takes seconds. So a search reads no
stream: the dashboard keeps, per queue, an index of its inbox and of its DLQ (request id, key,
task, arguments as JSON text, error), built by reading each stream once with batched direct gets
and then only what was stored since, at each refresh (``SearchIndex.follow``).

Keeping it true:

- A request leaves the inbox from the front of its key's order (processed, dead-lettered,
  cancelled, superseded: the oldest first). So after each full snapshot of the queue's keys
  (:meth:`SearchIndex.trim`), the index drops, per key, its oldest entries stored before that
  snapshot beyond the key's count of stored requests. It may keep a request that left a moment
  ago, never drop one still stored.
- The DLQ changes when an operator acts on it: when it holds fewer dead requests than the index,
  or its first sequence moved past the index's first, its index is read again.
- What a page of results lists is checked against the stream first (:meth:`SearchIndex.verify`):
  a request that left meanwhile is dropped from the index and the page.

Delayed requests are searched in the schedules page's list (the first 500 per queue).
:class:`RequestFilter` is the one filter every search, the DLQ page and the bulk actions use; its
fields live in the URL.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal

from keyqueue.admin.dead_letters import dead_letter_of
from keyqueue.admin.inspection import QueueReport, parse_time
from keyqueue.dashboard.schedules import DelayedRequest
from keyqueue.errors import ConnectionFailed, KeyqueueError, StreamNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["PAGE", "Found", "IndexEntry", "RequestFilter", "SearchIndex", "Where", "key_pattern", "with_where"]

log = logging.getLogger("keyqueue.dashboard")

PAGE: Final = 50
"""Results per page."""

READ_PER_REFRESH: Final = 50_000
"""Stored requests read into the index per queue and refresh, at most (the first build takes a few)."""

MAX_ENTRIES: Final = 2_000_000
"""Entries the index holds per queue and kind, at most (beyond, a search says it covers the first ones)."""

Where = Literal["pending", "dead", "delayed", "all"]
WHERE: Final = ("all", "pending", "dead", "delayed")


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One stored request as a search sees it."""

    where: Literal["pending", "dead", "delayed"]
    seq: int
    """Its sequence in the inbox or DLQ stream (0 for a delayed request)."""
    key: str
    request_id: str
    task: str
    arguments: str
    """Its body as JSON text (or why it does not decode)."""
    stored: float | None
    error: str = ""
    """A dead request's error type and message."""
    due: float | None = None
    """A delayed request's due time."""
    haystack: str = ""
    """What a text search looks in: id, key, task, arguments and error, lower case (set on creation)."""

    def __post_init__(self) -> None:
        if not self.haystack:
            text = f"{self.request_id}\n{self.key}\n{self.task}\n{self.arguments}\n{self.error}".lower()
            object.__setattr__(self, "haystack", text)


@dataclass(frozen=True)
class RequestFilter:
    """What a search, the DLQ page's filter and a bulk action select."""

    text: str = ""
    """In the request id, key, task, arguments or error (case-insensitive)."""
    key: str = ""
    """The key, or a pattern with ``*`` and ``?`` (``order-1*``)."""
    task: str = ""
    """The task, exactly."""
    error: str = ""
    """In a dead request's error (case-insensitive)."""
    where: Where = "all"

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> RequestFilter:
        where = params.get("in", "all")
        return cls(params.get("q", "").strip(), params.get("key", "").strip(), params.get("task", "").strip(),
                   params.get("error", "").strip(), where if where in WHERE else "all")  # type: ignore[arg-type]

    def query(self) -> dict[str, str]:
        """The filter as URL parameters (empty ones left out)."""
        return {k: v for k, v in (("q", self.text), ("key", self.key), ("task", self.task), ("error", self.error),
                                  ("in", self.where if self.where != "all" else "")) if v}

    @property
    def empty(self) -> bool:
        return not (self.text or self.key or self.task or self.error)

    def describe(self) -> str:
        parts = [f"{name} {value!r}" for name, value in (("text", self.text), ("key", self.key), ("task", self.task),
                                                         ("error", self.error)) if value]
        return ", ".join(parts) or "everything"

    def matches(self, entry: IndexEntry) -> bool:
        if self.where != "all" and entry.where != self.where:
            return False
        if self.task and entry.task != self.task:
            return False
        if self.key and not (entry.key == self.key or key_pattern(self.key)(entry.key)):
            return False
        if self.error and self.error.lower() not in entry.error.lower():
            return False
        return not self.text or self.text.lower() in entry.haystack


@functools.lru_cache(maxsize=64)
def key_pattern(pattern: str) -> Callable[[str], re.Match[str] | None]:
    """A key pattern (``*``, ``?``, ``[...]`` as in shell globs) as a compiled matcher."""
    return re.compile(fnmatch.translate(pattern)).match


@dataclass(frozen=True)
class Found:
    """One page of a search's results."""

    entries: list[IndexEntry]
    total: int
    """Matches in all (all pages)."""
    page: int
    pages: int
    complete: bool
    """False while a queue's index is still being built (or is over its size): more may match."""


@dataclass
class _Stream:
    """The index of one stream of one queue."""

    entries: dict[int, IndexEntry] = field(default_factory=dict)
    """Sequence -> entry, in sequence order."""
    by_key: dict[str, list[int]] = field(default_factory=dict)
    read_through: int = 0
    """The last sequence read."""
    last_seq: int = 0
    """The stream's last sequence at the last read (read_through < last_seq: still building)."""

    def add(self, entry: IndexEntry) -> None:
        if len(self.entries) >= MAX_ENTRIES:
            return
        self.entries[entry.seq] = entry
        self.by_key.setdefault(entry.key, []).append(entry.seq)

    def drop_oldest(self, key: str, count: int) -> None:
        """Drop the ``count`` oldest entries of ``key``."""
        seqs = self.by_key.get(key)
        if not seqs or count <= 0:
            return
        for seq in seqs[:count]:
            self.entries.pop(seq, None)
        del seqs[:count]
        if not seqs:
            del self.by_key[key]

    def drop(self, seq: int) -> None:
        entry = self.entries.pop(seq, None)
        if entry is not None:
            seqs = self.by_key.get(entry.key)
            if seqs is not None:
                try:
                    seqs.remove(seq)
                except ValueError:
                    pass
                if not seqs:
                    del self.by_key[entry.key]

    @property
    def complete(self) -> bool:
        return self.read_through >= self.last_seq and len(self.entries) < MAX_ENTRIES


class SearchIndex:
    """Every followed queue's pending and dead requests, searchable at once."""

    def __init__(self, nc: Client, *, read_per_refresh: int = READ_PER_REFRESH) -> None:
        self.api = JetStreamApi(nc)
        self.read_per_refresh = read_per_refresh
        self.pending: dict[str, _Stream] = {}
        self.dead: dict[str, _Stream] = {}

    async def follow(self, queue: str) -> None:
        """Read what the queue's inbox and DLQ stored since the last call (a bounded amount)."""
        names = QueueNames(queue)
        await self._read(names, names.inbox_stream, names.inbox_prefix + ">",
                         self.pending.setdefault(queue, _Stream()), "pending")
        dead = self.dead.setdefault(queue, _Stream())
        try:
            state = (await self.api.stream_info(names.dlq_stream)).get("state") or {}
        except StreamNotFound:
            self.dead[queue] = _Stream()
            return
        first, messages = int(state.get("first_seq", 0)), int(state.get("messages", 0))
        if dead.complete and (messages < len(dead.entries) or (dead.entries and min(dead.entries) < first)):
            dead = self.dead[queue] = _Stream()  # an operator removed dead requests: read it again
        await self._read(names, names.dlq_stream, names.dlq_prefix + ">", dead, "dead")

    def trim(self, report: QueueReport) -> int:
        """Drop pending entries that left the inbox, after a snapshot of every key (see the module
        docstring); how many were dropped."""
        index = self.pending.get(report.queue)
        if index is None or report.truncated or not report.inbox_last_seq:
            return 0
        backlog = {k.key: k.backlog for k in report.keys}
        dropped = 0
        last = report.inbox_last_seq
        for key, seqs in list(index.by_key.items()):
            before = len(seqs) if seqs[-1] <= last else sum(1 for s in seqs if s <= last)
            extra = before - backlog.get(key, 0)
            if extra > 0:
                index.drop_oldest(key, extra)
                dropped += extra
        return dropped

    def forget(self, queue: str) -> None:
        self.pending.pop(queue, None)
        self.dead.pop(queue, None)

    def search(self, queue: str, selected: RequestFilter, delayed: Iterable[DelayedRequest] = (), *,
               page: int = 1, size: int = PAGE) -> Found:
        """The ``page``-th page of what ``selected`` matches in ``queue``: pending, then dead, then delayed."""
        matches = self.matching(queue, selected, delayed)
        pages = max(1, -(-len(matches) // size))
        page = min(max(1, page), pages)
        complete = all(s.complete for s in (self.pending.get(queue), self.dead.get(queue)) if s is not None) \
            and queue in self.pending
        return Found(matches[(page - 1) * size: page * size], len(matches), page, pages, complete)

    def matching(self, queue: str, selected: RequestFilter, delayed: Iterable[DelayedRequest] = ()) -> list[IndexEntry]:
        found: list[IndexEntry] = []
        for kind, streams in (("pending", self.pending), ("dead", self.dead)):
            if selected.where in ("all", kind) and (index := streams.get(queue)) is not None:
                found += [e for e in index.entries.values() if selected.matches(e)]
        if selected.where in ("all", "delayed"):
            for d in delayed:
                entry = IndexEntry("delayed", 0, d.key, d.request_id, d.task, "", None, due=d.due)
                if selected.matches(entry):
                    found.append(entry)
        return found

    async def verify(self, queue: str, entries: list[IndexEntry]) -> list[IndexEntry]:
        """``entries`` still stored, in order; those gone are dropped from the index too.

        Direct gets where the stream allows them: they are served beside the JetStream API's
        queue, which a busy server answers one request at a time."""
        names = QueueNames(queue)
        direct = {names.inbox_stream: True, names.dlq_stream: True}

        async def stored(entry: IndexEntry) -> bool:
            if entry.where == "delayed":
                return True
            stream = names.inbox_stream if entry.where == "pending" else names.dlq_stream
            try:
                try:
                    msg = await self.api.get_msg(stream, seq=entry.seq, direct=direct[stream])
                except ConnectionFailed:  # nobody answers direct gets: a replicated stream
                    direct[stream] = False
                    msg = await self.api.get_msg(stream, seq=entry.seq, direct=False)
            except KeyqueueError:
                return True  # cannot tell now: keep it
            return msg is not None

        kept = []
        for entry, present in zip(entries, await asyncio.gather(*(stored(e) for e in entries)), strict=True):
            if present:
                kept.append(entry)
            else:
                index = (self.pending if entry.where == "pending" else self.dead).get(queue)
                if index is not None:
                    index.drop(entry.seq)
        return kept

    async def _read(self, names: QueueNames, stream: str, subjects: str, index: _Stream,
                    where: Literal["pending", "dead"]) -> None:
        try:
            state = (await self.api.stream_info(stream)).get("state") or {}
        except StreamNotFound:
            return
        index.last_seq = int(state.get("last_seq", 0))
        start = max(index.read_through + 1, int(state.get("first_seq", 1)))
        if start > index.last_seq:
            index.read_through = index.last_seq
            return
        read = 0
        async for page in self.api.pages(stream, subjects, seq=start, batch=2000, limit=self.read_per_refresh):
            for msg in page:
                index.add(_entry(names, msg, where))
            read += len(page)
            index.read_through = page[-1].seq
            await asyncio.sleep(0)  # a page at a time: pages stay served while the index is built
        if read < self.read_per_refresh:  # read to the end: the rest up to last_seq was deleted
            index.read_through = max(index.read_through, index.last_seq)


def _entry(names: QueueNames, msg: StoredMsg, where: Literal["pending", "dead"]) -> IndexEntry:
    headers = msg.headers
    stored = parse_time(msg.timestamp)
    error = ""
    if where == "dead":
        letter = dead_letter_of(names, msg)
        request_id, error = letter.request_id, f"{letter.error_type}: {letter.error_message}".strip(": ")
    else:
        request_id = headers.get(H.MSG_ID, "")
    return IndexEntry(where, msg.seq, names.key_of(msg.subject), request_id, headers.get(H.MESSAGE_TYPE, ""),
                      _arguments(msg), stored.timestamp() if stored else None, error)


def _arguments(msg: StoredMsg) -> str:
    if not msg.data:
        return ""
    try:
        value: Any = loads(msg.data, msg.headers.get(H.CONTENT_TYPE, CBOR))
    except WireError as exc:
        return f"<{len(msg.data)} bytes that do not decode: {exc}>"
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def with_where(selected: RequestFilter, where: Where) -> RequestFilter:
    return replace(selected, where=where)
