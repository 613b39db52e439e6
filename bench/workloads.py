"""keyqueue's workloads 1-6 (the rows numbered so in docs/benchmarks.md), driven through the core classes.

Producers run in this process on keyqueue's :class:`~keyqueue.jetstream.publish.Publisher`;
workers are separate OS processes (:mod:`bench.worker`). Each workload gets its own queue on the
run's one nats-server, so nothing left behind by one workload (a held token, say) touches another.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
from nats.aio.client import Client
from ulid import ULID

from bench.fleet import Fleet, WorkerOptions
from bench.records import Check, Record, body, check, latencies_ms, percentile, span_rate
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.wire import headers as H

MESSAGE_TYPE = "bench.noop"


def outgoing(key: str, index: int, stamp: int = 0) -> OutgoingRequest:
    """A request as the task API would send it: the wire format's headers and a tiny body."""
    rid = str(ULID())
    headers = {H.CONTENT_TYPE: H.JSON, H.MESSAGE_TYPE: MESSAGE_TYPE, H.MESSAGE_VERSION: "1", H.MSG_ID: rid}
    return OutgoingRequest(key, headers, body(index, stamp), rid)


def interleaved(keys: int, per_key: int, prefix: str) -> list[OutgoingRequest]:
    """``per_key`` requests for each of ``keys`` keys, round-robin, as concurrent producers would."""
    return [outgoing(f"{prefix}{k}", i) for i in range(per_key) for k in range(keys)]


