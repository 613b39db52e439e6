"""Sync tasks in child processes (``keyqueue worker --pool processes``), like Celery's prefork.

A thread cannot be stopped while it blocks in C code; a process can. With the process pool a
worker runs its serial sync tasks in child processes, one run at a time per child, and:

- the **soft limit** raises ``SoftTimeout`` inside the task (a ``SIGALRM`` timer in the child: a
  signal interrupts ``time.sleep`` and most blocking calls of the child's main thread);
- the **hard limit** kills the child (``SIGKILL``): the run is stopped whatever it does, the
  attempt fails with ``KeyqueueTimeout``, and a fresh child takes its place;
- a **drain** that reaches its deadline kills the children still running: the runs are stopped
  (not completed), their requests stay stored and run again on the keys' next holders, and the
  worker keeps its ``--drain-timeout``;
- a **lost lease** (renewals failed) kills the child running that key's request, at once;
- a **worker that dies**, however (kill -9, the OOM killer, its lease alarm, the loop watchdog's
  exit), takes its children with it: each child asks the kernel for ``SIGKILL`` when the worker's
  event-loop thread ends (``PR_SET_PDEATHSIG``, core/alarm.py), so no run goes on as an orphan
  while its key moves to another worker. Each child leads a process group of its own, and a stop
  kills the group: processes the task started go with it (a task's own children are not killed
  when the *worker* dies, only the pool child: start them with a death signal of their own).

**How arguments cross, and why no user object is pickled.** A child is started with the
``spawn`` method and gets only the app's ``MODULE:APP`` string and its end of a pipe; it imports
the app itself, so it has the same tasks. Each run sends the task's name and the request's
*decoded plain field map* (maps, lists, text, numbers, bytes, datetimes), CBOR-encoded with
keyqueue's own codec (``keyqueue.wire``), over the pipe's raw bytes (``send_bytes``): the child
binds them to the function exactly as the worker would (dataclass arguments are rebuilt there from
their fields). The result comes back the same way, encoded as a reply body; an exception comes
back as its class name, message and traceback text. Nothing on the pipe is pickled.

The child's context (``ctx``) carries the request's key, id, attempt and fencing token; it cannot
publish progress or check the lease (it has no connection): ``progress`` raises ``ConfigError``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Final

from keyqueue.core.alarm import die_with_parent
from keyqueue.errors import ConfigError, KeyqueueTimeout, Reject, Retry, SoftTimeout
from keyqueue.tasks.arguments import encode_result
from keyqueue.wire import CBOR, dumps, loads

if TYPE_CHECKING:
    from keyqueue.tasks.task import Task

__all__ = ["POOLS", "ProcessPool"]

log = logging.getLogger("keyqueue.worker")

POOLS: Final = ("threads", "processes")
"""Where a worker runs its sync tasks: ``threads`` (the default) or ``processes``."""

_KNOWN_ERRORS: Final[dict[str, type[BaseException]]] = {
    "SoftTimeout": SoftTimeout, "Reject": Reject, "KeyqueueTimeout": KeyqueueTimeout}


class RemoteTaskError(Exception):
    """An exception a task raised in a child process, named as it was there."""


def _rebuilt(name: str, message: str, countdown: float | None) -> BaseException:
    """The exception a child reported: keyqueue's and Python's own by their class (so ``retry_on``
    and ``Reject`` work as in a thread), any other as an ``Exception`` of that name."""
    if name == "Retry":
        return Retry(message, countdown=countdown)
    known = _KNOWN_ERRORS.get(name) or getattr(builtins, name, None)
    if isinstance(known, type) and issubclass(known, Exception):
        try:
            return known(message)
        except Exception:
            pass
    named: type[RemoteTaskError] = type(name, (RemoteTaskError,), {})
    return named(message)


class _ChildContext:
    """What a sync task in a child process may ask about its request."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.task, self.queue, self.key = fields["task"], fields["queue"], fields["key"]
        self.request_id, self.request_ids = fields["request_id"], (fields["request_id"],)
        self.attempt = fields["attempt"]
        self.fencing = tuple(fields["fencing"])
        self.cancel_requested = False
        self.log = logging.LoggerAdapter(logging.getLogger(f"keyqueue.task.{self.task}"),
                                         {"queue": self.queue, "key": self.key, "request_id": self.request_id})

    def lease_valid(self) -> bool:
        return True  # the worker that runs this child checks it, and kills the child when it is lost

    def check_lease(self) -> None:
        return None

    def progress_sync(self, value: Any = None, headers: Any = None) -> None:
        raise ConfigError("a sync task in a process pool cannot publish progress (its process has no connection)")


