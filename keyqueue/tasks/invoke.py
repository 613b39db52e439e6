"""Running a task function once, in the worker: on the event loop, or in a thread if it is sync.

Two time limits bound an attempt, for async and sync functions alike:

- ``soft_timeout``: ``keyqueue.SoftTimeout`` is raised *inside* the function, which may catch it to
  clean up (and then return, or raise). Uncaught, the attempt fails with it (and is retried).
- ``timeout`` (the hard limit): the run is stopped. A coroutine is cancelled; a thread gets an
  exception it cannot catch as an ``Exception`` (``_Stopped``, a ``BaseException``), raised in it at
  its next Python instruction. The attempt fails with ``KeyqueueTimeout``.

A key session that is cut off (the drain deadline, or its lease lost because renewals failed)
cancels the run: a coroutine is cut off (its request runs again on the key's next holder); a
thread is waited for, and its run kept if it returns in time.

A thread cannot be stopped while it blocks in C (a socket read, ``time.sleep``), so **a sync task
in a thread never outlives its key's lease, because its process does not**: while the lease is
renewed the key stays held until the thread returns; once the lease is lost, a thread still
running shortly after the lease's deadline ends the worker process with it (the loop watchdog,
exit status 75, its attempt counted; or, when C code holds the GIL, the kernel's lease alarm:
core/alarm.py), before the key's next holder can start. For a limit that stops only the run, run
sync tasks in processes (``keyqueue.app.process_pool``). **A run that completes is never thrown
away**: a thread that returns after its hard limit, or after the worker's drain deadline cut its
session off, returns its result, and the key session records it as done (it is removed, never
run again). Only a run that did not complete (it raised the injected stop) counts as timed out.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Final

from keyqueue.errors import KeyqueueTimeout, SoftTimeout

__all__ = ["invoke"]

log = logging.getLogger("keyqueue.task")


class _Stopped(BaseException):
    """Raised inside a sync task's thread to stop it (its hard limit, or the worker's drain deadline).

    A ``BaseException``, so the function's own ``except Exception`` does not swallow it."""


def _raise_in(ident: int, error: type[BaseException]) -> bool:
    """Raise ``error`` in the thread ``ident`` at its next Python instruction (CPython's async exception)."""
    return bool(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(error)) == 1)


def _noop() -> None:
    """A Python call: a pending async exception is raised at the latest when one is made."""


