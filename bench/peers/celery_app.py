"""Celery on Redis, made keyed the way celery-once users do it: a per-key Redis lock.

A task that finds its key locked retries itself (``countdown`` 10 ms), since a task may not
block a worker slot waiting for a lock. Runs in the peers' virtual environment only.
Configured by ``BENCH_REDIS_URL`` and ``BENCH_OUT`` (where the worker writes its records on
shutdown).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import worker_shutdown

from bench.records import write_plain

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
DONE = "bench:done"

app = Celery("bench", broker=URL)
app.conf.update(
    task_default_queue="bench",
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)
client = redis.Redis.from_url(URL)
rows: list[tuple[str, int, int, int, int]] = []
lock = threading.Lock()


@app.task(bind=True, max_retries=None)
def run(self: Task[Any, Any], key: str, index: int, stamp: int) -> None:
    key_lock = client.lock(f"bench:lock:{key}", timeout=60)
    if not key_lock.acquire(blocking=False):
        raise self.retry(countdown=0.01)
    try:
        start = time.monotonic_ns()
        end = time.monotonic_ns()
        with lock:
            rows.append((key, index, stamp, start, end))
    finally:
        key_lock.release()
    client.incr(DONE)


@worker_shutdown.connect
def _write(**_: object) -> None:
    out = os.environ.get("BENCH_OUT")
    if out:
        with lock:
            write_plain(Path(out), rows)
