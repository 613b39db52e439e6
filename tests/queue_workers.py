"""Running a core ``QueueWorker`` inside a test: started before the body, drained after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client

from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire.headers import is_release_marker


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


async def stored_requests(nc: Client, names: QueueNames) -> list[StoredMsg]:
    """The requests stored in a queue's inbox, in stream order, release markers left out (a key given
    back keeps one for a second: docs/architecture.md, "Giving a key back")."""
    api = JetStreamApi(nc)
    found: list[StoredMsg] = []
    seq = 1
    while (msg := await api.get_msg(names.inbox_stream, seq=seq, next_by_subject=names.inbox_prefix + ">")) is not None:
        if not is_release_marker(msg.headers):
            found.append(msg)
        seq = msg.seq + 1
    return found
