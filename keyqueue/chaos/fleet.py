"""The soak's worker processes and the run log they share with it.

:class:`Fleet` starts each chaos worker (:mod:`keyqueue.chaos.worker`) under a fixed name, with
its URLs (its proxies), its clock offset and the soak's settings; writes the soak's own records
(``fault``, ``fault_end``, ``paused``, ``killed``, ...) into the same log; and watches every
process from a thread, so that a process that dies for any reason (a kill, a crash, a watchdog)
leaves an ``exited`` record within milliseconds of its death, not when somebody next looks
(with its status: ``-9`` for a SIGKILL, whoever sent it, ``75`` for the loop watchdog; the
supervisor starts a new process under the name). :class:`RssWatch` samples each worker process's
resident memory after its warm-up and at the end of the soak. :class:`SilenceWatch` asks a worker
that wrote nothing for a while, with requests waiting, what it is doing (SIGQUIT and SIGHUP: its
threads' and its asyncio tasks' stacks, in its stderr).
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

__all__ = ["Faults", "Fleet", "LogTail", "LoopLag", "RssSample", "RssWatch", "SilenceWatch", "WorkerSpec",
           "rss_bytes"]


class LogTail:
    """Reads a growing JSON-lines log from where it last stopped (a long soak's log is tens of MB:
    reading it whole on every check would cost more than the run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._reading = threading.Lock()
        """Two reads at once (:meth:`read` runs in a thread) each take their own lines, none twice."""

    def new_records(self) -> list[dict[str, object]]:
        """The complete lines appended since the last call."""
        with self._reading:
            try:
                with open(self.path, "rb") as log:
                    log.seek(self.offset)
                    chunk = log.read()
            except FileNotFoundError:
                return []
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    async def read(self) -> list[dict[str, object]]:
        """:meth:`new_records` in a thread. The soak's event loop carries every worker's fault proxy:
        parsing a long stretch of the log on it (the whole log is about 1.7 s for 230,000 records)
        held every worker's traffic that long, and the checker saw keys that did not move."""
        return await asyncio.to_thread(self.new_records)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker process of a soak is started with."""

    queue: str
    ack_wait: float
    concurrency: int
    replicas: int
    pool_size: int = 0
    """Children of each worker's process pool (for ``process``-shape requests; 0: no pool)."""


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
        self.started: dict[int, float] = {}
        """Each worker process's pid -> when it was started (``time.monotonic()``)."""

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
             "--pool-size", str(s.pool_size),
             *itertools.chain.from_iterable((flag, str(value)) for flag, value in stall.items())],
            stdout=subprocess.DEVNULL, stderr=stderr)
        stderr.close()
        self.procs[name] = proc
        self.started[proc.pid] = time.monotonic()
        threading.Thread(target=self._watch, args=(name, proc), daemon=True, name=f"watch-{name}").start()

    def _watch(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self.note(name, "exited", pid=proc.pid, code=code)

    async def wait_ready(self, names: Sequence[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        pids = {name: self.procs[name].pid for name in names}
        while True:
            # Read off the loop: this loop carries every worker's proxy (see LogTail.read).
            self._ready |= {(str(r["w"]), r.get("pid")) for r in await self._tail.read() if r["kind"] == "ready"}
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

    async def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        # Reaped off the loop: this loop carries every worker's proxy, and a big process takes
        # a few tenths of a second to end (the soak's loop watch saw them).
        await asyncio.to_thread(self.procs[name].wait)
        self.paused.discard(name)
        self.note(name, "killed")

    async def drain(self, name: str, timeout: float = 20.0) -> None:
        self.signal(name, signal.SIGTERM)
        proc = self.procs[name]
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
        except TimeoutError:
            await self.kill(name)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def rss(self, name: str) -> tuple[int, int] | None:
        """``(pid, resident bytes)`` of ``name``'s process now (its pool children not counted);
        None if it is not running."""
        proc = self.procs[name]
        if proc.poll() is not None:
            return None
        resident = rss_bytes(proc.pid)
        return None if resident is None else (proc.pid, resident)

    async def supervise(self, ending: asyncio.Event) -> None:
        """Start again every worker that exited while no fault injector was handling it (one
        that could not start while its server was electing leaders, say), until ``ending``; then
        once more, and wait until those started last are ready (a worker that died just before the
        end is back, its ``ready`` in the log, when the soak judges it)."""
        while not ending.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), 1.0)
            if not ending.is_set():
                self._start_dead()
        self._start_dead()
        with contextlib.suppress(TimeoutError, RuntimeError):
            await self.wait_ready(self.names(), timeout=60)

    def _start_dead(self) -> None:
        for name in self.names():
            if name not in self.busy and not self.alive(name):
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


def rss_bytes(pid: int) -> int | None:
    """The resident set size of process ``pid`` (``VmRSS`` in ``/proc/PID/status``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


@dataclass(frozen=True)
class RssSample:
    """A worker process's memory after its warm-up and after the soak's last fault."""

    name: str
    pid: int
    warm: int | None
    """Bytes ``warmup`` seconds after the process started; None if it was not up that long."""
    last: int | None
    """Bytes once every request completed after the last fault; None if the process had died."""

    @property
    def growth(self) -> float | None:
        """``last / warm - 1`` (0.05 is 5% more), when both are known."""
        return None if not self.warm or self.last is None else self.last / self.warm - 1

    def show(self, limit: float) -> str:
        def mib(n: int | None) -> str:
            return "-" if n is None else f"{n / 2**20:.1f} MiB"
        growth = self.growth
        judged = ("not compared" if growth is None else
                  f"{growth:+.1%}, {'within' if growth <= limit else 'OVER'} {limit:.0%}")
        return f"  rss {self.name} (pid {self.pid}): {mib(self.warm)} after warm-up, {mib(self.last)} after the " \
               f"last fault ({judged})"


class RssWatch:
    """Samples each worker process's RSS once it has run ``warmup`` seconds, and at the end (:meth:`final`).

    A process restarted by a fault is compared with its own warm-up sample, not its predecessor's."""

    def __init__(self, fleet: Fleet, warmup: float) -> None:
        self.fleet = fleet
        self.warmup = warmup
        self.warm: dict[int, int] = {}

    def sample(self) -> None:
        """Take the warm-up sample of every process that has just passed its warm-up."""
        now = time.monotonic()
        for name in self.fleet.names():
            proc = self.fleet.procs.get(name)
            if proc is None or proc.pid in self.warm or now - self.fleet.started.get(proc.pid, now) < self.warmup:
                continue
            taken = self.fleet.rss(name)
            if taken is not None:
                self.warm[taken[0]] = taken[1]

    async def run(self, ending: asyncio.Event) -> None:
        while not ending.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), 0.5)

    def final(self) -> list[RssSample]:
        """Each worker's current process: its warm-up sample and its RSS now."""
        samples = []
        for name in self.fleet.names():
            pid = self.fleet.procs[name].pid
            now = self.fleet.rss(name)
            samples.append(RssSample(name, pid, self.warm.get(pid), None if now is None else now[1]))
        return samples


