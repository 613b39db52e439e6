"""Helpers for fault-injection tests: worker subprocesses, producers, and log checks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyqueue.jetstream.publish import OutgoingRequest
from keyqueue.wire import encode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from worker_proc import Work

WORKER = Path(__file__).resolve().parent / "worker_proc.py"


def work(key: str, tag: str, sleep: float = 0.0, fail: bool = False, **encode_kw: Any) -> OutgoingRequest:
    encoded = encode(Work(tag=tag, sleep=sleep, fail=fail), **encode_kw)
    return OutgoingRequest(key, encoded.headers, encoded.body, encoded.request_id)


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()


@dataclass
class Fleet:
    url: str
    queue: str
    log_path: Path
    workers: list[WorkerProc] = field(default_factory=list)

    def start(self, name: str, *args: str) -> WorkerProc:
        proc = subprocess.Popen([sys.executable, str(WORKER), self.url, self.queue, str(self.log_path),
                                 "--name", name, *args], stdout=subprocess.DEVNULL,
                                stderr=open(self.log_path.with_suffix(f".{name}.stderr"), "wb"))  # noqa: SIM115
        w = WorkerProc(name, proc)
        self.workers.append(w)
        return w

    async def wait_ready(self, *names: str, timeout: float = 30.0) -> None:
        await self.wait_for(lambda log: all(any(r["kind"] == "ready" and r["w"] == n for r in log) for n in names),
                            timeout=timeout, what=f"workers {names} ready")

    def records(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        out = []
        text = self.log_path.read_text()
        # A worker may be half-way through writing its last line: only complete lines count.
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    async def wait_for(self, pred: Callable[[list[dict[str, Any]]], bool], *, timeout: float = 60.0,
                       what: str = "condition") -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            log = self.records()
            if pred(log):
                return log
            for w in self.workers:
                code = w.proc.poll()
                if code not in (None, 0, -9, -15) and code is not None:
                    raise AssertionError(f"worker {w.name} exited with {code}: "
                                         f"{self.log_path.with_suffix(f'.{w.name}.stderr').read_text()[-2000:]}")
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)

    def stop_all(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGCONT)
            w.signal(signal.SIGKILL)
            w.proc.wait()


def ends_by_tag(log: Iterable[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for r in log:
        if r["kind"] == "end":
            counts[r["tag"]] += 1
    return counts


def check_exclusive(log: list[dict[str, Any]]) -> None:
    """No two handler runs of one key overlap in time (finished runs only)."""
    runs: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    open_: dict[tuple[str, str, str], float] = {}
    for r in log:
        if r["kind"] == "start":
            open_[(r["w"], r["key"], r["tag"])] = r["t"]
        elif r["kind"] == "end":
            start = open_.pop((r["w"], r["key"], r["tag"]))
            runs[r["key"]].append((start, r["t"], r["w"]))
    for key, spans in runs.items():
        spans.sort()
        for (_s1, e1, w1), (s2, _e2, w2) in itertools.pairwise(spans):
            assert s2 >= e1, f"key {key}: run on {w2} started at {s2} before the run on {w1} ended at {e1}"


def check_order(log: list[dict[str, Any]], expected: dict[str, list[str]]) -> None:
    """Per key, the last completion of each request is in enqueue order, and each completed."""
    done: dict[str, list[str]] = defaultdict(list)
    for r in log:
        if r["kind"] == "end":
            done[r["key"]].append(r["tag"])
    for key, tags in expected.items():
        seen = done.get(key, [])
        # Re-runs after faults repeat a request; keep each request's first completion.
        firsts = list(dict.fromkeys(seen))
        assert firsts == tags, f"key {key}: completed {firsts}, expected {tags}"
