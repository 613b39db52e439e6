"""``python -m bench.workflows``: what a workflow step costs against a plain request.

One process, one embedded nats-server, one in-process worker (``app.worker(concurrency=...)``),
the events plugin off. Each measure runs the same tasks on the same keys twice, alternating:

- **chains**: ``--chains`` chains of 3 steps (``step.s(0, k) | step.s(k) | step.s(k)``, chain
  ``c``'s steps on key ``k<c % keys>``), against ``3 x --chains`` plain requests on the same keys
  stored at once with ``enqueue_many`` (no step waits for another), and against the recipe the
  tutorial had before workflows: each step a task that enqueues the next itself, under an id
  derived from its own (the same dependency, hand-written);
- **chords**: ``--chords`` chords of ``--members`` members each (member ``i`` on key
  ``m<i % keys>``) and a callback summing them, against the members as plain requests and one more.

For each: the time to store them (the producer; for workflows the plan, the first steps and a
start record), the time for the worker to run everything once it starts (for workflows that
includes enqueueing every later step: the worker that finishes a step does it), the worker
process's CPU time per step, and what the workflows stream stored per step. The overhead per
step is the difference of the two run times over the number of steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import keyqueue
from keyqueue import chord
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.server.embedded import EmbeddedServer

START_BATCH = 200
"""Workflows started at once (each start is three awaited writes)."""


@dataclass
class Timing:
    stored: float
    """Seconds to store everything (no worker running)."""
    run: float
    """Seconds from the worker's start until the last step finished."""
    cpu: float
    """This process's CPU seconds over the run (the worker's: the producer is idle meanwhile)."""
    workflow_messages: int = 0
    """Messages the workflows stream stored."""


async def measure(url: str, queue: str, steps: int, store: Callable[[keyqueue.App, dict[str, object]], Awaitable[None]],
                  declare: Callable[[keyqueue.App, asyncio.Event, int], dict[str, object]],
                  concurrency: int) -> Timing:
    app = keyqueue.App(queue, url=url, set_as_default=False, autoload_plugins=False)
    done = asyncio.Event()
    tasks = declare(app, done, steps)
    try:
        began = time.perf_counter()
        await store(app, tasks)
        stored = time.perf_counter() - began
        began, cpu = time.perf_counter(), time.process_time()
        async with app.worker(concurrency=concurrency):
            await asyncio.wait_for(done.wait(), 1800)
            run, used = time.perf_counter() - began, time.process_time() - cpu
        api = JetStreamApi(await app.connection())
        try:
            info = await api.stream_info(f"KQ_{queue}_WORKFLOWS")
            messages = int(info["state"]["last_seq"])
        except keyqueue.StreamNotFound:
            messages = 0
    finally:
        await app.close()
    return Timing(stored, run, used, messages)


def counting(app: keyqueue.App, done: asyncio.Event, total: int) -> dict[str, object]:
    """The benchmark's tasks: ``step`` (adds one) and ``xsum``; ``done`` is set after ``total`` runs."""
    ran = [0]

    def one() -> None:
        ran[0] += 1
        if ran[0] == total:
            done.set()

    @app.task(key="k{key}")
    async def step(value: int, key: int) -> int:
        one()
        return value + 1

    @app.task(key="sum{key}")
    async def xsum(values: list[int], key: int) -> int:
        one()
        return sum(values)

    @app.task(key="k{key}")
    async def linked(ctx: keyqueue.Context, value: int, key: int, left: int) -> int:
        """The tutorial's old recipe: a step that enqueues the next one itself, under an id derived from its own."""
        one()
        if left:
            await linked.options(request_id=f"{ctx.request_id}.n").enqueue(value=value + 1, key=key, left=left - 1)
        return value + 1

    return {"step": step, "xsum": xsum, "linked": linked}


