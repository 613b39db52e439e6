"""What a benchmark worker writes about each request it ran, and what is computed from it.

Every worker (keyqueue's and the peers') records one line per handler run::

    <key> TAB <index> TAB <enqueued_ns> TAB <start_ns> TAB <end_ns>

``index`` is the request's position in its key's acceptance order; ``enqueued_ns`` is when the
producer stamped it just before enqueueing (0 when not stamped). All times come from
``time.monotonic_ns()``, which on Linux is one clock for every process of the machine, so
records from several worker processes line up.

This module uses the standard library only: the peers' benchmark scripts run in their own
virtual environment and import it from there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Record:
    """One handler run."""

    key: str
    index: int
    enqueued_ns: int
    start_ns: int
    end_ns: int


def body(index: int, enqueued_ns: int = 0) -> bytes:
    """The request body the benchmark sends: ``[index, enqueued_ns]`` as JSON."""
    return b"[%d,%d]" % (index, enqueued_ns)


def parse_body(data: bytes) -> tuple[int, int]:
    index, _, stamp = data.strip(b"[]").partition(b",")
    return int(index), int(stamp or 0)


def write_records(path: Path, rows: Iterable[tuple[str, bytes, int, int]]) -> int:
    """Write ``(key, body, start_ns, end_ns)`` rows as record lines; returns how many."""
    n = 0
    with open(path, "w") as out:
        for key, data, start, end in rows:
            index, stamp = parse_body(data)
            out.write(f"{key}\t{index}\t{stamp}\t{start}\t{end}\n")
            n += 1
    return n


def write_plain(path: Path, rows: Iterable[tuple[str, int, int, int, int]]) -> int:
    """Write ``(key, index, enqueued_ns, start_ns, end_ns)`` rows as record lines; returns how many."""
    n = 0
    with open(path, "w") as out:
        for key, index, stamp, start, end in rows:
            out.write(f"{key}\t{index}\t{stamp}\t{start}\t{end}\n")
            n += 1
    return n


def read_records(paths: Iterable[Path]) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            key, index, stamp, start, end = line.split("\t")
            records.append(Record(key, int(index), int(stamp), int(start), int(end)))
    return records


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Check:
    """Whether a run kept per-key order and exclusivity, and whether every request ran once."""

    ordered: bool
    exclusive: bool
    complete: bool
    runs: int
    expected: int
    detail: str

    @property
    def ok(self) -> bool:
        return self.ordered and self.exclusive and self.complete

    def summary(self) -> str:
        parts = [
            "order kept" if self.ordered else "ORDER BROKEN",
            "exclusive" if self.exclusive else "OVERLAP",
        ]
        if not self.complete:
            parts.append(f"{self.runs}/{self.expected} runs")
        return ", ".join(parts)


def check(records: Sequence[Record], expected: int) -> Check:
    """Per key: handler runs must not overlap in time and must start in index order.

    A run that ran a request more than once (a redelivery) counts as complete only if every
    index ran; order is then judged on first runs.
    """
    by_key: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_key[r.key].append(r)
    overlaps = 0
    disorders = 0
    first_bad = ""
    distinct = 0
    for key, runs in by_key.items():
        runs.sort(key=lambda r: r.start_ns)
        seen: set[int] = set()
        last_index = -1
        for prev, cur in pairwise(runs):
            if cur.start_ns < prev.end_ns:
                overlaps += 1
                first_bad = first_bad or f"key {key}: #{prev.index} and #{cur.index} overlapped"
        for r in runs:
            if r.index in seen:
                continue
            seen.add(r.index)
            if r.index < last_index:
                disorders += 1
                first_bad = first_bad or f"key {key}: #{r.index} started after #{last_index}"
            last_index = max(last_index, r.index)
        distinct += len(seen)
    detail = first_bad or "ok"
    if overlaps or disorders:
        detail = f"{overlaps} overlaps, {disorders} out-of-order starts; first: {first_bad}"
    return Check(ordered=disorders == 0, exclusive=overlaps == 0, complete=distinct == expected,
                 runs=len(records), expected=expected, detail=detail)


def span_rate(records: Sequence[Record]) -> float:
    """Requests per second from the first handler start to the last handler end."""
    if len(records) < 2:
        return math.nan
    first = min(r.start_ns for r in records)
    last = max(r.end_ns for r in records)
    return len(records) / max(1e-9, (last - first) / 1e9)


def handoffs_ms(records: Sequence[Record]) -> list[float]:
    """Per key, from one request's end to the next request's start, in milliseconds."""
    by_key: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_key[r.key].append(r)
    gaps: list[float] = []
    for runs in by_key.values():
        runs.sort(key=lambda r: r.start_ns)
        gaps.extend((cur.start_ns - prev.end_ns) / 1e6 for prev, cur in pairwise(runs))
    return gaps


def latencies_ms(records: Iterable[Record]) -> list[float]:
    """From the producer's stamp to the handler's start, in milliseconds (stamped records only)."""
    return [(r.start_ns - r.enqueued_ns) / 1e6 for r in records if r.enqueued_ns]
