"""Worker processes for a benchmark workload: start them, line them up, stop them, collect records."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from bench.records import Record, read_records

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How each benchmark worker process runs its QueueWorker."""

    concurrency: int = 16
    linger: float = 0.05
    ack_wait: float = 30.0
    kill_on_stop: bool = False
    profile_dir: Path | None = None
    loop: str | None = None
    """The event loop of every worker, ``keyqueue worker --loop`` or ``bench.worker --loop`` (None: their
    default, ``auto``: uvloop where it is installed)."""


@dataclass
class Fleet:
    """``size`` ``python -m bench.worker`` processes serving one queue."""

    url: str
    queue: str
    size: int
    work_dir: Path
    options: WorkerOptions = field(default_factory=WorkerOptions)
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    per_process: list[int] = field(default_factory=list)
    """Requests each worker ran, known after :meth:`stop`."""

    def _out(self, index: int) -> Path:
        return self.work_dir / f"{self.queue}-w{index}.tsv"

    async def __aenter__(self) -> Self:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for index in range(self.size):
            cmd = [sys.executable, "-m", "bench.worker", self.url, self.queue, str(self._out(index)),
                   "--concurrency", str(self.options.concurrency), "--linger", str(self.options.linger),
                   "--ack-wait", str(self.options.ack_wait)]
            if self.options.kill_on_stop:
                cmd.append("--kill-on-stop")
            if self.options.loop is not None:
                cmd += ["--loop", self.options.loop]
            if self.options.profile_dir is not None:
                cmd += ["--profile", str(self.options.profile_dir / f"{self.queue}-w{index}.txt")]
            proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            self.procs.append(proc)
        await self._expect("ready", timeout=30)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def _send(self, line: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line.encode() + b"\n")
            await proc.stdin.drain()

    async def _expect(self, word: str, timeout: float) -> list[str]:
        async def one(proc: asyncio.subprocess.Process) -> str:
            assert proc.stdout is not None
            line = (await proc.stdout.readline()).decode().strip()
            if not line.startswith(word):
                raise RuntimeError(f"benchmark worker {proc.pid} said {line!r}, expected {word!r} "
                                   f"(exit code {proc.returncode}; see its stderr above)")
            return line

        return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in self.procs)), timeout))

    async def go(self) -> None:
        """Let every worker start pulling keys; returns once each worker runs."""
        await self._send("go")
        await self._expect("started", timeout=30)

    async def stop(self, timeout: float = 60) -> list[Record]:
        """Drain every worker and return every record they wrote."""
        await self._send("stop")
        await self._expect("done", timeout=timeout)
        for proc in self.procs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        self.per_process = [len(read_records([self._out(i)])) for i in range(self.size)]
        return read_records(self._out(i) for i in range(self.size))
