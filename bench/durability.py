"""``python -m bench.durability``: what ``sync_interval: always`` costs, on one server and on R3.

For each topology (one embedded nats-server; a 3-node cluster with R3 streams) and each fsync
setting (the server's default, every 2 minutes; ``always``, before every acknowledgement), a fresh
server or cluster on file storage, then two measures:

- *publish loop*: ``--publishes`` JetStream publishes to one stream, each awaited before the next
  (what a producer calling ``enqueue`` one at a time pays per request, less the token);
- *bulk enqueue*: ``--requests`` keyqueue requests over ``--keys`` keys in ``enqueue_many``
  batches of 500 (pipelined publishes, then one token per key per batch).

Each measure runs ``--rounds`` times; the median rate is printed (messages or requests per
second), with the cost of ``always`` as a ratio to the default. docs/decisions.md, "Durability",
has a run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
from nats.js.api import StreamConfig

from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import EmbeddedServer

SETTINGS = (None, "always")
"""The fsync settings compared: the server's default and ``always``."""


@asynccontextmanager
async def servers(nodes: int, sync: str | None, root: Path) -> AsyncIterator[str]:
    """A fresh server (``nodes`` 1) or cluster on file storage under ``root``; yields its URL(s)."""
    if nodes == 1:
        async with EmbeddedServer(store_dir=root / "store", sync_interval=sync) as server:
            yield server.url
    else:
        async with EmbeddedCluster(nodes, store_root=root, sync_interval=sync) as cluster:
            yield cluster.url


async def publish_loop(url: str, replicas: int, count: int, round_: int) -> float:
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream(timeout=10)
        stream = f"SYNC{round_}"
        await js.add_stream(StreamConfig(name=stream, subjects=[f"sync{round_}.>"], num_replicas=replicas))
        payload = b"x" * 256
        started = time.perf_counter()
        for n in range(count):
            await js.publish(f"sync{round_}.{n % 100}", payload)
        return count / (time.perf_counter() - started)
    finally:
        await nc.close()


async def bulk_enqueue(url: str, replicas: int, count: int, keys: int, round_: int) -> float:
    nc = await connect(url, name="bench-durability")
    try:
        config = QueueConfig(f"sync{round_}", replicas=replicas)
        publisher = Publisher(nc, config.names, timeout=10)
        await Topology(publisher.api, config).ensure()
        requests = [OutgoingRequest(f"k{n % keys}", {"Nats-Msg-Id": f"r{round_}-{n}"}, b"x" * 256, f"r{round_}-{n}")
                    for n in range(count)]
        started = time.perf_counter()
        for i in range(0, count, 500):
            results = await publisher.enqueue_many(requests[i:i + 500])
            failed = [r for r in results if isinstance(r, Exception)]
            if failed:
                raise RuntimeError(f"{len(failed)} requests not stored: {failed[0]}")
        return count / (time.perf_counter() - started)
    finally:
        await nc.close()


async def measure(nodes: int, sync: str | None, args: argparse.Namespace) -> tuple[float, float]:
    loops, bulks = [], []
    with tempfile.TemporaryDirectory(prefix="kq-durability-") as tmp:
        async with servers(nodes, sync, Path(tmp)) as url:
            for round_ in range(args.rounds):
                loops.append(await publish_loop(url, nodes, args.publishes, round_))
                bulks.append(await bulk_enqueue(url, nodes, args.requests, args.keys, round_))
    return statistics.median(loops), statistics.median(bulks)


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.durability", description=__doc__.splitlines()[0])
    p.add_argument("--publishes", type=int, default=2000, help="awaited publishes per round (default 2000)")
    p.add_argument("--requests", type=int, default=10_000, help="requests per bulk round (default 10000)")
    p.add_argument("--keys", type=int, default=100, help="keys the bulk requests spread over (default 100)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per measure; the median is shown (default 3)")
    args = p.parse_args(argv)
    print("| servers | fsync | publish loop (msg/s) | bulk enqueue (requests/s) |")
    print("|---|---|---|---|")
    for nodes in (1, 3):
        rates = {sync: await measure(nodes, sync, args) for sync in SETTINGS}
        default, always = rates[None], rates["always"]
        where = "one server" if nodes == 1 else "3 nodes, R3"
        print(f"| {where} | default (2 min) | {default[0]:,.0f} | {default[1]:,.0f} |")
        print(f"| {where} | always | {always[0]:,.0f} ({always[0] / default[0]:.2f}x) | "
              f"{always[1]:,.0f} ({always[1] / default[1]:.2f}x) |")


if __name__ == "__main__":
    asyncio.run(main())
