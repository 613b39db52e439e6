"""A command run in a subprocess whose output lines are read as they come, so a test waits for a
line (an event) instead of sleeping. Shared by the tests that run ``keyqueue`` as a user does."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from pathlib import Path
from typing import Self


class Command:
    """A running subprocess; ``lines`` holds what it wrote to stdout and stderr so far, in order."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Condition()
        streams = [s for s in (proc.stdout, proc.stderr) if s is not None]
        self._readers = [asyncio.create_task(self._read(stream)) for stream in streams]

    @classmethod
    async def start(cls, *argv: str, env: dict[str, str], cwd: Path | None = None) -> Self:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            async with self._changed:
                self.lines.append(raw.decode().rstrip("\n"))
                self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def matches(self, pattern: str) -> list[re.Match[str]]:
        return [m for line in self.lines if (m := re.search(pattern, line))]

    async def wait_for(self, pattern: str, count: int = 1, timeout: float = 30) -> list[re.Match[str]]:
        """The first ``count`` lines matching ``pattern``, once they have been written."""
        async with asyncio.timeout(timeout), self._changed:
            while len(found := self.matches(pattern)) < count:
                if all(reader.done() for reader in self._readers):
                    raise AssertionError(f"the command ended without {count} x {pattern!r}:\n{self.output}")
                await self._changed.wait()
            return found[:count]

    async def stop(self, timeout: float = 30) -> int:
        """SIGTERM (if it still runs), then its exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    async def wait(self, timeout: float = 30) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._readers)
        return code
