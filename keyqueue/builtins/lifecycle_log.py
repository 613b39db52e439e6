"""The built-in plugin that logs what the core's own log lines cannot say: tasks and tracebacks.

The core logs sessions and outcomes by key (``keyqueue.core.worker``); this plugin adds the worker's
queues and tasks when it starts, a failed attempt with its traceback, and superseded requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from keyqueue.plugins.manager import hookimpl

if TYPE_CHECKING:
    from keyqueue.app.worker import Worker

log = logging.getLogger("keyqueue.task")


@hookimpl(trylast=True)
def keyqueue_worker_started(worker: Worker) -> None:
    for queue in worker.queues:
        tasks = ", ".join(sorted(worker.queue_tasks(queue))) or "a registered processor"
        logging.getLogger("keyqueue.worker").info("queue %s: %s", queue, tasks)


@hookimpl(trylast=True)
def keyqueue_request_failed(queue: str, key: str, request_id: str, message_type: str, attempt: int,
                            error: BaseException) -> None:
    log.warning("%s failed on attempt %d (queue %s, key %s, request %s): %s: %s", message_type or "request",
                attempt, queue, key, request_id, type(error).__name__, error, exc_info=error)


@hookimpl(trylast=True)
def keyqueue_request_superseded(queue: str, key: str, request_id: str, message_type: str, superseded_by: str) -> None:
    log.info("%s request %s (queue %s, key %s) superseded by %s", message_type, request_id, queue, key,
             superseded_by)


@hookimpl(trylast=True)
def keyqueue_request_succeeded(queue: str, key: str, request_id: str, message_type: str, elapsed: float) -> None:
    log.debug("%s request %s (queue %s, key %s) succeeded in %.3fs", message_type, request_id, queue, key, elapsed)
