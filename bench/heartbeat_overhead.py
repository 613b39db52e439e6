"""``python -m bench.heartbeat_overhead``: what a worker's heartbeat records cost on hot keys.

One process, one embedded nats-server, the events plugin off (so only the heartbeat differs).
Each round makes a fresh queue, stores ``--requests`` requests over ``--keys`` hot keys, then
starts a worker (``app.worker``) and times how long it takes to run them all. Rounds rotate
heartbeat off, on at the default interval (5 s) and on every 0.05 s (a hundred times as often,
to make the cost visible), so drift hits all alike; medians of wall time and of this process's
CPU time are printed.
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
from keyqueue.app.heartbeat import INTERVAL
from keyqueue.server.embedded import EmbeddedServer

SETTINGS = {"off": 0.0, f"{INTERVAL:g}s": INTERVAL, "0.05s": 0.05}
"""Label -> heartbeat interval (0: none)."""


async def one_round(url: str, queue: str, interval: float, requests: int, keys: int,
                    concurrency: int) -> tuple[float, float, int]:
    os.environ["KEYQUEUE_EVENTS"] = "0"
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
        await work.enqueue(k="warm", n=-1)
        await work.enqueue_many([{"k": f"k{i % keys}", "n": i} for i in range(requests)])
        count = -1  # the warm-up request runs too
        worker = app.worker(concurrency=concurrency)
        worker.heartbeat_interval = interval
        started, cpu = time.perf_counter(), time.process_time()
        async with worker:
            await asyncio.wait_for(done.wait(), 300)
            process, process_cpu = time.perf_counter() - started, time.process_time() - cpu
            written = worker.heartbeat.written if worker.heartbeat else 0
    finally:
        await app.close()
    return process, process_cpu, written


async def main(requests: int, keys: int, rounds: int, concurrency: int) -> None:
    results: dict[str, list[tuple[float, float, int]]] = {label: [] for label in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store", log_file=Path(tmp) / "log") as server:
            labels = list(SETTINGS)
            for index in range(rounds * len(labels)):
                label = labels[(index + index // len(labels)) % len(labels)]
                results[label].append(await one_round(server.url, f"hb{index}", SETTINGS[label], requests, keys,
                                                      concurrency))
    print(f"{requests} requests over {keys} hot keys, worker concurrency {concurrency}, {rounds} rounds each; medians")
    print("heartbeat | process s | req/s  | CPU us/req | records written")
    for label, rows in results.items():
        process, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        written = statistics.median(r[2] for r in rows)
        print(f"{label:9} | {process:9.3f} | {requests / process:6,.0f} | {cpu / requests * 1e6:10.0f} | {written:g}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.keys, args.rounds, args.concurrency))
