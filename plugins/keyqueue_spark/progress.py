"""A write's progress: each Spark task reports its own counts; the driver adds them up.

Counting the inbox stream would count every producer's requests (and a rerun's duplicates as
nothing), so the sink's tasks report what they did themselves: with the ``progressSubject``
option, each task publishes its cumulative counts (JSON, core NATS, at most a few times a
second) on that subject, and :class:`JobProgress` on the driver subscribes and prints one line.
A lost report only delays the line: every report carries the task's totals so far.

Rows are counted once per partition (a retried task's rows replace its failed attempt's);
requests stored, duplicates and errors are added over every attempt (a retry stores only what
its failed attempt had not: the rest are duplicates).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Final

from nats.aio.msg import Msg

from keyqueue.errors import KeyqueueError
from keyqueue.ext import Client

from .streams import connect_to

SUBJECT_PREFIX: Final = "_KQSPARK.progress"
"""Progress subjects are ``_KQSPARK.progress.<random>``: outside every queue's ``kq.`` subjects."""

REPORT_EVERY: Final = 0.5
"""Seconds between a task's reports (its first, last and waiting reports go at once)."""


def new_progress_subject() -> str:
    """A fresh subject for one write's progress reports."""
    return f"{SUBJECT_PREFIX}.{secrets.token_hex(8)}"


@dataclass(frozen=True, slots=True)
class TaskCounts:
    """One task attempt's totals so far, as it reports them."""

    partition: int
    attempt: int
    rows: int
    stored: int
    duplicates: int
    errors: int
    waited: float
    backlog: int | None
    """The backlog it is waiting on, or None when it is not waiting."""
    max_pending: int | None
    done: bool


class TaskProgress:
    """A task's reporter: ``await report(counts)`` publishes at most every :data:`REPORT_EVERY` s."""

    def __init__(self, nc: Client, subject: str | None) -> None:
        self.nc, self.subject = nc, subject
        self._last = 0.0

    async def report(self, counts: TaskCounts, *, now: bool = False) -> None:
        if self.subject is None:
            return
        moment = time.monotonic()
        if not now and moment - self._last < REPORT_EVERY:
            return
        self._last = moment
        await self.nc.publish(self.subject, json.dumps(asdict(counts)).encode())


class JobProgress:
    """The driver's progress line for one write, from its tasks' reports and Spark's task counts.

    A background thread (owned: :meth:`stop` ends and joins it) subscribes to ``subject`` and
    prints ``line()`` every ``interval`` seconds (every 5 s when not on a terminal), and once
    more when stopped.
    """

    def __init__(self, spark: Any, url: str, subject: str, total: int, *, max_pending: int | None = None,
                 interval: float = 1.0, out: Any = None) -> None:
        self.spark, self.url, self.subject, self.total = spark, url, subject, total
        self.max_pending = max_pending
        self.interval = interval
        self.out = out if out is not None else sys.stderr
        self.tasks: dict[tuple[int, int], TaskCounts] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="keyqueue-write-progress", daemon=True)
        self._error: BaseException | None = None

    # --- the counts ---

    def record(self, counts: TaskCounts) -> None:
        with self._lock:
            self.tasks[(counts.partition, counts.attempt)] = counts

    def totals(self) -> tuple[int, int, int, int]:
        """(rows, stored, duplicates, errors) of this job so far."""
        with self._lock:
            reports = list(self.tasks.values())
        rows_by_partition: dict[int, int] = {}
        for r in reports:
            rows_by_partition[r.partition] = max(rows_by_partition.get(r.partition, 0), r.rows)
        return (sum(rows_by_partition.values()), sum(r.stored for r in reports),
                sum(r.duplicates for r in reports), sum(r.errors for r in reports))

    def waiting(self) -> tuple[int, float] | None:
        """(the highest backlog a waiting task read, the longest wait so far), if any task waits."""
        with self._lock:
            waiting = [r for r in self.tasks.values() if r.backlog is not None and not r.done]
            waited = max((r.waited for r in self.tasks.values()), default=0.0)
        if not waiting:
            return None
        return max(r.backlog or 0 for r in waiting), waited

    def line(self) -> str:
        counts, rate = self._parts()
        return f"{counts[0]}, {rate}{counts[1]}"

    def _parts(self) -> tuple[tuple[str, str], str]:
        """((the counts, the wait), the rate): what the line says, and the part that changes by itself."""
        rows, stored, duplicates, errors = self.totals()
        elapsed = max(1e-6, time.monotonic() - self._started)
        text = ""
        done, total = self._spark_tasks()
        if total:
            text += f"tasks {done}/{total}, "
        share = f" ({100 * rows / self.total:.0f}%)" if self.total else ""
        text += f"rows {rows:,}/{self.total:,}{share}: {stored:,} stored"
        if duplicates:
            text += f", {duplicates:,} duplicates"
        if errors:
            text += f", {errors:,} bad"
        wait = ""
        waiting = self.waiting()
        if waiting is not None:
            backlog, waited = waiting
            limit = f" (max-pending {self.max_pending:,})" if self.max_pending else ""
            wait = f"; waiting for workers: backlog {backlog:,}{limit}, waited {waited:.0f}s"
        return (text, wait), f"{stored / elapsed:,.0f}/s"

    def _spark_tasks(self) -> tuple[int, int]:
        tracker = self.spark.sparkContext.statusTracker()
        done = total = 0
        for stage_id in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        return done, total

    # --- the thread ---

    def _run(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as e:  # shown by stop(); the write itself goes on
            self._error = e
            self._subscribed.set()

    async def _listen(self) -> None:
        nc = await connect_to(self.url)

        async def on_report(msg: Msg) -> None:
            try:
                self.record(TaskCounts(**json.loads(msg.data)))
            except (TypeError, ValueError):
                pass  # not a report of this version: ignore it

        try:
            await nc.subscribe(self.subject, cb=on_report)
            await nc.flush()
            self._subscribed.set()
            tty = getattr(self.out, "isatty", lambda: False)()
            every = self.interval if tty else max(5.0, self.interval)
            loop = asyncio.get_running_loop()
            shown: tuple[str, str] | None = None
            while not await loop.run_in_executor(None, self._stop.wait, every):
                shown = self._parts()[0]
                text = self.line()
                print(f"\r{text}   " if tty else text, end="" if tty else "\n", file=self.out, flush=True)
            await nc.flush()  # the tasks' last reports are in before the last line
            if tty:
                print(f"\r{self.line()}   ", file=self.out, flush=True)
            elif self._parts()[0] != shown:  # the last counts, unless the last line showed them
                print(self.line(), file=self.out, flush=True)
        finally:
            await nc.close()

    def start(self) -> JobProgress:
        """Start listening; returns once subscribed, so no task's first report is missed."""
        self._thread.start()
        self._subscribed.wait()
        if self._error is not None:
            raise KeyqueueError(f"progress: {self._error}") from self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
