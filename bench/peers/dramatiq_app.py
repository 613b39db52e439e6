"""Dramatiq on Redis, keyed with ``ConcurrentRateLimiter(backend, key, limit=1)`` (a distributed mutex).

A message whose key is busy raises ``RateLimitExceeded`` and is retried by Dramatiq's Retries
middleware (backoff 5-100 ms, unlimited retries). Runs in the peers' virtual environment only.
Configured by ``BENCH_REDIS_URL`` and ``BENCH_OUT``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

from bench.records import write_plain

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
DONE = "bench:done"

rows: list[tuple[str, int, int, int, int]] = []
lock = threading.Lock()


class WriteRecords(Middleware):
    """Writes the worker's records when it shuts down."""

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        out = os.environ.get("BENCH_OUT")
        if out:
            with lock:
                write_plain(Path(out), rows)


broker = RedisBroker(url=URL)
broker.add_middleware(WriteRecords())
dramatiq.set_broker(broker)
backend = RedisBackend(url=URL)
client = redis.Redis.from_url(URL)


@dramatiq.actor(queue_name="bench", max_retries=10**9, min_backoff=5, max_backoff=100)
def run(key: str, index: int, stamp: int) -> None:
    mutex = ConcurrentRateLimiter(backend, f"bench:mutex:{key}", limit=1)
    with mutex.acquire():
        start = time.monotonic_ns()
        end = time.monotonic_ns()
        with lock:
            rows.append((key, index, stamp, start, end))
    client.incr(DONE)
