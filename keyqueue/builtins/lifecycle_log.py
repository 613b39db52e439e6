"""The built-in plugin that logs what only the app's worker knows: its queues' tasks, and its totals.

The core logs every step of every key session, once (``keyqueue.core.worker``: failed attempts,
dead letters, lost leases, ...); this plugin adds one line per queue when the worker starts, naming
the queue's tasks, and one line when it stops, with what each queue did::

    queue shop: charge, refund, send_receipt (unkeyed)
    worker host:4711 stopped: shop: 120 succeeded, 3 retried, 2 dead-lettered; mail: 5 succeeded
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from keyqueue.plugins.manager import hookimpl

if TYPE_CHECKING:
    from keyqueue.app.worker import Worker

log = logging.getLogger("keyqueue.worker")


@hookimpl(trylast=True)
def keyqueue_worker_started(worker: Worker) -> None:
    for queue in worker.queues:
        runs = worker.queue_tasks(queue)
        own = sorted(name + (" (unkeyed)" if task.spec.unkeyed else "") for name, task in runs.items()
                     if task.queue == queue)
        if own:
            tasks = ", ".join(own)
        elif runs:
            tasks = "serial tasks sent with options(queue=...)"
        else:
            tasks = "a registered processor"
        log.info("queue %s: %s", queue, tasks, extra={"kq_queue": queue})


@hookimpl(trylast=True)
def keyqueue_worker_stopping(worker: Worker) -> None:
    totals = "; ".join(f"{queue}: {queue_worker.summary()}" for queue, queue_worker in worker.queue_workers.items())
    log.info("worker %s stopped: %s", worker.name, totals,
             extra={"kq_worker": worker.name,
                    "kq_counts": {queue: dict(w.counts) for queue, w in worker.queue_workers.items()}})