class _ThreadRun:
    """A sync function's run in a thread, into which an exception can be raised while (only while) it runs."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.lock = threading.Lock()
        self.ident: int | None = None
        self.finished = False
        self.raised: set[type[BaseException]] = set()

    def __call__(self) -> tuple[bool, Any]:
        """``(True, result)`` or ``(False, the exception it raised)``: never raises itself."""
        with self.lock:
            self.ident = threading.get_ident()
        outcome: tuple[bool, Any]
        try:
            outcome = (True, self.call())
        except BaseException as exc:
            outcome = (False, exc)
        while True:
            # An exception raised into this thread just as the function returned lands here, never
            # in the executor's own code; the function's outcome stands.
            try:
                with self.lock:
                    self.finished = True
                _noop()
                _noop()
                return outcome
            except (_Stopped, SoftTimeout):
                continue

    def interrupt(self, error: type[BaseException]) -> bool:
        """Raise ``error`` in the thread if the function still runs; whether it was raised."""
        with self.lock:
            if self.finished or self.ident is None:
                return False
            self.raised.add(error)
            return _raise_in(self.ident, error)


async def _run_in_thread(task: str, call: Callable[[], Any], soft: float | None, hard: float | None,
                         executor: Executor | None) -> Any:
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    run = _ThreadRun(call)
    future = loop.run_in_executor(executor, functools.partial(ctx.run, run))
    timers = []
    if soft is not None:
        timers.append(loop.call_later(soft, run.interrupt, SoftTimeout))
    try:
        try:
            ok, value = await asyncio.wait_for(asyncio.shield(future), hard)
        except TimeoutError:
            if future.done():
                raise
            run.interrupt(_Stopped)
            log.warning("sync task %s passed its hard limit of %ss: stopping it (a thread blocked in C code "
                        "cannot stop before it returns; its key stays held until then)", task, hard)
            ok, value = await _wait_uncancellable(future)
            if not ok and isinstance(value, _Stopped):
                raise KeyqueueTimeout(f"task {task} exceeded its timeout of {hard}s") from None
            if ok:
                log.warning("sync task %s completed after its hard limit of %ss: its result stands", task, hard)
        except asyncio.CancelledError:
            # The drain deadline, a second signal, or a lost lease. A thread cannot be cut off: wait
            # for it and keep its run, which the key's session then records as done if its lease
            # still holds. (Nothing is raised into it: its work may be done, and an exception at
            # its last line would make it run again.) A thread that does not return in time ends
            # with the process: after the drain's grace (core/worker.py), or just after a lost
            # lease's deadline (core/watchdog.py, core/alarm.py), before the next holder can start.
            if not future.done():
                log.warning("sync task %s was running when its key session was cut off; waiting for it (the worker "
                            "process ends if it still runs when the key's lease ends)", task)
            ok, value = await _wait_uncancellable(future)
            if not ok and isinstance(value, _Stopped):
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            log.warning("sync task %s completed as its key session was cut off: its outcome is kept", task)
    finally:
        for timer in timers:
            timer.cancel()
    if ok:
        return value
    if isinstance(value, SoftTimeout) and SoftTimeout in run.raised:
        raise SoftTimeout(f"task {task} passed its soft timeout of {soft}s") from None
    raise value


async def _wait_uncancellable(future: asyncio.Future[Any]) -> Any:
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


@types.coroutine
def _soft_limited(coro: Coroutine[Any, Any, Any], expired: list[bool], task: str,
                  soft: float) -> Generator[Any, Any, Any]:
    """Drive ``coro``; a cancel that comes once ``expired[0]`` is set is thrown into it as ``SoftTimeout``
    instead (the soft limit's timer sets the flag and cancels the task running this)."""
    send: Any = None
    throw: BaseException | None = None
    while True:
        try:
            yielded = coro.send(send) if throw is None else coro.throw(throw)
        except StopIteration as stop:
            return stop.value
        send, throw = None, None
        try:
            send = yield yielded
        except asyncio.CancelledError as exc:
            if expired[0]:
                expired[0] = False
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                throw = SoftTimeout(f"task {task} passed its soft timeout of {soft}s")
            else:
                throw = exc
        except BaseException as exc:
            throw = exc


async def _run_coroutine(task: str, coro: Coroutine[Any, Any, Any], soft: float | None, hard: float | None) -> Any:
    if soft is None:
        if hard is None:
            return await coro
        deadline = asyncio.timeout(hard)
        try:
            async with deadline:
                return await coro
        except TimeoutError:
            if deadline.expired():
                raise KeyqueueTimeout(f"task {task} exceeded its timeout of {hard}s") from None
            raise
    expired = [False]
    async def limited() -> Any:
        return await _soft_limited(coro, expired, task, soft)

    inner = asyncio.ensure_future(limited())

    def soft_limit() -> None:
        if not inner.done():
            expired[0] = True
            inner.cancel()

    loop = asyncio.get_running_loop()
    timer = loop.call_later(soft, soft_limit)
    try:
        done, _ = await asyncio.wait([inner], timeout=hard)
        if not done:
            inner.cancel()
            await asyncio.wait([inner])
            if inner.cancelled():
                raise KeyqueueTimeout(f"task {task} exceeded its timeout of {hard}s")
        return inner.result()
    except asyncio.CancelledError:
        inner.cancel()
        await asyncio.wait([inner])
        raise
    finally:
        timer.cancel()


_is_coroutine_function: Final = functools.lru_cache(maxsize=1024)(inspect.iscoroutinefunction)
"""``inspect.iscoroutinefunction``, answered once per task function (five Python calls per request otherwise)."""


async def invoke(task: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
                 timeout: float | None, soft_timeout: float | None = None, executor: Executor | None = None) -> Any:
    """Run task ``task``'s function ``fn`` once: coroutine functions on the loop, others in a thread.

    ``soft_timeout`` raises ``SoftTimeout`` inside the function; ``timeout`` (the hard limit) stops
    the run, which then fails with ``KeyqueueTimeout`` (see the module docstring).
    """
    try:
        is_async = _is_coroutine_function(fn)
    except TypeError:  # an unhashable callable
        is_async = inspect.iscoroutinefunction(fn)
    if is_async:
        return await _run_coroutine(task, fn(*args, **kwargs), soft_timeout, timeout)
    result = await _run_in_thread(task, functools.partial(fn, *args, **kwargs), soft_timeout, timeout, executor)
    if inspect.isawaitable(result):  # a sync function that returned an awaitable
        return await result
    return result
