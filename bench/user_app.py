"""The app ``python -m bench.user_path`` serves with ``keyqueue worker``: a no-op keyed task, and one
whose handler awaits 1 ms of I/O.

``BENCH_REPLICAS=3`` (set by the bench for its cluster rows) configures the queue with R3 streams,
in the worker processes as in the producer.
"""

from __future__ import annotations

import asyncio
import os
from typing import Final

import keyqueue
from keyqueue.jetstream.topology import QueueConfig

REPLICAS_ENV: Final = "BENCH_REPLICAS"

app = keyqueue.App("userpath", set_as_default=False)  # a library of the bench: not the process's default app


def configure(replicas: int) -> None:
    """Give the queue ``replicas`` stream replicas (1: the defaults)."""
    app.configure_queue(QueueConfig("userpath", replicas=replicas))


configure(int(os.environ.get(REPLICAS_ENV, "1") or 1))


@app.task(key="{k}")
async def note(k: str, i: int) -> None:
    """Does nothing: the figure is what keyqueue itself costs per request."""


@app.task(key="{k}")
async def io_note(k: str, i: int) -> None:
    """Awaits 1 ms, as a handler that calls a service would: the figure with I/O in the handler."""
    await asyncio.sleep(0.001)


@app.task()
async def unkeyed_note(k: str, i: int) -> None:
    """Does nothing, with no key: the figure is what an unkeyed request costs (no lock at all)."""
