"""``python -m bench.user_path``: the path users run, next to raw JetStream in the same run.

One embedded nats-server; raw work-queue fetch(200)+ack (``bench.raw``); then one
``keyqueue worker bench.user_app:app`` process (the default processor, hooks and the events
plugin as installed) serving a no-op ``@app.task``, fed by ``Task.enqueue_many``:

- hot keys: 100 keys x 20 requests;
- cold keys: 1,000 keys x 1 request.

A workload is timed from its first enqueue until the inbox and the token stream are empty.
``make bench`` runs :func:`measure` too, as its *product path* rows beside the core's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import raw
from bench.user_app import app, note
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.server.embedded import EmbeddedServer


async def _drained(api: JetStreamApi, timeout: float = 120.0) -> None:
    names = app.queue_config("userpath").names
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbox = await api.stream_info(names.inbox_stream)
        tokens = await api.stream_info(names.token_stream)
        if inbox["state"]["messages"] == 0 and tokens["state"]["messages"] == 0:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("the worker did not drain the queue")


async def _timed(api: JetStreamApi, keys: int, per_key: int, tag: str) -> float:
    items = [{"k": f"{tag}{k}", "i": i} for i in range(per_key) for k in range(keys)]
    began = time.perf_counter()
    await note.enqueue_many(items)
    await _drained(api)
    return len(items) / (time.perf_counter() - began)


@dataclass(frozen=True)
class ProductRates:
    """Requests per second through a ``keyqueue worker`` process, plugins as installed."""

    hot: float
    cold: float


async def measure(url: str, hot_keys: int, hot_per_key: int, cold_keys: int) -> ProductRates:
    """Start one ``keyqueue worker bench.user_app:app`` on ``url``; time the hot then the cold workload."""
    app.settings = app.settings.with_url(url)
    env = {**os.environ, "KEYQUEUE_URL": url}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "keyqueue.cli", "worker", "bench.user_app:app", "--concurrency", "128",
        "--log-level", "warning", env=env)
    nc = await connect(url)
    api = JetStreamApi(nc)
    try:
        await note.enqueue(k="warmup", i=0)  # the worker is up once it has taken this
        await _drained(api, timeout=60)
        hot = await _timed(api, hot_keys, hot_per_key, "h")
        cold = await _timed(api, cold_keys, 1, "c")
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 30)
        await nc.close()
        await app.close()
    return ProductRates(hot, cold)


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store") as server:
            rates = await raw.measure(server.url, 10_000)
            product = await measure(server.url, 100, 20, 1000)
    print(f"raw fetch(200)+ack         {rates.fetch_ack:9,.0f} msg/s")
    print(f"hot keys 100 x 20          {product.hot:9,.0f} req/s  {product.hot / rates.fetch_ack:.2f}x raw")
    print(f"cold keys 1,000 x 1        {product.cold:9,.0f} req/s  {product.cold / rates.fetch_ack:.2f}x raw")


if __name__ == "__main__":
    asyncio.run(main())
