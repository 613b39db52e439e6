"""Cancelling stored requests from outside a worker: one, as ``keyqueue cancel`` does, or many at once.

Each cancel is the protocol of :mod:`keyqueue.app.cancel`: a cancel record by request id, which
the holder of the request's key honours before the request starts (it never runs, and the holder
removes it in the key's order), and, for a delayed request not yet due, the removal of its
schedule. :func:`cancel_requests` writes the records of many requests concurrently and, rather than
wait for each holder's answer, says what became of each from its inbox sequence.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from keyqueue.app.cancel import CANCEL_ANSWER_WAIT, CancelState, request_cancel
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["PARALLEL", "cancel_request", "cancel_requests"]

PARALLEL: Final = 64
"""Cancels in flight at once."""


async def cancel_request(nc: Client, queue: str, request_id: str, seq: int | None) -> CancelState:
    """Cancel one request (``seq``: its inbox sequence, None for a delayed one) and say what became of it."""
    records = RequestRecords(nc, queue)
    await records.ensure()
    return await request_cancel(records, JetStreamApi(nc), request_id, seq, CANCEL_ANSWER_WAIT)


async def cancel_requests(nc: Client, queue: str, requests: Sequence[tuple[str, int | None]]) -> Counter[CancelState]:
    """Cancel each ``(request id, inbox sequence or None)``; how many ended in each state."""
    records = RequestRecords(nc, queue)
    await records.ensure()
    api = JetStreamApi(nc)
    gate = asyncio.Semaphore(PARALLEL)

    async def one(request_id: str, seq: int | None) -> CancelState:
        async with gate:
            return await request_cancel(records, api, request_id, seq, 0.0)

    return Counter(await asyncio.gather(*(one(r, s) for r, s in requests)))