@dataclass
class Bench:
    """What every workload needs: the server, a producer connection, a scratch directory."""

    url: str
    monitoring_url: str
    server_pid: int
    nc: Client
    work_dir: Path
    options: WorkerOptions

    @property
    def api(self) -> JetStreamApi:
        return JetStreamApi(self.nc, timeout=10)

    async def queue(self, name: str) -> tuple[QueueConfig, Publisher]:
        config = QueueConfig(name, ack_wait=self.options.ack_wait)
        await Topology(self.api, config).ensure()
        return config, Publisher(self.nc, config.names, timeout=10)

    def fleet(self, queue: str, size: int = 1, **overrides: Any) -> Fleet:
        return Fleet(self.url, queue, size, self.work_dir, replace(self.options, **overrides))

    async def inbox_empty(self, config: QueueConfig, timeout: float) -> bool:
        """Wait until every request of the queue was deleted (ran); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = await self.api.stream_info(config.names.inbox_stream)
            if info["state"]["messages"] == 0 or await self.pending_requests(config) == 0:
                return True
            await asyncio.sleep(0.02)
        return False

    async def pending_requests(self, config: QueueConfig) -> int:
        """Requests stored and not yet run (release markers, which live a second, left out)."""
        info = await self.api.stream_info(config.names.inbox_stream)
        if int(info["state"]["messages"]) > 1000:
            return int(info["state"]["messages"])  # too many to read: a marker or two do not matter
        return await requests_waiting(self.api, config.names)

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.monitoring_url}/varz", timeout=5) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data


@dataclass
class Throughput:
    """A keyed run: its rate, its records, and whether it kept order and exclusivity."""

    rate: float
    records: list[Record]
    check: Check
    finished: bool
    note: str = ""
    worker_cpu: float = 0.0
    """CPU seconds per wall second of the worker processes (1.0 = one core busy) while they ran."""
    server_cpu: float = 0.0
    """The same for nats-server."""

    def cpu(self) -> str:
        return f"CPU: workers {self.worker_cpu:.0%}, nats-server {self.server_cpu:.0%} of a core"


async def keyed_run(b: Bench, queue: str, requests: list[OutgoingRequest], processes: int,
                    **overrides: Any) -> Throughput:
    """Store every request, then let ``processes`` workers loose on them; rate = first start to last end."""
    config, pub = await b.queue(queue)
    results = await pub.enqueue_many(requests)
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"enqueue_many refused {len(errors)} requests, first: {errors[0]}")
    async with b.fleet(queue, processes, **overrides) as fleet:
        meter = CpuMeter([*fleet.pids], b.server_pid)
        await fleet.go()
        finished = await b.inbox_empty(config, timeout=max(30.0, len(requests) / 100))
        worker_cpu, server_cpu = meter.read()
        left = 0 if finished else await b.pending_requests(config)
        records = await fleet.stop()
    note = "" if finished else f"timed out with {left} of {len(requests)} requests not run"
    if processes > 1:
        note = f"requests per process {' / '.join(f'{n:,}' for n in fleet.per_process)}; {note}".rstrip("; ")
    return Throughput(span_rate(records), records, check(records, len(requests)), finished, note,
                      worker_cpu, server_cpu)


class CpuMeter:
    """CPU time used by the workers and the server between its creation and :meth:`read`."""

    def __init__(self, worker_pids: list[int], server_pid: int) -> None:
        self.workers = [psutil.Process(pid) for pid in worker_pids]
        self.server = psutil.Process(server_pid)
        self.start = time.monotonic()
        self.worker_start = self._used(self.workers)
        self.server_start = self._used([self.server])

    @staticmethod
    def _used(procs: list[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            times = proc.cpu_times()
            total += times.user + times.system
        return total

    def read(self) -> tuple[float, float]:
        wall = max(1e-9, time.monotonic() - self.start)
        return ((self._used(self.workers) - self.worker_start) / wall,
                (self._used([self.server]) - self.server_start) / wall)


async def enqueue_rates(b: Bench, bulk: int, single: int, keys: int = 1000) -> tuple[float, float]:
    """``enqueue_many`` and sequential ``enqueue`` rates, requests/s, no worker running."""
    _, pub = await b.queue("bulk")
    requests = [outgoing(f"b{i % keys}", i // keys) for i in range(bulk)]
    t0 = time.perf_counter()
    await pub.enqueue_many(requests)
    bulk_rate = bulk / (time.perf_counter() - t0)
    _, pub = await b.queue("single")
    requests = [outgoing(f"s{i % keys}", i // keys) for i in range(single)]
    t0 = time.perf_counter()
    for request in requests:
        await pub.enqueue(request)
    single_rate = single / (time.perf_counter() - t0)
    return bulk_rate, single_rate


async def probe(pub: Publisher, count: int, interval: float, prefix: str,
                keep_going: asyncio.Event | None = None) -> int:
    """Enqueue ``count`` stamped requests, each to a fresh key, ``interval`` apart; returns how many."""
    sent = 0
    for i in range(count):
        if keep_going is not None and keep_going.is_set():
            break
        await pub.enqueue(outgoing(f"{prefix}{i}", 0, time.monotonic_ns()))
        sent += 1
        await asyncio.sleep(interval)
    return sent


@dataclass
class Latency:
    idle_ms: list[float]
    loaded_ms: list[float]
    load: Throughput
    loaded_probes: int


async def latency(b: Bench, probes: int, interval: float, hot_keys: int, hot_per_key: int) -> Latency:
    """Enqueue-to-start latency on an idle worker, then while it works through the hot-key load."""
    config, pub = await b.queue("lat_idle")
    async with b.fleet("lat_idle") as fleet:
        await fleet.go()
        await asyncio.sleep(0.2)
        await probe(pub, probes, interval, "p")
        await b.inbox_empty(config, timeout=30)
        idle = latencies_ms(await fleet.stop())

    config, pub = await b.queue("lat_load")
    load = interleaved(hot_keys, hot_per_key, "h")
    await pub.enqueue_many(load)
    done = asyncio.Event()
    async with b.fleet("lat_load") as fleet:
        await fleet.go()
        prober = asyncio.create_task(probe(pub, probes * 10, interval, "p", keep_going=done))
        finished = await b.inbox_empty(config, timeout=max(30.0, len(load) / 100))
        done.set()
        await prober
        await b.inbox_empty(config, timeout=10)
        records = await fleet.stop()
    hot = [r for r in records if r.key.startswith("h")]
    if hot:
        first, last = min(r.start_ns for r in hot), max(r.end_ns for r in hot)
        probes_in_load = [r for r in records if r.key.startswith("p") and first <= r.enqueued_ns <= last]
    else:
        probes_in_load = []
    load_run = Throughput(span_rate(hot), hot, check(hot, len(load)), finished)
    return Latency(idle, latencies_ms(probes_in_load), load_run, len(probes_in_load))


@dataclass
class Held:
    keys: int
    held: int
    rss_idle_mb: float
    rss_held_mb: float
    consumers: int
    subscriptions_idle: int
    subscriptions_held: int
    acquire_rate: float
    note: str = ""

    @property
    def kb_per_key(self) -> float:
        return (self.rss_held_mb - self.rss_idle_mb) * 1024 / max(1, self.held)


async def held_keys(b: Bench, keys: int) -> Held:
    """``keys`` keys held at once by one worker process: its RSS per held key, the server's consumers."""
    config, pub = await b.queue("held")
    # A long linger keeps every session open after its one request: each key stays held.
    async with b.fleet("held", concurrency=keys, linger=600.0, kill_on_stop=True) as fleet:
        await fleet.go()
        await asyncio.sleep(1.0)
        proc = psutil.Process(fleet.pids[0])
        rss_idle = proc.memory_info().rss / 2**20
        subs_idle = int(b.varz().get("subscriptions", 0))
        t0 = time.perf_counter()
        await pub.enqueue_many(outgoing(f"k{i}", 0) for i in range(keys))
        held = 0
        deadline = time.monotonic() + max(60.0, keys / 100)
        while time.monotonic() < deadline:
            info = await b.api.consumer_info(config.names.token_stream, config.names.consumer)
            held = int(info.get("num_ack_pending", 0))
            if held >= keys and await b.pending_requests(config) == 0:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
        # Each session, once its request ran, opens its arrival watch (a core subscription) and
        # waits: measure once they all wait, not while the last ones are still on their way.
        # (The server's counter, polled: nothing to await.)
        while time.monotonic() < deadline and int(b.varz().get("subscriptions", 0)) < subs_idle + held:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        rss_held = proc.memory_info().rss / 2**20
        consumers = 0
        for stream in (config.names.inbox_stream, config.names.token_stream, config.names.dlq_stream):
            consumers += int((await b.api.stream_info(stream))["state"].get("consumer_count", 0))
        subs_held = int(b.varz().get("subscriptions", 0))
        await fleet.stop()
    note = "" if held >= keys else f"only {held} of {keys} keys were held when the wait ended"
    return Held(keys, held, rss_idle, rss_held, consumers, subs_idle, subs_held,
                held / elapsed, note)


def summary(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 99)

