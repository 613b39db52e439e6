"""Results by request id: what ``App.result`` and ``receipt.result()`` do.

A task declared with ``result_ttl=`` (or on an app with a default ``result_ttl``) has every
request's reply kept by the worker that ran it, in the queue's records stream
(``keyqueue.jetstream.records``), under the request id, for that many seconds: the result, or the
final error (dead-lettered, cancelled, superseded). Reading it needs the queue and the request
id, nothing else, so any process can read it; it waits until the result exists.
"""

from __future__ import annotations

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
    return task.spec.result_ttl is not None or app.result_ttl is not None


async def fetch_result(app: App, request_id: str, *, queue: str | None, timeout: float, task: str | None) -> Any:
    """The result of request ``request_id`` of ``queue`` (default: the app's name); see ``App.result``."""
    validate_request_id(request_id)
    queue = queue or app.name
    known = app.tasks
    if task:
        declared = known.get(task)
        if declared is not None and not _keeps(app, declared):
            raise ResultNotKept(
                f"task {task} keeps no results, so request {request_id} has none to read: declare it with "
                "result_ttl=SECONDS (or give the app a default result_ttl)", request_id, queue)
    else:
        of_queue = [t for t in known.values() if t.queue == queue]
        if of_queue and not any(_keeps(app, t) for t in of_queue):
            raise ResultNotKept(
                f"no task of queue {queue!r} keeps results ({', '.join(sorted(t.name for t in of_queue))}), so "
                f"request {request_id} has none to read: declare them with result_ttl=SECONDS", request_id, queue)
    if not timeout >= 0:
        raise ConfigError(f"timeout must be a number of seconds >= 0, got {timeout}")
    kept = await app.transport().kept_result(queue, request_id, timeout)
    if kept is None:
        raise KeyqueueTimeout(
            f"no result for request {request_id} of queue {queue!r} within {timeout}s: it has not finished yet "
            "(or its task keeps no results, or it expired more than a day ago)")
    headers, body = kept
    if not headers.get(H.STATUS):
        raise ResultExpired(
            f"the result of request {request_id} (queue {queue!r}) was kept, but its result_ttl has passed "
            f"(expired results are remembered as such for {EXPIRED_MARKER_TTL // 3600} hours)", request_id, queue)
    name = headers.get(H.MESSAGE_TYPE, "").removesuffix(".result")
    declared = known.get(name)
    return decode_result(headers, body, request_id, declared.result_type() if declared is not None else None)
