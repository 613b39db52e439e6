"""``python -m bench.release_ab``: the key release with and without the release marker, interleaved in
one run on one embedded server (docs/benchmarks.md, "The release marker").

The core's ``QueueWorker`` (no-op processor, 128 slots) serves cold keys (``--keys`` keys x 1 request,
stored first, then served); each round runs once with the marker (``QueueIO.release_markers``) and once
with the older give-back (a purge, then a re-check), alternating, on fresh queues. Printed per mode:
keys per second (median of the rounds), and per key the server's JetStream API calls, stored messages
and client messages (``bench.server_counters``), and the worker process's CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench import server_counters
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer


class Nothing(BaseProcessor):
    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        return None


async def one(url: str, monitoring: str, name: str, keys: int,
              markers: bool) -> tuple[float, server_counters.PerUnit, float]:
    nc = await connect(url)
    config = QueueConfig(name, ack_wait=30)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    await Publisher(nc, config.names).enqueue_many(
        [OutgoingRequest(f"k{n}", {"Nats-Msg-Id": f"{name}-{n}"}, b"x", f"{name}-{n}") for n in range(keys)])
    worker_nc = await connect(url)
    worker = QueueWorker(worker_nc, config, lambda key: Nothing(), concurrency=128,
                         settings=SessionSettings(ack_wait=30), reconcile_interval=3600)
    # The worker pulls only once started; the mode is set before its first token (see _ensure_topology).
    real = Topology.allow_release_markers

    async def chosen(self: Topology) -> bool:
        return markers and await real(self)
    Topology.allow_release_markers = chosen  # type: ignore[method-assign]
    before = await server_counters.snapshot(monitoring)
    cpu0, began = time.process_time(), time.perf_counter()
    task = asyncio.create_task(worker.run())
    try:
        while True:
            tokens = await api.stream_info(config.names.token_stream)
            if (tokens["state"]["messages"] == 0 and not worker.sessions
                    and await requests_waiting(api, config.names) == 0):
                break
            await asyncio.sleep(0.01)
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu0
        after = await server_counters.snapshot(monitoring)
    finally:
        Topology.allow_release_markers = real  # type: ignore[method-assign]
        worker.stop()
        await task
        await worker_nc.close()
        await nc.close()
    return keys / elapsed, (after - before).per(keys), cpu / keys


async def main(keys: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as store:
        async with EmbeddedServer(store_dir=Path(store)) as server:
            results: dict[bool, list[tuple[float, server_counters.PerUnit, float]]] = {True: [], False: []}
            for r in range(rounds):
                for markers in ((False, True) if r % 2 == 0 else (True, False)):
                    results[markers].append(await one(server.url, server.monitoring_url, f"ab{r}{int(markers)}",
                                                      keys, markers))
            for markers, label in ((False, "purge + re-check"), (True, "release marker")):
                rows = results[markers]
                rate = statistics.median(r[0] for r in rows)
                cpu = statistics.median(r[2] for r in rows) * 1e6
                per = rows[len(rows) // 2][1]
                print(f"{label:18} {rate:8.0f} keys/s  process CPU {cpu:5.0f} us/key  {per.text()}  "
                      f"(rates {', '.join(f'{r[0]:.0f}' for r in rows)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.release_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.keys, args.rounds))
