"""``python -m bench.events_overhead``: what the built-in events plugin costs, on and off.

One process, one embedded nats-server. Each round makes a fresh queue, enqueues ``--requests``
requests over ``--keys`` keys with ``enqueue_many`` (timed: the producer side), then starts a
worker and times how long it takes to run them all (the worker side). Rounds alternate
``KEYQUEUE_EVENTS=0`` and ``1`` so drift hits both alike; the medians are printed, as wall time
and as this process's CPU time (the Python side; nats-server is another process), which other
load on the machine disturbs less.
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


async def one_round(url: str, queue: str, events: bool, requests: int, keys: int,
                    concurrency: int) -> tuple[float, float, float, float]:
    os.environ["KEYQUEUE_EVENTS"] = "1" if events else "0"
    app = keyqueue.App(queue, url=url, set_as_default=False, autoload_plugins=False)
    done = asyncio.Event()
    count = 0

    @app.task(key="{k}")
    async def work(k: str, n: int) -> None:
        nonlocal count
        count += 1
        if count == requests:
            done.set()

    try:
        await work.enqueue(k="warm", n=-1)  # creates the streams (and the events stream when on)
        items = [{"k": f"k{i % keys}", "n": i} for i in range(requests)]
        started, cpu = time.perf_counter(), time.process_time()
        await work.enqueue_many(items)
        enqueue, enqueue_cpu = time.perf_counter() - started, time.process_time() - cpu
        count = -1  # the warm-up request runs too
        started, cpu = time.perf_counter(), time.process_time()
        async with app.worker(concurrency=concurrency):
            await asyncio.wait_for(done.wait(), 300)
            process, process_cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await app.close()
    return enqueue, process, enqueue_cpu, process_cpu


async def main(requests: int, keys: int, rounds: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store", log_file=Path(tmp) / "log") as server:
            results: dict[bool, list[tuple[float, float, float, float]]] = {False: [], True: []}
            for index in range(rounds * 2):
                events = index % 2 == 1 if (index // 2) % 2 == 0 else index % 2 == 0
                results[events].append(await one_round(server.url, f"ev{index}", events, requests, keys,
                                                       concurrency))
    for events in (False, True):
        print(f"events {'on ' if events else 'off'}: process s", " ".join(f"{r[1]:.2f}" for r in results[events]))
    print(f"{requests} requests over {keys} keys, worker concurrency {concurrency}, {rounds} rounds each; medians")
    print("events | enqueue_many s | enqueue req/s | enqueue CPU us/req | process s | process req/s "
          "| process CPU us/req")
    for events in (False, True):
        enqueue, process, enqueue_cpu, process_cpu = (statistics.median(r[i] for r in results[events])
                                                      for i in range(4))
        print(f"{'on ' if events else 'off'}    | {enqueue:14.3f} | {requests / enqueue:13,.0f} | "
              f"{enqueue_cpu / requests * 1e6:17.0f} | {process:9.3f} | {requests / process:13,.0f} | "
              f"{process_cpu / requests * 1e6:18.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.keys, args.rounds, args.concurrency))