async def chains(url: str, index: int, kind: str, count: int, keys: int, concurrency: int) -> Timing:
    async def plain(app: keyqueue.App, tasks: dict[str, object]) -> None:
        step = tasks["step"]
        await step.enqueue_many([{"value": n, "key": c % keys} for c in range(count) for n in range(3)])  # type: ignore[attr-defined]

    async def linked(app: keyqueue.App, tasks: dict[str, object]) -> None:
        first = tasks["linked"]
        await first.enqueue_many([{"value": 0, "key": c % keys, "left": 2} for c in range(count)])  # type: ignore[attr-defined]

    async def started(app: keyqueue.App, tasks: dict[str, object]) -> None:
        step = tasks["step"]
        for first in range(0, count, START_BATCH):
            await asyncio.gather(*(
                (step.s(0, c % keys) | step.s(c % keys) | step.s(c % keys)).enqueue()  # type: ignore[attr-defined]
                for c in range(first, min(count, first + START_BATCH))))

    store = {"plain": plain, "linked": linked, "workflow": started}[kind]
    return await measure(url, f"wfc{index}", 3 * count, store, counting, concurrency)


async def chords(url: str, index: int, workflow: bool, count: int, members: int, keys: int,
                 concurrency: int) -> Timing:
    async def plain(app: keyqueue.App, tasks: dict[str, object]) -> None:
        step, xsum = tasks["step"], tasks["xsum"]
        await step.enqueue_many([{"value": i, "key": i % keys} for _ in range(count) for i in range(members)])  # type: ignore[attr-defined]
        await xsum.enqueue_many([{"values": list(range(members)), "key": c} for c in range(count)])  # type: ignore[attr-defined]

    async def started(app: keyqueue.App, tasks: dict[str, object]) -> None:
        step, xsum = tasks["step"], tasks["xsum"]
        await asyncio.gather(*(chord([step.s(i, i % keys) for i in range(members)], xsum.s(c)).enqueue()  # type: ignore[attr-defined]
                               for c in range(count)))

    return await measure(url, f"wfh{index}", count * (members + 1), started if workflow else plain, counting,
                         concurrency)


def report(name: str, steps: int, plain: list[Timing], flows: list[Timing], label: str = "plain") -> None:
    p_run, w_run = statistics.median(t.run for t in plain), statistics.median(t.run for t in flows)
    p_store, w_store = statistics.median(t.stored for t in plain), statistics.median(t.stored for t in flows)
    p_cpu, w_cpu = statistics.median(t.cpu for t in plain), statistics.median(t.cpu for t in flows)
    messages = statistics.median(t.workflow_messages for t in flows)
    print(f"{name}: {steps:,} steps, workflows against {label}")
    print(f"  stored:  {label} {p_store:.2f}s   workflows {w_store:.2f}s")
    print(f"  run:     {label} {p_run:.2f}s ({steps / p_run:,.0f} req/s)   workflows {w_run:.2f}s "
          f"({steps / w_run:,.0f} steps/s)")
    print(f"  overhead per step: {(w_run - p_run) / steps * 1e6:,.0f} us of run time "
          f"({w_run / p_run:.2f}x), worker CPU {p_cpu / steps * 1e6:,.0f} -> {w_cpu / steps * 1e6:,.0f} us/step")
    print(f"  workflows stream: {messages / steps:.2f} records per step")


async def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("KEYQUEUE_EVENTS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedServer(store_dir=Path(tmp) / "store", log_file=Path(tmp) / "log") as server:
            runs: dict[str, list[Timing]] = {"plain": [], "linked": [], "workflow": []}
            for index in range(3 * args.rounds):
                kind = list(runs)[index % 3]
                runs[kind].append(await chains(server.url, index, kind, args.chains, args.keys, args.concurrency))
            name = f"{args.chains:,} chains of 3 steps on {args.keys:,} keys"
            report(name, 3 * args.chains, runs["plain"], runs["workflow"], "plain requests stored at once")
            report(name, 3 * args.chains, runs["linked"], runs["workflow"],
                   "steps that enqueue the next themselves")
            plain: list[Timing] = []
            flows: list[Timing] = []
            for index in range(2 * args.rounds):
                workflow = index % 2 == 1
                timing = await chords(server.url, index, workflow, args.chords, args.members, args.keys,
                                      args.concurrency)
                (flows if workflow else plain).append(timing)
            report(f"{args.chords:,} chord(s) of {args.members:,} members on {args.keys:,} keys",
                   args.chords * (args.members + 1), plain, flows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=10_000)
    parser.add_argument("--chords", type=int, default=1)
    parser.add_argument("--members", type=int, default=1_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=1, help="Rounds of each (plain, workflows), alternating.")
    parser.add_argument("--concurrency", type=int, default=64)
    started = time.perf_counter()
    asyncio.run(main(parser.parse_args()))
    print(f"({time.perf_counter() - started:.0f} s in all)")
