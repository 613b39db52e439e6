"""A queue's keys page: every key's row, filtered, sorted and cut into pages, on the server.

A queue may have 100,000 keys. The snapshot holds every key's state (``state.Monitor``); a page
filters them by name (a substring, or a pattern with ``*`` and ``?``) and by kind, sorts, and
builds rows only for the ``PAGE`` keys it shows. Kinds that need more than the snapshot (stuck,
failing: the key's events and progress) are only worked out for held keys.

A key's kind (``KeyRow.kind``): ``held`` by a live worker; ``stuck`` (held, with no event and no
progress for ``--stuck-after`` seconds); ``gone-holder`` (held by a worker the registry says is
gone: its lease ends soon); ``changing-hands``; ``waiting`` for a worker; ``no-token`` (requests
and no token: the reconciler gives it one); ``empty-token`` (a token without requests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from keyqueue.admin.inspection import KeyState
from keyqueue.admin.workers import WorkerState
from keyqueue.dashboard.search import key_pattern
from keyqueue.dashboard.state import HeadAttempt, Monitor, QueueView

__all__ = ["KINDS", "PAGE", "SORTS", "KeyCounts", "KeyPage", "KeyRow", "key_page"]

PAGE: Final = 100
"""Keys per page."""

KINDS: Final = (
    ("all", "all keys"), ("held", "held (stuck included)"), ("stuck", "stuck (held, no event or progress)"),
    ("gone-holder", "held by a gone worker"), ("failing", "failing (head request retrying)"),
    ("changing-hands", "changing hands"), ("waiting", "waiting for a worker"),
    ("no-token", "requests without a token"), ("empty-token", "token without requests"),
)
"""The kinds a page can show, with their labels."""

SORTS: Final = ("backlog", "key", "state", "attempts", "since", "activity")


@dataclass(frozen=True)
class KeyRow:
    """One row of a queue's keys page."""

    key: KeyState
    kind: str
    worker: WorkerState | None
    """The holder's registry entry, when it has one."""
    activity: float | None
    head: HeadAttempt | None = None
    """The attempts of the request it runs or retries, from its events."""

    @property
    def since(self) -> float | None:
        h = self.key.holder
        moment = None if h is None else h.since or h.renewed
        return None if moment is None else moment.timestamp()


@dataclass(frozen=True)
class KeyCounts:
    """A queue's keys counted from the same read as the page's rows, so the two always agree (the
    queue's live counts, read at every refresh, can be newer than its last read of every key)."""

    with_backlog: int
    held: int
    """Tokens held (a key changing hands included)."""
    waiting: int
    """Keys whose token waits for a worker."""

    @classmethod
    def of(cls, keys: list[KeyState]) -> KeyCounts:
        return cls(sum(1 for k in keys if k.backlog), sum(1 for k in keys if k.token == "held"),
                   sum(1 for k in keys if k.condition == "waiting"))


@dataclass(frozen=True)
class KeyPage:
    rows: list[KeyRow]
    total: int
    """Keys that match, on every page."""
    page: int
    pages: int
    counts: KeyCounts | None = None
    """Every key of the queue (not only those that match), counted from the read the rows come from."""


def key_page(monitor: Monitor, queue: str, view: QueueView, *, search: str, kind: str, sort: str, page: int,
             stuck_after: float, now: float, size: int = PAGE) -> KeyPage:
    """The ``page``-th page of ``view``'s keys that match ``search`` and ``kind``, sorted by ``sort``."""
    workers = {w.name: w for w in view.workers}
    keys = view.report.keys
    counts = KeyCounts.of(keys)
    if search:
        if any(c in search for c in "*?["):
            matches = key_pattern(search)
            keys = [k for k in keys if matches(k.key)]
        else:
            needle = search.lower()
            keys = [k for k in keys if needle in k.key.lower()]

    def row(k: KeyState) -> KeyRow:
        worker = workers.get(k.holder.worker) if k.holder is not None and k.holder.worker else None
        activity = monitor.last_activity(queue, k) if k.token == "held" else None
        head = monitor.head_attempt(queue, k.key) if k.token == "held" else None
        condition: str = k.condition
        if condition == "held" and worker is not None and not worker.live:
            condition = "gone-holder"
        elif condition == "held" and activity is not None and now - activity > stuck_after:
            condition = "stuck"
        return KeyRow(k, condition, worker, activity, head)

    if kind in ("held", "stuck", "gone-holder", "failing"):
        rows = [row(k) for k in keys if k.token == "held"]
        if kind == "failing":
            rows = [r for r in rows if r.head is not None and r.head.failing]
        elif kind != "held":
            rows = [r for r in rows if r.kind == kind]
    elif kind in ("changing-hands", "waiting", "no-token", "empty-token"):
        rows = [KeyRow(k, k.condition, None, None) for k in keys if k.condition == kind]
    else:
        rows = []
    if kind in ("all", "") or kind not in dict(KINDS):
        # Only the page's rows are built; sorting by what only rows know builds every row.
        if sort in ("backlog", "key") or not keys:
            ordered = keys if sort == "backlog" else sorted(keys, key=lambda k: k.key)
            pages = max(1, -(-len(ordered) // size))
            page = min(max(1, page), pages)
            return KeyPage([row(k) for k in ordered[(page - 1) * size: page * size]], len(ordered), page, pages,
                           counts)
        rows = [row(k) for k in keys]
    rows.sort(key=_SORTS.get(sort, _SORTS["backlog"]))
    pages = max(1, -(-len(rows) // size))
    page = min(max(1, page), pages)
    return KeyPage(rows[(page - 1) * size: page * size], len(rows), page, pages, counts)


_SORTS: Final[dict[str, Callable[[KeyRow], Any]]] = {
    "backlog": lambda r: (-r.key.backlog, r.key.key),
    "key": lambda r: r.key.key,
    "since": lambda r: (r.since is None, r.since or 0.0, r.key.key),
    "activity": lambda r: (r.activity is None, r.activity or 0.0, r.key.key),
    "state": lambda r: (r.kind, r.key.key),
    "attempts": lambda r: (-(r.head.attempt if r.head else 0), r.key.key),
}
