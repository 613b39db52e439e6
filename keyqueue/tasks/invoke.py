"""Running a task function once, in the worker: on the event loop, or in a thread if it is sync.

A coroutine function runs on the worker's loop under ``asyncio.timeout``. Any other function runs
in the worker's executor, so it cannot block the loop that keeps the leases alive. A thread
cannot be stopped: when its timeout passes or its key session is cancelled, keyqueue waits for
it to return before giving up, so the key never moves to another worker while it still runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from keyqueue.errors import KeyqueueTimeout

__all__ = ["invoke"]

log = logging.getLogger("keyqueue.task")


async def _run_in_thread(task: str, call: Callable[[], Any], timeout: float | None, executor: Executor | None) -> Any:
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    future = loop.run_in_executor(executor, functools.partial(ctx.run, call))
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        if future.done():
            raise  # the function itself raised TimeoutError
        log.warning("sync task %s exceeded its %ss timeout; waiting for it to return (threads cannot be stopped)",
                    task, timeout)
        await _wait_uncancellable(future)
        raise KeyqueueTimeout(f"task {task} exceeded its timeout of {timeout}s") from None
    except asyncio.CancelledError:
        # The thread cannot be stopped. Holding on until it returns keeps the key from moving to
        # another worker while this one still runs its request.
        if not future.done():
            log.warning("sync task %s was cancelled while running; waiting for it to return", task)
            await _wait_uncancellable(future)
        raise


async def _wait_uncancellable(future: asyncio.Future[Any]) -> None:
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def invoke(task: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
                 timeout: float | None, executor: Executor | None = None) -> Any:
    """Run task ``task``'s function ``fn`` once: coroutine functions on the loop, others in a thread.

    ``timeout`` (seconds, or None) bounds the run; past it the run fails with ``KeyqueueTimeout``.
    """
    if inspect.iscoroutinefunction(fn):
        if timeout is None:
            return await fn(*args, **kwargs)  # no deadline to keep: no timeout context to enter
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await fn(*args, **kwargs)
        except TimeoutError:
            if deadline.expired():
                raise KeyqueueTimeout(f"task {task} exceeded its timeout of {timeout}s") from None
            raise
    result = await _run_in_thread(task, functools.partial(fn, *args, **kwargs), timeout, executor)
    if inspect.isawaitable(result):  # a sync function that returned an awaitable
        return await result
    return result
