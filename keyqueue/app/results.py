"""Results by request id: what ``App.result`` and ``receipt.result()`` do.

A task declared with ``result_ttl=`` (or on an app with a default ``result_ttl``) has every
request's reply kept by the worker that ran it, in the queue's records stream
(``keyqueue.jetstream.records``), under the request id, for that many seconds: the result, or the
final error (dead-lettered, cancelled, superseded). Reading it needs the request id, and the queue
unless the app knows its queues (it then waits on each of them); any process can read it, and it
waits until the result exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from keyqueue.errors import ConfigError, KeyqueueTimeout, ResultExpired, ResultNotKept
from keyqueue.jetstream.records import EXPIRED_MARKER_TTL
from keyqueue.jetstream.subjects import validate_request_id
from keyqueue.tasks.arguments import decode_result
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.app.application import App
    from keyqueue.tasks.task import AnyTask

__all__ = ["fetch_result"]


def _keeps(app: App, task: AnyTask) -> bool:
    return task.spec.kept_for(app.result_ttl) is not None


async def fetch_result(app: App, request_id: str, *, queue: str | None, timeout: float, task: str | None) -> Any:
    """The result of request ``request_id`` (see ``App.result``): in ``queue``, else in the app's queues."""
    validate_request_id(request_id)
    known = app.tasks
    if task:
        declared = known.get(task)
        if declared is not None and not _keeps(app, declared):
            how = ("it is declared with result_ttl=0, which opts out of the app's default: give it "
                   "result_ttl=SECONDS" if declared.spec.result_ttl == 0 else
                   "declare it with result_ttl=SECONDS (or give the app a default result_ttl)")
            raise ResultNotKept(f"task {task} keeps no results, so request {request_id} has none to read: {how}",
                                request_id, queue or declared.queue)
    queues = app.lookup_queues(queue, task)
    if not task:
        keeping = []
        for candidate in queues:
            of_queue = [t for t in known.values() if t.queue == candidate]
            if not of_queue or any(_keeps(app, t) for t in of_queue):
                keeping.append(candidate)
        if not keeping:
            of_queue = [t for t in known.values() if t.queue in queues]
            raise ResultNotKept(
                f"no task of queue(s) {', '.join(map(repr, queues))} keeps results "
                f"({', '.join(sorted(t.name for t in of_queue))}), so request {request_id} has none to read: "
                "declare them with result_ttl=SECONDS", request_id, queues[0])
        queues = keeping
    if not timeout >= 0:
        raise ConfigError(f"timeout must be a number of seconds >= 0, got {timeout}")
    found = await _first_kept(app, queues, request_id, timeout)
    where = ", ".join(map(repr, queues))
    if found is None:
        raise KeyqueueTimeout(
            f"no result for request {request_id} of queue {where} within {timeout}s: it has not finished yet "
            "(or its task keeps no results, or it expired more than a day ago)")
    found_in, (headers, body) = found
    if not headers.get(H.STATUS):
        raise ResultExpired(
            f"the result of request {request_id} (queue {found_in!r}) was kept, but its result_ttl has passed "
            f"(expired results are remembered as such for {EXPIRED_MARKER_TTL // 3600} hours)", request_id, found_in)
    name = headers.get(H.MESSAGE_TYPE, "").removesuffix(".result")
    declared = known.get(name)
    return decode_result(headers, body, request_id, declared.result_type() if declared is not None else None)


async def _first_kept(app: App, queues: list[str], request_id: str,
                      timeout: float) -> tuple[str, tuple[Mapping[str, str], bytes]] | None:
    """The first queue of ``queues`` to have the request's kept reply (waiting for all at once)."""
    transport = app.transport()
    if len(queues) == 1:
        kept = await transport.kept_result(queues[0], request_id, timeout)
        return None if kept is None else (queues[0], kept)
    waits = {asyncio.ensure_future(transport.kept_result(q, request_id, timeout)): q for q in queues}
    try:
        for done in asyncio.as_completed(list(waits)):
            kept = await done
            if kept is not None:
                for future, queue in waits.items():
                    if future.done() and not future.cancelled() and future.result() is kept:
                        return queue, kept
        return None
    finally:
        for future in waits:
            future.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
