"""``python -m bench.quiescence [--runs 6] [--keys 300] [--single]``: the quiescence race, measured.

Each key's first request enqueues the key's second from inside its task, a few milliseconds after
it returns: right as a ``--linger 0`` worker gives the key back (acks its token, re-checks the
inbox). Two ``keyqueue worker`` processes serve a 3-node cluster with R3 streams (``--single``: one
server). For each key it measures how long the second request waited from the moment its enqueue
returned until it started: a request left without a token waits for a reconciler sweep (30 s).
Prints per run the p50, p99 and max wait and how many keys waited more than 2 s (the bound a strand may last).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import EmbeddedServer

APP = '''
import asyncio
import json
import os
import random
import time

import keyqueue
from keyqueue.jetstream.topology import QueueConfig

app = keyqueue.App("race", set_as_default=False)
app.configure_queue(QueueConfig(os.environ["RACE_QUEUE"], replicas=int(os.environ["RACE_REPLICAS"])))
LOG = os.environ["RACE_LOG"]
_pending = set()


def note(**fields):
    with open(LOG, "a") as log:
        log.write(json.dumps({"t": time.time(), **fields}) + "\\n")


@app.task(queue=os.environ["RACE_QUEUE"], key="{key}", max_attempts=1)
async def step(key: str, n: int) -> None:
    note(event="start", key=key, n=n)
    if n == 1:
        task = asyncio.get_running_loop().create_task(_successor(key))
        _pending.add(task)
        task.add_done_callback(_pending.discard)


async def _successor(key: str) -> None:
    await asyncio.sleep(random.uniform(0, 0.004))  # the session is acking its token about now
    await step.enqueue(key=key, n=2)
    note(event="stored", key=key, n=2)
'''


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def one_run(url: str, replicas: int, keys: int, run: int, workdir: Path) -> list[float]:
    queue = f"race{run}"
    log = workdir / f"{queue}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=url, RACE_QUEUE=queue, RACE_REPLICAS=str(replicas), RACE_LOG=str(log),
               KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(workdir))
    keyqueue = str(Path(sys.executable).with_name("keyqueue"))
    workers = [await asyncio.create_subprocess_exec(keyqueue, "worker", "race_app:app", "--linger", "0",
                                                    "--concurrency", "64", "--name", f"w{i}", env=env, cwd=workdir,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
               for i in range(2)]
    try:
        for worker in workers:
            assert worker.stderr is not None
            while b"serving queue" not in (line := await asyncio.wait_for(worker.stderr.readline(), 60)):
                if not line:
                    raise RuntimeError("a worker exited before serving its queue")
        os.environ.update(RACE_QUEUE=queue, RACE_REPLICAS=str(replicas), RACE_LOG=str(log))
        spec = importlib.util.spec_from_file_location(f"race_app_{queue}", workdir / "race_app.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.app.settings = module.app.settings.with_url(url)
        try:
            await module.step.enqueue_many([{"key": f"k{n}", "n": 1} for n in range(keys)])
        finally:
            await module.app.close()
        deadline = time.monotonic() + 90
        while True:
            records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            started = {r["key"]: r["t"] for r in records if r["event"] == "start" and r["n"] == 2}
            if len(started) >= keys or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        stored = {r["key"]: r["t"] for r in records if r["event"] == "stored"}
        return [started.get(key, time.time()) - t for key, t in stored.items()]
    finally:
        for worker in workers:
            worker.terminate()
            assert worker.stderr is not None
            rest = await worker.stderr.read()
            if os.environ.get("RACE_DEBUG"):
                sys.stderr.write(rest.decode(errors="replace")[-3000:])
            await worker.wait()


async def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quiescence", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--single", action="store_true", help="one server instead of a 3-node R3 cluster")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "race_app.py").write_text(APP)
        server: EmbeddedServer | EmbeddedCluster = EmbeddedServer() if args.single else EmbeddedCluster(3)
        async with server:
            replicas = 1 if args.single else 3
            where = "one server" if args.single else "3-node cluster, R3 streams"
            print(f"quiescence race: {args.keys} keys, 2 keyqueue worker processes --linger 0, {where}")
            for run in range(args.runs):
                waits = await one_run(server.url, replicas, args.keys, run, workdir)
                over = sum(w > 2.0 for w in waits)
                print(f"run {run + 1}: {len(waits)} second requests waited p50 {percentile(waits, 0.5) * 1000:.0f} ms, "
                      f"p99 {percentile(waits, 0.99) * 1000:.0f} ms, max {max(waits) * 1000:.0f} ms; "
                      f"over 2 s: {over}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
