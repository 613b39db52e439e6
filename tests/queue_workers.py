"""Running a core ``QueueWorker`` inside a test: started before the body, drained after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from keyqueue.core.worker import QueueWorker


@contextlib.asynccontextmanager
async def running(worker: QueueWorker) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` until the block ends (then drain it); raises at once if it cannot start.
    Yields the task that runs it, so a test can tell when it ended by itself."""
    task = asyncio.create_task(worker.run())
    started = asyncio.create_task(worker.started())
    await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()
    try:
        yield task
    finally:
        worker.stop()
        await task
