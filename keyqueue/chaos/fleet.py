"""The soak's worker processes and the run log they share with it.

:class:`Fleet` starts each chaos worker (:mod:`keyqueue.chaos.worker`) under a fixed name, with
its URLs (its proxies), its clock offset and the soak's settings; writes the soak's own records
(``fault``, ``fault_end``, ``paused``, ``killed``, ...) into the same log; and watches every
process from a thread, so that a process that dies for any reason (a kill, a crash, a watchdog)
leaves an ``exited`` record within milliseconds of its death, not when somebody next looks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Faults", "Fleet", "LogTail", "WorkerSpec"]


class LogTail:
    """Reads a growing JSON-lines log from where it last stopped (a long soak's log is tens of MB:
    reading it whole on every check would cost more than the run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_records(self) -> list[dict[str, object]]:
        """The complete lines appended since the last call."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker process of a soak is started with."""

    queue: str
    ack_wait: float
    concurrency: int
    replicas: int


class Fleet:
    """The worker processes, each under a fixed name with its own URLs, writing one shared run log."""

    def __init__(self, spec: WorkerSpec, urls: Mapping[str, str], log_path: Path,
                 clock_offsets: Mapping[str, float] | None = None) -> None:
        self.spec = spec
        self.urls = dict(urls)
        self.clock_offsets = dict(clock_offsets or {})
        self.log_path = log_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.paused: set[str] = set()
        self.busy: set[str] = set()
        """Workers a fault injector is stopping or starting: the supervisor leaves them alone."""
        self.fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._closing = False
        self._tail = LogTail(log_path)
        self._ready: set[tuple[str, object]] = set()

    def note(self, w: str, kind: str, **fields: object) -> None:
        """Append one record; safe from the watcher threads (one ``write`` per line)."""
        line = json.dumps({"w": w, "kind": kind, "t": time.time(), **fields}, default=str)
        with contextlib.suppress(OSError):  # the log closed under a watcher at the very end
            os.write(self.fd, (line + "\n").encode())

    def names(self) -> list[str]:
        return list(self.urls)

    def start(self, name: str) -> None:
        s = self.spec
        stderr = open(self.log_path.with_suffix(f".{name}.stderr"), "ab")  # noqa: SIM115
        stall = {"--stall-under": round(s.ack_wait * 0.75, 3), "--stall-over": round(s.ack_wait * 1.5, 3)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyqueue.chaos.worker", self.urls[name], s.queue, str(self.log_path),
             "--name", name, "--ack-wait", str(s.ack_wait), "--concurrency", str(s.concurrency),
             "--replicas", str(s.replicas), "--clock-offset", str(self.clock_offsets.get(name, 0.0)),
             *itertools.chain.from_iterable((flag, str(value)) for flag, value in stall.items())],
            stdout=subprocess.DEVNULL, stderr=stderr)
        stderr.close()
        self.procs[name] = proc
        threading.Thread(target=self._watch, args=(name, proc), daemon=True, name=f"watch-{name}").start()

    def _watch(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self.note(name, "exited", pid=proc.pid, code=code)

    async def wait_ready(self, names: Sequence[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        pids = {name: self.procs[name].pid for name in names}
        while True:
            self._ready |= {(str(r["w"]), r.get("pid")) for r in self._tail.new_records() if r["kind"] == "ready"}
            if all((name, pid) in self._ready for name, pid in pids.items()):
                return
            for name in names:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"chaos worker {name} exited with {self.procs[name].returncode}; see "
                                       f"{self.log_path.with_suffix(f'.{name}.stderr')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos workers {list(names)} not ready within {timeout}s")
            await asyncio.sleep(0.1)

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def pause(self, name: str) -> None:
        self.signal(name, signal.SIGSTOP)
        self.paused.add(name)
        self.note(name, "paused", reason="sigstop")

    def resume(self, name: str) -> None:
        if name in self.paused:
            self.paused.discard(name)
            self.note(name, "resumed", reason="sigcont")
            self.signal(name, signal.SIGCONT)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait()
        self.paused.discard(name)
        self.note(name, "killed")

    async def drain(self, name: str, timeout: float = 20.0) -> None:
        self.signal(name, signal.SIGTERM)
        proc = self.procs[name]
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
        except TimeoutError:
            self.kill(name)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    async def supervise(self, ending: asyncio.Event) -> None:
        """Start again every worker that exited while no fault injector was handling it (one
        that could not start while its server was electing leaders, say), until ``ending``."""
        while not ending.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), 1.0)
            for name in self.names():
                if name not in self.busy and not self.alive(name) and not ending.is_set():
                    self.note("soak", "restart", target=name)
                    self.start(name)

    def stop_all(self) -> None:
        self._closing = True
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        os.close(self.fd)


class Faults:
    """Counts faults by kind and logs each one's beginning (``fault``) and end (``fault_end``)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.counts: Counter[str] = Counter()
        self._ids = itertools.count(1)

    def begin(self, kind: str, target: str | None = None, **fields: object) -> int:
        """Log that a fault of ``kind`` begins now (on worker or node ``target``); returns its id."""
        fault_id = next(self._ids)
        self.counts[kind] += 1
        self.fleet.note("soak", "fault", fault=kind, target=target, id=fault_id, **fields)
        return fault_id

    def end(self, fault_id: int, **fields: object) -> None:
        """Log that fault ``fault_id`` is over: reverted, healed, or its server back and ready."""
        self.fleet.note("soak", "fault_end", id=fault_id, **fields)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
