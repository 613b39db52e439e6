"""``keyqueue worker --processes N``: a parent process that runs N worker processes and keeps them up.

The parent serves no queue. It starts each child as ``keyqueue worker`` with the parent's options
and a name of its own (``<name>/1`` ... ``<name>/N``), relays the children's output with that name
on each line, and:

* forwards SIGINT/SIGTERM: the first drains every child, a second stops them now; it exits 0 once
  every child has exited cleanly;
* restarts a child that dies (a non-zero status, or a signal it was not sent), after a backoff,
  logging one line naming the child and how it ended. The others go on. The parent saw the child
  die, so it releases the child's keys at once (``on_death``: ``keyqueue.admin.release``, for
  the records of that child's process only) rather than leaving them until its leases run out;
* gives up when one child dies soon after its start several times in a row (a configuration
  error, typically): it drains the others and fails with one line saying why.

Children run in their own process group, so a Ctrl-C in a terminal reaches them once, through the
parent, rather than twice (which would stop them without draining).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Final

from keyqueue.core.watchdog import EXIT_BLOCKED
from keyqueue.errors import KeyqueueError

__all__ = ["EXIT_RECYCLED", "RestartPolicy", "Supervisor", "WorkerCommand", "describe_exit"]

EXIT_RECYCLED: Final = 76
"""A worker process's exit status after it drained on purpose, having served ``--max-requests-per-child``
requests: the parent starts a new one at once (no backoff, not a death)."""

log = logging.getLogger("keyqueue.supervisor")

_STOPPED_BY_US: Final = frozenset({-signal.SIGINT, -signal.SIGTERM})
"""Exit statuses of a child our forwarded signal ended before it could handle it (while importing)."""


@dataclass(frozen=True)
class WorkerCommand:
    """How to start one worker process: its command line (the supervisor adds ``--name``) and its
    environment (e.g. the server's URL, which stays off the command line that ``ps`` shows)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    child_args: Callable[[int], Sequence[str]] | None = None
    """Options of child ``index`` (1..N) alone, e.g. its own ``--metrics-port``."""


@dataclass(frozen=True)
class RestartPolicy:
    """When and how soon a dead child is started again."""

    first_delay: float = 0.5
    """Seconds before the first restart of a child; doubled after each death that follows."""
    max_delay: float = 10.0
    """Longest wait before a restart."""
    quick: float = 5.0
    """A child that dies within this many seconds of its start died *quickly*; one that ran longer
    resets its backoff and its count of quick deaths."""
    give_up_after: int = 3
    """Quick deaths in a row of one child after which the parent stops everything and fails."""


def describe_exit(returncode: int) -> str:
    """How a process ended, for a log line: ``exited with status 1``, ``was killed by SIGKILL``."""
    if returncode == EXIT_BLOCKED:
        return (f"exited with status {returncode} (its loop watchdog stopped a run that would have outlived its "
                "lease; the reason is in its log above)")
    if returncode >= 0:
        return f"exited with status {returncode}"
    if returncode == -signal.SIGKILL:
        return ("was killed by SIGKILL (by hand, the OOM killer, or its lease alarm: a run it could not stop, C code "
                "holding the GIL or a stopped process, was about to outlive its lease)")
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


@dataclass
class _Child:
    """One running worker process and the tasks relaying its output."""

    name: str
    proc: asyncio.subprocess.Process
    started: float
    relays: list[asyncio.Task[None]] = field(default_factory=list)
    last_error_line: str = ""

    async def wait(self) -> int:
        returncode = await self.proc.wait()
        await asyncio.gather(*self.relays)  # the pipes close when the process (and its heirs) are gone
        return returncode


class Supervisor:
    """Runs ``count`` copies of a worker command (each given ``--name <name>/<i>``) until a signal.

    ``json_lines``: the children log JSON objects, so each relayed line gets a ``process`` field
    rather than a ``[name]`` prefix.
    """

    def __init__(self, count: int, name: str, *, json_lines: bool = False,
                 policy: RestartPolicy = RestartPolicy(),
                 on_death: Callable[[str, int], Awaitable[None]] | None = None) -> None:
        if count < 1:
            raise KeyqueueError(f"--processes must be at least 1, got {count}")
        self.command = WorkerCommand((), {})
        self.count = count
        self.name = name
        self.json_lines = json_lines
        self.policy = policy
        self.on_death = on_death
        """Called with a child's name and pid when it died (not when it stopped as asked), before
        it is started again: what its keys need (their release). Its failures are logged."""
        self._children: dict[int, _Child] = {}
        self._stopping = asyncio.Event()
        self._signals: list[signal.Signals] = []
        self._failure: str | None = None
        self._unclean: list[str] = []

    def child_name(self, index: int) -> str:
        return f"{self.name}/{index}"

    async def run(self, command: Awaitable[WorkerCommand]) -> None:
        """Start the children and supervise them until a signal (or a child that keeps dying).

        ``command`` gives how to start a worker process; the signals are handled
        while it is awaited already, and one that came meanwhile means no child is started.
        Raises ``KeyqueueError`` with one line when a child kept dying at start, or when a child
        did not exit cleanly after the stop.
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signal.Signals(signum))
        try:
            self.command = await command
            if self._stopping.is_set():
                return
            log.info("supervising %d worker processes %s/1..%d", self.count, self.name, self.count)
            async with asyncio.TaskGroup() as group:
                for index in range(1, self.count + 1):
                    group.create_task(self._keep_running(index), name=f"supervise:{self.child_name(index)}")
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            await self._kill_leftovers()
        if self._failure is not None:
            raise KeyqueueError(self._failure)
        if self._unclean:
            raise KeyqueueError(f"worker process(es) did not stop cleanly: {'; '.join(self._unclean)}")

    def _on_signal(self, signum: signal.Signals) -> None:
        self._signals.append(signum)
        if len(self._signals) == 1:
            log.warning("%s: draining %d worker processes; send again to stop them now", signum.name,
                        len(self._children))
        else:
            log.warning("%s again: stopping the worker processes now", signum.name)
        self._stopping.set()
        for child in self._children.values():
            self._forward(child, signum)

    def _give_up(self, reason: str) -> None:
        # Said once, as the command's error line, after the others have stopped.
        if self._failure is None:
            self._failure = reason
        if not self._stopping.is_set():
            self._stopping.set()
            self._signals.append(signal.SIGTERM)
            for child in self._children.values():
                self._forward(child, signal.SIGTERM)

    @staticmethod
    def _forward(child: _Child, signum: signal.Signals) -> None:
        if child.proc.returncode is None:
            try:
                child.proc.send_signal(signum)
            except ProcessLookupError:
                pass  # exited, not yet reaped

    async def _keep_running(self, index: int) -> None:
        """One child slot: start the child, wait for it, restart it after a death, until the stop."""
        name = self.child_name(index)
        delay, quick_deaths = self.policy.first_delay, 0
        while not self._stopping.is_set():
            child = await self._spawn(index, name)
            returncode = await child.wait()
            del self._children[index]
            if self._stopping.is_set():
                if returncode != 0 and returncode not in _STOPPED_BY_US:
                    self._unclean.append(f"{name} (pid {child.proc.pid}) {describe_exit(returncode)}")
                return
            if returncode == 0:
                log.warning("worker process %s (pid %d) exited on its own with status 0; not restarting it",
                            name, child.proc.pid)
                return
            if returncode == EXIT_RECYCLED:
                # It drained (its keys were handed on) after --max-requests-per-child: a fresh one now.
                log.info("worker process %s (pid %d) served its --max-requests-per-child and drained; starting a "
                         "new one", name, child.proc.pid)
                delay, quick_deaths = self.policy.first_delay, 0
                continue
            ran = time.monotonic() - child.started
            if ran >= self.policy.quick:
                delay, quick_deaths = self.policy.first_delay, 0
            quick_deaths += ran < self.policy.quick
            ended = f"worker process {name} (pid {child.proc.pid}) {describe_exit(returncode)} after {ran:.1f}s"
            if quick_deaths >= self.policy.give_up_after:
                last = f" (its last line: {child.last_error_line})" if child.last_error_line else ""
                self._give_up(f"{ended}, dying within {self.policy.quick:g}s of its start {quick_deaths} times "
                              f"in a row{last}: not restarting it")
                await self._died(child)
                return
            log.warning("%s; restarting it in %.1fs", ended, delay)
            await self._died(child)  # said first: the keys it held move on from here
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except TimeoutError:
                pass
            delay = min(self.policy.max_delay, delay * 2)

    async def _died(self, child: _Child) -> None:
        if self.on_death is None:
            return
        try:
            await self.on_death(child.name, child.proc.pid)
        except Exception as e:  # the keys then move when their leases run out
            log.warning("could not release the keys of worker process %s (pid %d): %s", child.name, child.proc.pid,
                        e)

    async def _spawn(self, index: int, name: str) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            *self.command.argv, *(self.command.child_args(index) if self.command.child_args else ()), "--name", name,
            env=dict(self.command.env), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, process_group=0)
        child = _Child(name, proc, time.monotonic())
        assert proc.stdout is not None and proc.stderr is not None
        child.relays = [asyncio.create_task(self._relay(child, proc.stdout, sys.stdout), name=f"stdout:{name}"),
                        asyncio.create_task(self._relay(child, proc.stderr, sys.stderr), name=f"stderr:{name}")]
        self._children[index] = child
        log.info("started worker process %s (pid %d)", name, proc.pid)
        # A signal that came while the process was being created was not forwarded to it.
        for signum in self._signals:
            self._forward(child, signum)
        return child

    async def _relay(self, child: _Child, stream: asyncio.StreamReader, out: IO[str]) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            if out is sys.stderr and line.strip():
                child.last_error_line = line.strip()
            out.write(self._named(child.name, line) + "\n")
            out.flush()

    def _named(self, name: str, line: str) -> str:
        if self.json_lines and line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                pass
            else:
                if isinstance(entry, dict):
                    return json.dumps({"process": name, **entry}, ensure_ascii=False)
        return f"[{name}] {line}"

    async def _kill_leftovers(self) -> None:
        """Children still running when supervising ended early (an error in the parent): kill them,
        as they would outlive it in their own process group."""
        for child in list(self._children.values()):
            if child.proc.returncode is None:
                try:
                    child.proc.kill()
                except ProcessLookupError:
                    pass
                await child.wait()