def _on_alarm(signum: int, frame: Any) -> None:
    raise SoftTimeout("the task passed its soft timeout")


def _child_main(conn: Connection, app_spec: str, parent: int) -> None:
    """A pool child: import the app, then run one request at a time until the pipe closes."""
    # However the worker dies (kill -9, its lease alarm, the watchdog's exit, the OOM killer), the
    # kernel kills this child with it: a run must not outlive the worker that holds its key.
    die_with_parent(parent)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group of its own: stopping the run also stops what the task started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when a child stops
    signal.signal(signal.SIGALRM, _on_alarm)
    module, _, attribute = app_spec.partition(":")
    sys.path.insert(0, os.getcwd())
    app = getattr(importlib.import_module(module), attribute)
    tasks = app.tasks
    conn.send_bytes(dumps({"ready": True}, CBOR))  # the time limits count from here, not from the import
    while True:
        try:
            frame = loads(conn.recv_bytes(), CBOR)
        except EOFError:
            return
        task = tasks[frame["task"]]
        answer: dict[str, Any]
        try:
            args, kwargs = task.codec.to_call(frame["fields"])
            if task.takes_context:
                args = [_ChildContext(frame["context"]), *args]
            if frame.get("soft"):
                signal.setitimer(signal.ITIMER_REAL, frame["soft"])
            try:
                result = task.fn(*args, **kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            answer = {"ok": encode_result(result, task.name)}
        except BaseException as exc:
            answer = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(),
                      "countdown": getattr(exc, "countdown", None)}
        conn.send_bytes(dumps(answer, CBOR))


class _Child:
    def __init__(self, app_spec: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_child_main, args=(child_end, app_spec, os.getpid()), daemon=True,
                                       name="keyqueue-pool")
        self.process.start()
        child_end.close()

    def kill(self) -> None:
        """Stop the child and what its task started (its process group), and wait for it."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class ProcessPool:
    """Up to ``size`` child processes running sync tasks of the app ``app_spec`` (``MODULE:APP``)."""

    def __init__(self, app_spec: str, size: int) -> None:
        self.app_spec = app_spec
        self.size = size
        self._idle: list[_Child] = []
        self._started = 0
        self._room = asyncio.Semaphore(size)

    async def run(self, task: Task[Any], fields: Mapping[str, Any], context: Mapping[str, Any]) -> Any:
        """Run ``task`` with the plain ``fields`` in a child; its result (decoded plain value), or its error raised."""
        soft, hard = task.spec.soft_timeout, task.spec.timeout
        frame = dumps({"task": task.name, "fields": dict(fields), "context": dict(context), "soft": soft}, CBOR)
        async with self._room:
            child = self._idle.pop() if self._idle else await self._start()
            keep = False
            try:
                child.conn.send_bytes(frame)
                try:
                    async with asyncio.timeout(hard):
                        answer = loads(await self._receive(child), CBOR)
                except TimeoutError:
                    log.warning("sync task %s passed its hard limit of %ss: its process is killed", task.name, hard)
                    raise KeyqueueTimeout(f"task {task.name} exceeded its timeout of {hard}s") from None
                keep = True
            finally:
                if keep:
                    self._idle.append(child)
                else:  # stopped (the hard limit, a drain's deadline) or broken: never reused
                    await asyncio.to_thread(child.kill)
        if "ok" in answer:
            return loads(answer["ok"], CBOR)
        raise _rebuilt(answer["error"], answer["message"], answer.get("countdown"))

    async def _start(self) -> _Child:
        """A new child, once it has imported the app. Started from the event loop's thread: the kernel
        kills a child when the thread that started it ends (``PR_SET_PDEATHSIG``), and that thread
        lives as long as the worker (starting one is a fork and exec; the child imports on its own)."""
        child = _Child(self.app_spec)
        try:
            loads(await self._receive(child), CBOR)
        except BaseException:
            await asyncio.to_thread(child.kill)
            raise
        return child

    @staticmethod
    async def _receive(child: _Child) -> bytes:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = child.conn.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        try:
            return child.conn.recv_bytes()
        except EOFError:
            child.process.join(1)
            raise RuntimeError(f"the pool process running this task exited (status {child.process.exitcode}) "
                               "before it answered") from None

    def close(self) -> None:
        """Stop every idle child (a running one is killed by its run's cancellation)."""
        while self._idle:
            self._idle.pop().kill()
