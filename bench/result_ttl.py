"""``python -m bench.result_ttl``: what keeping results (``result_ttl``) costs a worker, on and off.

One process, one embedded nats-server. Each round makes a fresh queue, enqueues ``--requests``
requests over ``--keys`` keys with ``enqueue_many``, then starts a worker and times how long it
takes to run them all. Rounds alternate a task without ``result_ttl`` and one with it (each
result then is one more JetStream publish, awaited before the request is removed) so drift hits
both alike; the medians are printed, as wall time and as this process's CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import keyqueue
from keyqueue.server.embedded import EmbeddedServer


async def one_round(url: str, queue: str, keep: bool, requests: int, keys: int,
                    concurrency: int) -> tuple[float, float]:
    app = keyqueue.App(queue, url=url, set_as_default=False, autoload_plugins=False)
    done = asyncio.Event()
    count = 0

    @app.task(key="{k}", result_ttl=600 if keep else None)
    async def work(k: str, n: int) -> dict[str, int]:
        nonlocal count
        count += 1
        if count == requests:
            done.set()
        return {"n": n}

    try:
        await work.enqueue(k="warm", n=-1)  # creates the streams
        await work.enqueue_many([{"k": f"k{i % keys}", "n": i} for i in range(requests)])
        count = -1  # the warm-up request runs too
        started, cpu = time.perf_counter(), time.process_time()
        async with app.worker(concurrency=concurrency):
            await asyncio.wait_for(done.wait(), 300)
            process, process_cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await app.close()
    return process, process_cpu


async def main(requests: int, keys: int, rounds: int, concurrency: int) -> tuple[float, float]:
    """Print the medians; return the median rates (req/s) without and with ``result_ttl``."""
    os.environ.setdefault("KEYQUEUE_EVENTS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store", log_file=Path(tmp) / "log") as server:
            results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for index in range(rounds * 2):
                keep = index % 2 == 1 if (index // 2) % 2 == 0 else index % 2 == 0
                results[keep].append(await one_round(server.url, f"rt{index}", keep, requests, keys, concurrency))
    print(f"{requests} requests over {keys} keys, worker concurrency {concurrency}, {rounds} rounds each; medians")
    print("result_ttl | process s | process req/s | process CPU us/req")
    rates = []
    for keep in (False, True):
        process, process_cpu = (statistics.median(r[i] for r in results[keep]) for i in range(2))
        rates.append(requests / process)
        print(f"{'600 ' if keep else 'None'}       | {process:9.3f} | {requests / process:13,.0f} | "
              f"{process_cpu / requests * 1e6:18.0f}")
    print(f"result_ttl costs {1 - rates[1] / rates[0]:.0%} of throughput (the goal: at most 15%); rounds "
          f"without: {', '.join(f'{requests / r[0]:,.0f}' for r in results[False])}, with: "
          f"{', '.join(f'{requests / r[0]:,.0f}' for r in results[True])} req/s")
    return rates[0], rates[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.keys, args.rounds, args.concurrency))
