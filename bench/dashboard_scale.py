"""``python -m bench.dashboard_scale [--keys N] [--held N]``: the dashboard on a queue of 100,000 keys.

A fresh nats-server; ``--keys`` requests stored on as many keys of queue ``scale`` (each with a
customer and a note as arguments); a ``keyqueue worker`` process with ``--held`` slots whose task
never ends, so it holds that many keys and the rest wait; then ``keyqueue dashboard`` as a process.
Once the dashboard has read every key and its search index holds every request, each page is asked
for ``--rounds`` times in a row over HTTP, as a browser would (one request at a time), and the
median and the slowest answer are printed as benchmark rows, with how long the dashboard takes to
read every key and to build its index, and its memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Final

import psutil

import keyqueue
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.server.embedded import EmbeddedServer

REPO: Final = Path(__file__).resolve().parents[1]
KEYQUEUE: Final = str(Path(sys.executable).with_name("keyqueue"))



def define(target: keyqueue.App) -> Any:
    """The queue's one task on ``target``: it holds its key until the worker stops."""

    @target.task(key="{k}")
    async def work(k: str, customer: str, note: str) -> None:
        await asyncio.Event().wait()

    return work


app = keyqueue.App("scale", set_as_default=False, autoload_plugins=False)
"""What the worker process serves (``bench.dashboard_scale:app``)."""
define(app)


def environment(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    return {**env, "KEYQUEUE_URL": url}


async def fetch(url: str) -> tuple[float, str]:
    started = time.perf_counter()
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=60).read().decode())
    return time.perf_counter() - started, body


async def wait_for_line(proc: asyncio.subprocess.Process, pattern: str) -> re.Match[str]:
    assert proc.stderr is not None
    async with asyncio.timeout(120):
        while True:
            line = (await proc.stderr.readline()).decode()
            if not line:
                raise RuntimeError(f"the process ended without printing {pattern!r}")
            if match := re.search(pattern, line):
                return match


async def main(keys: int, held: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store", log_file=Path(tmp) / "log") as server:
            producer = keyqueue.App("scale", url=server.url, set_as_default=False, autoload_plugins=False)
            task = define(producer)
            started = time.perf_counter()
            receipts = []
            for first in range(0, keys, 10_000):
                receipts += await task.enqueue_many(
                    {"k": f"order-{i}", "customer": f"customer {i % 977}", "note": f"parcel {i} of the day"}
                    for i in range(first, min(keys, first + 10_000)))
            print(f"stored {keys:,} requests on {keys:,} keys in {time.perf_counter() - started:.1f}s", file=sys.stderr)
            env = environment(server.url)
            worker = await asyncio.create_subprocess_exec(
                KEYQUEUE, "worker", "bench.dashboard_scale:app", "--concurrency", str(held), "--name", "holder",
                cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
            api = JetStreamApi(await producer.connection())
            async with asyncio.timeout(300):
                # Another process's progress, seen only in the server's counters: polled.
                tokens = "KQ_scale_TOKENS"
                while int((await api.consumer_info(tokens, "workers")).get("num_ack_pending", 0)) < held:  # noqa: ASYNC110
                    await asyncio.sleep(0.5)
                while len(await api.subjects("KQ_scale_LEASES", "kq.scale.lease.>")) < held:  # noqa: ASYNC110
                    await asyncio.sleep(0.5)
            print(f"{held:,} keys held by one worker process", file=sys.stderr)
            dashboard = await asyncio.create_subprocess_exec(
                KEYQUEUE, "dashboard", "--port", "0", cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL)
            base = (await wait_for_line(dashboard, r"keyqueue dashboard on (http://\S+)/")).group(1)
            ready = time.perf_counter()
            async with asyncio.timeout(600):
                while True:
                    _, page = await fetch(base + "/queues/scale/keys")
                    _, found = await fetch(base + "/search?queue=scale&q=parcel+1+of")
                    if f"{keys:,} key(s) with backlog" in page and "index-building" not in found:
                        break
                    await asyncio.sleep(0.5)
            warm = time.perf_counter() - ready
            match = re.search(r"reading every key takes ([\d.]+)s", page)
            wanted = receipts[keys // 2].request_id
            pages = {
                "keys page, first 100 of every key": "/queues/scale/keys",
                f"keys page, the {held:,} held keys": "/queues/scale/keys?state=held",
                "keys page, a name pattern": "/queues/scale/keys?q=order-9999*",
                "keys page, sorted by key, page 500": "/queues/scale/keys?sort=key&page=500",
                "search by argument text": "/search?queue=scale&q=customer+123",
                "search by request id": f"/search?queue=scale&q={wanted}",
                "search by task and key pattern, page 3": "/search?queue=scale&task=work&key=order-1*&page=3",
                "a key's page (why it waits, its runs)": f"/queues/scale/keys/order-{keys - 1}",
                "/health": "/health",
            }
            rows = []
            for label, path in pages.items():
                times = []
                for _ in range(rounds):
                    seconds, _ = await fetch(base + path)
                    times.append(seconds)
                rows.append((label, statistics.median(times), max(times)))
            rss = psutil.Process(dashboard.pid).memory_info().rss / 2**20
            print(f"\n{keys:,} keys in queue scale, {held:,} held by one worker process; `keyqueue dashboard` "
                  f"(refresh 1 s) as a process on the same machine; {rounds} requests per page, one at a time\n")
            print("| page | median | slowest | goal |")
            print("|---|---|---|---|")
            for label, median, worst in rows:
                goal = "<= 1 s " + ("met" if worst <= 1.0 else "NOT met") if "keys page" in label or "search" in label \
                    else ""
                print(f"| {label} | {median * 1000:,.0f} ms | {worst * 1000:,.0f} ms | {goal} |")
            print(f"\nreading every key (one snapshot of the key table): {match.group(1) if match else '< 0.2'} s; "
                  f"from the dashboard's start to every key listed and every request indexed: {warm:.1f} s; "
                  f"dashboard RSS {rss:,.0f} MiB")
            for proc in (dashboard, worker):
                proc.terminate()
                await proc.wait()
            await producer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--held", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.keys, args.held, args.rounds))
