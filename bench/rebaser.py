"""Workload 7: the Rebaser, update requests per second with DVU coalescing on 50 change sets.

One worker (in this process, the Rebaser plugin on its own queue) and one producer. Each change
set first gets the graph of ``keyqueue_rebaser.workload.setup_updates``; then, timed, every change
set gets ``per_change_set`` single-value updates enqueued at once, interleaved across change
sets, and finally one request that waits for the DVU run covering it. The figure is update
requests per second from the first enqueue to the last covering DVU; the detail says how many
DVU triggers ran as how many runs (coalescing).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from keyqueue import App
from keyqueue_rebaser import RebaserClient, Update
from keyqueue_rebaser.plugin import RebaserPlugin
from keyqueue_rebaser.workload import INPUTS, setup_updates


@dataclass(frozen=True)
class RebaserResult:
    rate: float
    requests: int
    change_sets: int
    triggers: int
    runs: int


async def rebaser_run(url: str, change_sets: int, per_change_set: int) -> RebaserResult:
    app = App("bench-rebaser", url=url, plugins=[RebaserPlugin()], set_as_default=False, autoload_plugins=False)
    rng = random.Random(7)
    names = [("bench", f"cs{i:03d}") for i in range(change_sets)]
    try:
        async with app.worker(concurrency=max(16, change_sets)), await RebaserClient.connect(url) as client:
            for workspace, change_set in names:
                await client.enqueue_updates(workspace, change_set, setup_updates(), timeout=60)
            start = time.perf_counter()
            burst = [(w, c, [Update.set_value(rng.choice(INPUTS), rng.randint(0, 100))])
                     for _ in range(per_change_set) for w, c in names]
            await client.enqueue_many(burst)
            finals = await client.enqueue_many([(w, c, [Update.set_value(INPUTS[0], 1)]) for w, c in names],
                                               await_dvu=True, timeout=120)
            elapsed = time.perf_counter() - start
            failed = [f for f in finals if isinstance(f, Exception) or getattr(f, "status", "") != "success"]
            if failed:
                raise RuntimeError(f"{len(failed)} change set(s) did not finish: {failed[:3]}")
            states = [await client.snapshot(w, c) for w, c in names]
    finally:
        await app.close()
    requests = len(burst) + len(names)
    return RebaserResult(requests / elapsed, requests, change_sets,
                         sum(s.triggers for s in states), sum(s.dvu_runs for s in states))
