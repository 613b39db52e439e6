"""``python -m bench.user_path``: the path users run, next to raw JetStream in the same run.

One embedded nats-server; raw work-queue fetch(200)+ack (``bench.raw``); then ``keyqueue worker
bench.user_app:app`` (one process, or ``--processes N``; the default processor, hooks and the events
plugin as installed) serving a no-op ``@app.task``, fed by ``Task.enqueue_many``:

- hot keys: 100 keys x 100 requests (``--hot-keys``, ``--hot-per-key``);
- cold keys: 5,000 keys x 1 request (``--cold-keys``);
- unkeyed: 10,000 requests of a no-op task declared without ``key=`` (``--unkeyed``), which the
  worker's unkeyed lane runs with no lock at all (fetch + ack).

Each workload is stored first while the worker processes are paused (SIGSTOP), then timed from
their resumption until the inbox and the token stream are empty: the way raw fetch+ack and the
core's rows are timed. With ``--end-to-end`` (the default) it is then run again stored and served
at once, timed from the first enqueue (the producer shares the machine's cores). Besides the rates
it prints the workers' CPU time per request over the same span (user + system, from the kernel),
which other load on a shared machine disturbs much less than the wall clock. ``--profile FILE``
runs the worker under cProfile and writes its statistics to FILE (the rates are then not
comparable). ``--core`` also runs the core alone (``bench.worker``) on the cold keys, after the
product path, and prints its CPU per key beside the product path's. ``--peers`` then runs Celery,
Dramatiq and procrastinate (``bench.peers``) on the same two workloads and prints keyqueue beside
them and raw fetch+ack: ``--hot-per-key 200 --cold-keys 2000 --peers`` is the comparison ``make
bench`` makes, alone. ``make bench`` runs :func:`measure` too, as its *product path* rows beside
the core's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import raw, server_counters, user_app
from bench.server_counters import PerUnit
from bench.user_app import app, note
from keyqueue.admin.workers import queue_workers
from keyqueue.errors import JetStreamUnavailable, KeyqueueTimeout, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.server.embedded import EmbeddedServer


async def _drained(api: JetStreamApi, timeout: float = 120.0) -> int:
    """Wait until the queue's inbox, token stream and work stream are empty; returns the API calls it made
    (which the server counts with the workload's: they are taken off its figures)."""
    names = app.queue_config("userpath").names
    deadline = time.monotonic() + timeout
    calls = 0
    while time.monotonic() < deadline:
        calls += 3
        try:
            inbox = await api.stream_info(names.inbox_stream)
            tokens = await api.stream_info(names.token_stream)
            try:
                unkeyed = int((await api.stream_info(names.work_stream))["state"]["messages"])
            except StreamNotFound:  # made by the worker's unkeyed lane, or the first unkeyed enqueue
                unkeyed = 0
        except (KeyqueueTimeout, JetStreamUnavailable):  # on a cluster, a stream just made elects its leader
            await asyncio.sleep(0.1)
            continue
        # A key given back leaves a release marker for a second: not a request (read by direct gets,
        # which the server does not count as API calls).
        if unkeyed == 0 and tokens["state"]["messages"] == 0 and (inbox["state"]["messages"] == 0
                                                                  or await requests_waiting(api, names) == 0):
            return calls
        await asyncio.sleep(0.005)
    raise TimeoutError("the worker did not drain the queue")


class _Workers:
    """The ``keyqueue worker`` processes serving the queue (the command's process, and with
    ``--processes N`` its N children), for CPU time and for pausing them while requests are stored."""

    def __init__(self, pid: int, processes: int) -> None:
        self.root = psutil.Process(pid)
        self.processes = processes

    def serving(self) -> list[psutil.Process]:
        return self.root.children() if self.processes > 1 else [self.root]

    def cpu(self) -> float:
        total = 0.0
        for proc in [self.root, *self.root.children()]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += float(times.user + times.system)
        return total

    def pause(self) -> None:
        for proc in self.serving():
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        for proc in self.serving():
            proc.send_signal(signal.SIGCONT)


@dataclass(frozen=True)
class Workload:
    """One timed workload: requests per second, and CPU microseconds per request."""

    rate: float
    """Requests stored first, then served: from the workers' resumption until the queue is empty
    (how raw fetch+ack and the core's rows are timed)."""
    cpu_us: float
    """The worker processes' CPU time per request over that span."""
    enqueue_cpu_us: float
    """The producer's (this process's) CPU time per request in ``enqueue_many``."""
    end_to_end: float = float("nan")
    """Requests stored and served at once: from the first enqueue until the queue is empty."""
    server: PerUnit | None = None
    """What the server saw per request, enqueue included (stored first: producer and workers alone)."""


def _items(keys: int, per_key: int, tag: str) -> list[dict[str, Any]]:
    return [{"k": f"{tag}{k}", "i": i} for i in range(per_key) for k in range(keys)]


async def _timed(api: JetStreamApi, workers: _Workers, keys: int, per_key: int, tag: str,
                 end_to_end: bool, monitoring: Sequence[str], task: str = "note") -> Workload:
    if keys * per_key == 0:
        return Workload(float("nan"), float("nan"), float("nan"))
    enqueue_many = app.tasks[task].enqueue_many
    items = _items(keys, per_key, tag)
    # Stored first, with the workers paused (SIGSTOP: their subscriptions and pull requests stay
    # open), then served: the span is the workers' alone, as raw fetch+ack's and the core's are.
    workers.pause()
    try:
        before = await server_counters.snapshot(monitoring) if monitoring else None
        sent = api.nc.stats["out_msgs"]  # the polls below go on this connection alone
        producer = time.process_time()
        await enqueue_many(items)
        producer = time.process_time() - producer
    finally:
        workers.resume()
    cpu, began = workers.cpu(), time.perf_counter()
    polls = await _drained(api)
    elapsed = time.perf_counter() - began
    server = None
    if before is not None:
        server = (await server_counters.snapshot(monitoring) - before).per(
            len(items), extra_api=polls, extra_msgs=api.nc.stats["out_msgs"] - sent)
    stored_first = Workload(len(items) / elapsed, (workers.cpu() - cpu) / len(items) * 1e6,
                            producer / len(items) * 1e6, server=server)
    if not end_to_end:
        return stored_first
    items = _items(keys, per_key, tag + "e")
    began = time.perf_counter()
    await enqueue_many(items)
    await _drained(api)
    return dataclasses.replace(stored_first, end_to_end=len(items) / (time.perf_counter() - began))


@dataclass(frozen=True)
class ProductRates:
    """Requests per second through ``keyqueue worker``, plugins as installed."""

    hot: float
    cold: float
    hot_cpu_us: float = 0.0
    """The workers' CPU time per request (user + system), microseconds, over the hot workload."""
    cold_cpu_us: float = 0.0
    """The same over the cold workload."""
    enqueue_cpu_us: float = 0.0
    """The producer's CPU time per request in ``Task.enqueue_many`` (both workloads), microseconds."""
    hot_end_to_end: float = float("nan")
    """Hot keys stored and served at once (the producer on the same machine), requests per second."""
    cold_end_to_end: float = float("nan")
    hot_server: PerUnit | None = None
    """What the server saw per hot request (``bench.server_counters``), with a monitoring URL."""
    cold_server: PerUnit | None = None
    """The same per cold key (one request each)."""
    unkeyed: float = float("nan")
    """Requests of an unkeyed task (no key, no lock) per second, stored first."""
    unkeyed_cpu_us: float = float("nan")
    """The workers' CPU time per unkeyed request, microseconds."""
    unkeyed_end_to_end: float = float("nan")
    """Unkeyed requests stored and served at once, requests per second."""
    unkeyed_server: PerUnit | None = None
    """What the server saw per unkeyed request (enqueue included)."""


async def _registered(api: JetStreamApi, count: int, timeout: float = 60.0) -> None:
    """Wait until ``count`` workers of the queue have written their first heartbeat record."""
    deadline = time.monotonic() + timeout
    while len([w for w in await queue_workers(api, "userpath") if w.live]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} keyqueue workers registered within {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def measure(url: str, hot_keys: int, hot_per_key: int, cold_keys: int, profile: Path | None = None, *,
                  processes: int = 1, end_to_end: bool = True, monitoring: str | Sequence[str] = (),
                  loop: str | None = None, task: str = "note", replicas: int = 1, unkeyed: int = 0,
                  py_spy: Path | None = None) -> ProductRates:
    """Start ``keyqueue worker bench.user_app:app`` on ``url`` (``--processes``, ``--loop``); time the
    hot then the cold workload of ``task``, then ``unkeyed`` requests of the unkeyed no-op task, each
    stored first, then (``end_to_end``) again stored and served at once. With ``monitoring`` (the
    server's monitoring URL, or every cluster member's), also what the server saw per request.
    ``replicas``: the queue's stream replicas (3 on a cluster). ``py_spy``: sample the worker with
    py-spy (from its registration to its end; collapsed stacks, native frames left out) to this file."""
    app.settings = app.settings.with_url(url)
    user_app.configure(replicas)
    env = {**os.environ, "KEYQUEUE_URL": url, user_app.REPLICAS_ENV: str(replicas)}
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    loop_args = ["--loop", loop] if loop else []
    worker = await asyncio.create_subprocess_exec(
        sys.executable, *profiler, "-m", "keyqueue.cli", "worker", "bench.user_app:app", "--concurrency", "128",
        "--processes", str(processes), "--log-level", "warning", *loop_args, env=env)
    urls = [monitoring] if isinstance(monitoring, str) else list(monitoring)
    nc = await connect(url)
    api = JetStreamApi(nc)
    sampler = None
    try:
        await note.enqueue(k="warmup", i=0)  # the worker is up once it has taken this
        await _drained(api, timeout=60)
        await _registered(api, processes)
        workers = _Workers(worker.pid, processes)
        if py_spy is not None:
            sampler = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(worker.pid), "--rate", "500",
                "--format", "raw", "--nonblocking",
                "--output", str(py_spy), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        hot = await _timed(api, workers, hot_keys, hot_per_key, "h", end_to_end, urls, task)
        cold = await _timed(api, workers, cold_keys, 1, "c", end_to_end, urls, task)
        plain = await _timed(api, workers, 1, unkeyed, "u", end_to_end, urls, "unkeyed_note")
    finally:
        worker.terminate()
        async with asyncio.timeout(60):
            await worker.wait()
        if sampler is not None:
            async with asyncio.timeout(60):
                await sampler.wait()  # it ends with the process it samples, writing its file
        await nc.close()
        await app.close()
    enqueue = (hot.enqueue_cpu_us * hot_keys * hot_per_key + cold.enqueue_cpu_us * cold_keys) / (
        hot_keys * hot_per_key + cold_keys) if hot_keys * hot_per_key and cold_keys else hot.enqueue_cpu_us
    return ProductRates(hot.rate, cold.rate, hot.cpu_us, cold.cpu_us, enqueue, hot.end_to_end, cold.end_to_end,
                        hot.server, cold.server, plain.rate, plain.cpu_us, plain.end_to_end, plain.server)


@contextlib.asynccontextmanager
async def servers(cluster: bool, scratch: Path) -> AsyncIterator[tuple[str, list[str], int | None]]:
    """One embedded nats-server, or (``cluster``) a 3-node cluster: its URL, monitoring URLs and (one
    server) its pid."""
    if cluster:
        from keyqueue.server.cluster import EmbeddedCluster

        async with EmbeddedCluster(3, store_root=scratch / "r3") as nodes:
            yield nodes.url, [s.monitoring_url for s in nodes.servers], None
    else:
        async with EmbeddedServer(store_dir=scratch / "store") as server:
            yield server.url, [server.monitoring_url], server.pid


async def core_cold(url: str, monitoring_url: str, server_pid: int, keys: int, scratch: Path, *,
                    queue: str = "corecold", loop: str | None = None) -> tuple[float, float]:
    """The core alone on the cold workload, beside the product path: ``bench.worker`` (a QueueWorker
    with a no-op processor, no app, no hooks, no events) with the product path's 128 slots, on the
    event loop ``loop`` (None: the default, as ``keyqueue worker``'s), ``keys`` keys x 1 stored
    first. Its rate and its worker's CPU per key (us)."""
    from bench.fleet import WorkerOptions
    from bench.workloads import Bench, interleaved, keyed_run

    nc = await connect(url, name="bench-core-producer")
    try:
        (scratch / queue).mkdir(exist_ok=True)
        b = Bench(url, monitoring_url, server_pid, nc, scratch / queue, WorkerOptions(concurrency=128, loop=loop))
        run = await keyed_run(b, queue, interleaved(keys, 1, "core"), 1)
    finally:
        await nc.close()
    if run.note or run.check.summary() != "order kept, exclusive":
        raise RuntimeError(f"the core's cold run: {run.check.summary()} {run.note}")
    return run.rate, run.worker_cpu / run.rate * 1e6


async def main(args: argparse.Namespace) -> None:
    replicas = 3 if args.cluster else 1
    with tempfile.TemporaryDirectory() as tmp:
        async with servers(args.cluster, Path(tmp)) as (url, monitoring, server_pid):
            rates = await raw.measure(url, args.raw, monitoring=monitoring, replicas=replicas)
            product = await measure(url, args.hot_keys, args.hot_per_key, args.cold_keys, args.profile,
                                    processes=args.processes, end_to_end=args.end_to_end,
                                    monitoring=monitoring, loop=args.loop, task=args.task,
                                    unkeyed=args.unkeyed, py_spy=args.py_spy, replicas=replicas)
            core = None
            if args.core:
                if server_pid is None:
                    raise SystemExit("--core runs on one server only (not with --cluster)")
                core = await core_cold(url, monitoring[0], server_pid, args.cold_keys, Path(tmp), loop=args.loop)
    hot = f"hot keys {args.hot_keys} x {args.hot_per_key}"
    cold = f"cold keys {args.cold_keys:,} x 1"
    plain = f"unkeyed {args.unkeyed:,}"
    print(f"{'raw fetch(200)+ack':26} {rates.fetch_ack:9,.0f} msg/s")
    for label, rate, cpu, both in ((hot, product.hot, product.hot_cpu_us, product.hot_end_to_end),
                                   (cold, product.cold, product.cold_cpu_us, product.cold_end_to_end),
                                   (plain, product.unkeyed, product.unkeyed_cpu_us, product.unkeyed_end_to_end)):
        at_once = ("" if math.isnan(both) else
                   f"  stored and served at once {both:7,.0f} req/s {both / rates.fetch_ack:.2f}x")
        print(f"{label:26} {rate:9,.0f} req/s  {rate / rates.fetch_ack:.2f}x raw  worker CPU {cpu:5.0f} us/req"
              + at_once)
    if core is not None:
        rate, cpu = core
        print(f"{'core alone, ' + cold:26} {rate:9,.0f} req/s  {rate / rates.fetch_ack:.2f}x raw  worker CPU "
              f"{cpu:5.0f} us/req  (the product path's CPU per cold key {product.cold_cpu_us / cpu:.2f}x the core's)")
    print(f"{'enqueue_many (producer)':26} CPU {product.enqueue_cpu_us:5.0f} us/req")
    for label, per in (("raw fetch+ack, per msg", rates.server), ("hot, per request", product.hot_server),
                       ("cold, per key", product.cold_server), ("unkeyed, per request", product.unkeyed_server)):
        if per is not None:
            print(f"{label:26} {per.text()}")
    if args.peers:
        from bench import report
        from bench.peers import Workload, compare, run_peers

        workloads = [Workload("hot keys", args.hot_keys, args.hot_per_key), Workload("cold keys", args.cold_keys, 1)]
        with tempfile.TemporaryDirectory() as tmp:
            results = await run_peers(workloads, Path(tmp), lambda text: print(text, file=sys.stderr, flush=True))
        for result in results:
            if math.isnan(result.rate):
                print(f"{result.name} ({result.workload}): {result.detail}")
            elif result.check != "order kept, exclusive":
                print(f"{result.name} ({result.workload}): {result.check}")
        print()
        print(report.versus_table([compare(w, rates.fetch_ack, rate, results)
                                   for w, rate in zip(workloads, (product.hot, product.cold), strict=True)]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.user_path", description=__doc__.splitlines()[0])
    parser.add_argument("--hot-keys", type=int, default=100)
    parser.add_argument("--hot-per-key", type=int, default=100)
    parser.add_argument("--cold-keys", type=int, default=5000)
    parser.add_argument("--unkeyed", type=int, default=10_000, help="requests of an unkeyed task (no key)")
    parser.add_argument("--processes", type=int, default=1, help="keyqueue worker --processes")
    parser.add_argument("--end-to-end", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each workload stored and served at once")
    parser.add_argument("--raw", type=int, default=20_000, help="messages for raw fetch(200)+ack")
    parser.add_argument("--profile", type=Path, help="run the worker under cProfile, statistics to this file")
    parser.add_argument("--py-spy", type=Path, help="sample the worker with py-spy, collapsed stacks to this file")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default=None, help="keyqueue worker --loop")
    parser.add_argument("--task", choices=("note", "io_note", "unkeyed_note"), default="note",
                        help="note: a no-op; io_note: awaits 1 ms; unkeyed_note: a no-op without a key")
    parser.add_argument("--cluster", action="store_true",
                        help="on a 3-node cluster with R3 streams (raw fetch+ack too), not one server")
    parser.add_argument("--core", action="store_true",
                        help="also run the core alone (bench.worker: a QueueWorker, no-op processor, 128 slots) on "
                             "the cold keys, after the product path: how much of a cold key's CPU is above the core")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=False,
                        help="also run Celery, Dramatiq and procrastinate on both workloads, and print the ratios")
    asyncio.run(main(parser.parse_args()))
