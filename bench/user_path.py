"""``python -m bench.user_path``: the path users run, next to raw JetStream in the same run.

One embedded nats-server; raw work-queue fetch(200)+ack (``bench.raw``); then one
``keyqueue worker bench.user_app:app`` process (the default processor, hooks and the events
plugin as installed) serving a no-op ``@app.task``, fed by ``Task.enqueue_many``:

- hot keys: 100 keys x 100 requests (``--hot-keys``, ``--hot-per-key``);
- cold keys: 5,000 keys x 1 request (``--cold-keys``).

A workload is timed from its first enqueue until the inbox and the token stream are empty. Besides
the rates it prints the worker process's CPU time per request over the same span (user + system,
from the kernel), which other load on a shared machine disturbs much less than the wall clock.
``--profile FILE`` runs the worker under cProfile and writes its statistics to FILE (the rates are
then not comparable). ``make bench`` runs :func:`measure` too, as its *product path* rows beside
the core's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

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


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


@dataclass(frozen=True)
class Workload:
    """One timed workload: requests per second, and the worker's CPU microseconds per request."""

    rate: float
    cpu_us: float
    enqueue_cpu_us: float
    """The producer's (this process's) CPU time per request in ``enqueue_many``, microseconds."""


async def _timed(api: JetStreamApi, worker: psutil.Process, keys: int, per_key: int, tag: str) -> Workload:
    if keys * per_key == 0:
        return Workload(float("nan"), float("nan"), float("nan"))
    items = [{"k": f"{tag}{k}", "i": i} for i in range(per_key) for k in range(keys)]
    cpu = _cpu(worker)
    began, producer = time.perf_counter(), time.process_time()
    await note.enqueue_many(items)
    producer = time.process_time() - producer
    await _drained(api)
    elapsed = time.perf_counter() - began
    return Workload(len(items) / elapsed, (_cpu(worker) - cpu) / len(items) * 1e6, producer / len(items) * 1e6)


@dataclass(frozen=True)
class ProductRates:
    """Requests per second through a ``keyqueue worker`` process, plugins as installed."""

    hot: float
    cold: float
    hot_cpu_us: float = 0.0
    """The worker's CPU time per request (user + system), microseconds, over the hot workload."""
    cold_cpu_us: float = 0.0
    """The same over the cold workload."""
    enqueue_cpu_us: float = 0.0
    """The producer's CPU time per request in ``Task.enqueue_many`` (both workloads), microseconds."""


async def measure(url: str, hot_keys: int, hot_per_key: int, cold_keys: int,
                  profile: Path | None = None) -> ProductRates:
    """Start one ``keyqueue worker bench.user_app:app`` on ``url``; time the hot then the cold workload."""
    app.settings = app.settings.with_url(url)
    env = {**os.environ, "KEYQUEUE_URL": url}
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    worker = await asyncio.create_subprocess_exec(
        sys.executable, *profiler, "-m", "keyqueue.cli", "worker", "bench.user_app:app", "--concurrency", "128",
        "--log-level", "warning", env=env)
    nc = await connect(url)
    api = JetStreamApi(nc)
    try:
        await note.enqueue(k="warmup", i=0)  # the worker is up once it has taken this
        await _drained(api, timeout=60)
        proc = psutil.Process(worker.pid)
        hot = await _timed(api, proc, hot_keys, hot_per_key, "h")
        cold = await _timed(api, proc, cold_keys, 1, "c")
    finally:
        worker.terminate()
        async with asyncio.timeout(60):
            await worker.wait()
        await nc.close()
        await app.close()
    enqueue = (hot.enqueue_cpu_us * hot_keys * hot_per_key + cold.enqueue_cpu_us * cold_keys) / (
        hot_keys * hot_per_key + cold_keys) if hot_keys * hot_per_key and cold_keys else hot.enqueue_cpu_us
    return ProductRates(hot.rate, cold.rate, hot.cpu_us, cold.cpu_us, enqueue)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store") as server:
            rates = await raw.measure(server.url, args.raw)
            product = await measure(server.url, args.hot_keys, args.hot_per_key, args.cold_keys, args.profile)
    hot = f"hot keys {args.hot_keys} x {args.hot_per_key}"
    cold = f"cold keys {args.cold_keys:,} x 1"
    print(f"{'raw fetch(200)+ack':26} {rates.fetch_ack:9,.0f} msg/s")
    print(f"{hot:26} {product.hot:9,.0f} req/s  {product.hot / rates.fetch_ack:.2f}x raw  "
          f"worker CPU {product.hot_cpu_us:5.0f} us/req")
    print(f"{cold:26} {product.cold:9,.0f} req/s  {product.cold / rates.fetch_ack:.2f}x raw  "
          f"worker CPU {product.cold_cpu_us:5.0f} us/req")
    print(f"{'enqueue_many (producer)':26} CPU {product.enqueue_cpu_us:5.0f} us/req")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.user_path", description=__doc__.splitlines()[0])
    parser.add_argument("--hot-keys", type=int, default=100)
    parser.add_argument("--hot-per-key", type=int, default=100)
    parser.add_argument("--cold-keys", type=int, default=5000)
    parser.add_argument("--raw", type=int, default=20_000, help="messages for raw fetch(200)+ack")
    parser.add_argument("--profile", type=Path, help="run the worker under cProfile, statistics to this file")
    asyncio.run(main(parser.parse_args()))