class LoopLag:
    """Notes each time the soak's own event loop ran late (``lag`` records): that loop carries every
    worker's fault proxy, the producer and the fault injectors, so while it is late every worker's
    traffic waits too, as under a fault of every worker. The checker does not count it as one (it
    would excuse the protocol too); the records and the summary say when it happened."""

    TICK: float = 0.1
    """Seconds between the watch's wake-ups."""
    LATE: float = 0.25
    """A wake-up this much later than asked is noted."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.lags: list[float] = []

    async def run(self, until: asyncio.Event) -> None:
        while not until.is_set():
            asked = time.monotonic() + self.TICK
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), self.TICK)
            late = time.monotonic() - asked
            if late >= self.LATE:
                self.lags.append(late)
                self.fleet.note("soak", "lag", seconds=round(late, 3))


class SilenceWatch:
    """Dumps a worker process that is running, neither stopped nor handled by a fault injector, and
    has written nothing for ``after`` seconds while some stored request has not started: SIGQUIT
    (its threads' stacks, from C) and SIGHUP (its NATS client's state and its asyncio tasks'
    stacks), both into its stderr, once per silence; a ``dump`` record says when. It only looks:
    the checker's silence rule (:mod:`keyqueue.chaos.liveness`) judges."""

    def __init__(self, fleet: Fleet, after: float) -> None:
        self.fleet = fleet
        self.after = after
        self._tail = LogTail(fleet.log_path)
        self._heard: dict[str, float] = {}
        self._ready: set[str] = set()
        """Workers whose process said ``ready`` and has not ended since (one still starting has no
        dump handler yet, and is not expected to work)."""
        self._waiting: set[object] = set()
        self._dumped: set[str] = set()
        self.dumps = 0

    def look(self, now: float) -> None:
        for r in self._tail.new_records():
            kind, w = r.get("kind"), str(r.get("w"))
            if kind == "stored":
                self._waiting.add(r.get("tag"))
            elif kind == "start":
                self._waiting.discard(r.get("tag"))
            if w in self.fleet.urls and kind != "dumped":
                self._heard[w] = max(self._heard.get(w, 0.0), float(str(r["t"])))
                self._dumped.discard(w)
                if kind == "ready":
                    self._ready.add(w)
                elif kind in ("exited", "killed"):
                    self._ready.discard(w)
        if not self._waiting:
            return
        for name in self.fleet.names():
            heard = self._heard.get(name)
            if (heard is None or name not in self._ready or name in self._dumped or now - heard < self.after
                    or name in self.fleet.paused
                    or name in self.fleet.busy or not self.fleet.alive(name)):
                continue
            self._dumped.add(name)
            self.dumps += 1
            self.fleet.note("soak", "dump", target=name, silent_since=heard)
            self.fleet.signal(name, signal.SIGQUIT)
            self.fleet.signal(name, signal.SIGHUP)

    async def run(self, ending: asyncio.Event) -> None:
        while not ending.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), 1.0)
            self.look(time.time())


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
