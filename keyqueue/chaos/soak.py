"""The soak: workers behind fault proxies, producers, seeded faults, and the checker's verdict.

    python -m keyqueue.chaos --seed 7 --faults 500            (make chaos)

One embedded nats-server; ``workers`` worker processes (:mod:`keyqueue.chaos.worker`), each
connected through its own :class:`~keyqueue.chaos.proxy.FaultProxy`; a producer that keeps
enqueueing numbered requests on ``keys`` keys (retrying with the same request id until each is
stored, so the expected order per key is exact); and fault injectors for the chosen classes:

- ``network``: per-proxy blackholes (bytes held 2-5 s, past the lease, then delivered), resets,
  latency bursts, slow links (:data:`~keyqueue.chaos.proxy.DEFAULT_FAULTS`);
- ``process``: event-loop stalls just under and just over the lease, SIGSTOP past the lease then
  SIGCONT, kill -9 (and a new process under the same name), graceful drain (and a restart);
- ``server``: nats-server restarts and kill -9 (then started again on the same store and port);
- ``cluster`` (alone or with ``process``): a 3-node cluster with R3 streams instead of one
  server, workers connected to all three nodes, and kill -9 of the leader of the inbox, token or
  lease stream or of the token consumer, brought back after 1-3 s.

The run ends after ``duration`` seconds or ``max_faults`` faults, whichever comes first; then
every fault is reverted, producers stop, and the soak waits for every request to complete before
it checks the log (:func:`keyqueue.chaos.checker.check`) and the fenced store's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from keyqueue.chaos.checker import Verdict, check, read_log
from keyqueue.chaos.fenced import FencedStore
from keyqueue.chaos.proxy import DEFAULT_FAULTS, FaultProxy, FaultScript, InjectedFault
from keyqueue.errors import EnqueueError, KeyqueueError, TokenPublishFailed
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import EmbeddedServer

QUEUE = "chaos"
CLASSES = ("network", "process", "server", "cluster")
DEFAULT_CLASSES = ("network", "process", "server")


@dataclass
class SoakOptions:
    """What a soak runs; every field has a command-line flag of the same name."""

    seed: int = 1
    duration: float = 60.0
    max_faults: int | None = None
    classes: tuple[str, ...] = DEFAULT_CLASSES
    workers: int = 3
    keys: int = 12
    rate: float = 60.0
    """Requests enqueued per second, spread over the keys."""
    work: float = 0.02
    """Longest time a request's processor works (drawn uniformly from 0)."""
    ack_wait: float = 2.0
    concurrency: int = 8
    settle_timeout: float = 90.0
    workdir: Path = field(default_factory=lambda: Path("chaos-run"))
    progress: Callable[[str], None] | None = print


@dataclass
class SoakResult:
    verdict: Verdict
    faults: Counter[str]
    elapsed: float
    enqueued: int
    log_path: Path

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def summary(self) -> str:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items())) or "none"
        return (f"faults injected: {sum(self.faults.values())} ({counts})\n"
                f"requests enqueued: {self.enqueued}; run time {self.elapsed:.0f}s; log {self.log_path}\n"
                + self.verdict.summary())


class _Fleet:
    """The worker processes, each behind its proxy, writing one shared run log."""

    def __init__(self, options: SoakOptions, urls: list[str], log_path: Path, replicas: int = 1) -> None:
        self.options = options
        self.urls = urls
        self.replicas = replicas
        self.log_path = log_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.paused: set[str] = set()
        self.fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(self, w: str, kind: str, **fields: object) -> None:
        line = json.dumps({"w": w, "kind": kind, "t": time.time(), **fields}, default=str)
        os.write(self.fd, (line + "\n").encode())

    def names(self) -> list[str]:
        return [f"w{i}" for i in range(len(self.urls))]

    def start(self, name: str) -> None:
        url = self.urls[int(name[1:])]
        o = self.options
        stderr = open(self.log_path.with_suffix(f".{name}.stderr"), "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "keyqueue.chaos.worker", url, QUEUE, str(self.log_path), "--name", name,
             "--ack-wait", str(o.ack_wait), "--concurrency", str(o.concurrency), "--replicas", str(self.replicas),
             "--stall-under", str(round(o.ack_wait * 0.75, 3)), "--stall-over", str(round(o.ack_wait * 1.5, 3))],
            stdout=subprocess.DEVNULL, stderr=stderr)

    async def wait_ready(self, names: list[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        pids = {name: self.procs[name].pid for name in names}
        while True:
            ready = {(r["w"], r.get("pid")) for r in read_log(self.log_path) if r["kind"] == "ready"}
            if all((name, pid) in ready for name, pid in pids.items()):
                return
            for name in names:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"chaos worker {name} exited with {self.procs[name].returncode}; see "
                                       f"{self.log_path.with_suffix(f'.{name}.stderr')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos workers {names} not ready within {timeout}s")
            await asyncio.sleep(0.1)

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def pause(self, name: str) -> None:
        self.signal(name, signal.SIGSTOP)
        self.paused.add(name)
        self.note(name, "paused", reason="sigstop")

    def resume(self, name: str) -> None:
        if name in self.paused:
            self.paused.discard(name)
            self.note(name, "resumed", reason="sigcont")
            self.signal(name, signal.SIGCONT)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait()
        self.paused.discard(name)
        self.note(name, "killed")

    async def drain(self, name: str, timeout: float = 20.0) -> None:
        self.signal(name, signal.SIGTERM)
        proc = self.procs[name]
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
        except TimeoutError:
            self.kill(name)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        os.close(self.fd)


async def _process_faults(fleet: _Fleet, rng: random.Random, counts: Counter[str], ending: asyncio.Event,
                          ack_wait: float) -> None:
    """Faults in worker processes, one at a time, on a random worker."""
    kinds = ["stall-under", "stall-over", "sigstop", "kill-9", "drain"]
    while not ending.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ending.wait(), rng.uniform(0.5, 2.0))
        if ending.is_set():
            return
        for dead in [n for n in fleet.names() if not fleet.alive(n)]:
            # A worker that could not start (its server was electing leaders, say): start it again.
            fleet.note("soak", "restart", target=dead)
            fleet.start(dead)
        name = rng.choice(fleet.names())
        kind = rng.choice(kinds)
        if not fleet.alive(name):
            continue
        counts[kind] += 1
        fleet.note("soak", "fault", fault=kind, target=name)
        try:
            await _process_fault(fleet, name, kind, rng, ack_wait)
        except (RuntimeError, TimeoutError) as e:  # a worker that cannot come back: start it again
            fleet.note("soak", "fault_error", fault=kind, target=name, error=repr(e))
            if not fleet.alive(name):
                fleet.start(name)


async def _process_fault(fleet: _Fleet, name: str, kind: str, rng: random.Random, ack_wait: float) -> None:
    if kind == "stall-under":
        fleet.signal(name, signal.SIGUSR1)
    elif kind == "stall-over":
        fleet.signal(name, signal.SIGUSR2)
    elif kind == "sigstop":
        fleet.pause(name)
        await asyncio.sleep(rng.uniform(ack_wait * 1.2, ack_wait * 2.5))
        fleet.resume(name)
    elif kind == "kill-9":
        fleet.kill(name)
        fleet.start(name)
        await fleet.wait_ready([name], timeout=90)
    else:
        await fleet.drain(name)
        fleet.note(name, "killed", reason="drained")
        fleet.start(name)
        await fleet.wait_ready([name], timeout=90)


async def _server_faults(server: EmbeddedServer, fleet: _Fleet, rng: random.Random, counts: Counter[str],
                         ending: asyncio.Event) -> None:
    """Restarts and kill -9 of the nats-server, spaced out so work goes on between them."""
    while not ending.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ending.wait(), rng.uniform(4.0, 8.0))
        if ending.is_set():
            return
        kind = rng.choice(["server-restart", "server-kill-9"])
        counts[kind] += 1
        fleet.note("soak", "fault", fault=kind)
        if kind == "server-restart":
            await server.restart()
        else:
            server.kill()
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await server.start()


async def _cluster_faults(cluster: EmbeddedCluster, api: JetStreamApi, fleet: _Fleet, rng: random.Random,
                          counts: Counter[str], ending: asyncio.Event) -> None:
    """kill -9 of the node leading one of the queue's streams or its consumer, then bring it back."""
    names = QueueConfig(QUEUE).names
    targets = {"inbox": names.inbox_stream, "tokens": names.token_stream, "leases": names.lease_stream,
               "consumer": names.consumer}
    while not ending.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ending.wait(), rng.uniform(4.0, 8.0))
        if ending.is_set():
            return
        target = rng.choice(sorted(targets))
        try:
            if target == "consumer":
                info = await api.consumer_info(names.token_stream, names.consumer)
            else:
                info = await api.stream_info(targets[target])
            leader = str(info.get("cluster", {}).get("leader", ""))
        except KeyqueueError as e:
            fleet.note("soak", "fault_error", fault=f"leader-kill-9-{target}", error=repr(e))
            continue
        index = next((i for i, server in enumerate(cluster.servers) if server.name == leader), None)
        if index is None:
            continue
        counts[f"leader-kill-9-{target}"] += 1
        fleet.note("soak", "fault", fault=f"leader-kill-9-{target}", target=leader)
        cluster.kill(index)
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        await cluster.restart(index)


async def _produce(publisher: Publisher, options: SoakOptions, rng: random.Random, expected: dict[str, list[str]],
                   ending: asyncio.Event) -> int:
    """Enqueue requests at ``rate`` until ``ending``; each is retried with its id until stored."""
    keys = [f"k{i}" for i in range(options.keys)]
    counter = dict.fromkeys(keys, 0)
    enqueued = 0
    while not ending.is_set():
        batch = []
        for key in rng.sample(keys, max(1, min(len(keys), int(options.rate / 10)))):
            tag = f"{key}-{counter[key]}"
            counter[key] += 1
            body = json.dumps({"tag": tag, "sleep": round(rng.uniform(0, options.work), 4)}).encode()
            rid = f"{options.seed}-{tag}"
            batch.append(OutgoingRequest(key, {"Nats-Msg-Id": rid}, body, rid))
        pending = batch
        while pending:
            try:
                results = await publisher.enqueue_many(pending)
            except EnqueueError as e:  # the whole call failed (the server is down): retry it
                results = [e] * len(pending)
            except Exception as e:  # connection errors of any kind: retry the same ids
                results = [EnqueueError(str(e))] * len(pending)
            retry = []
            for request, result in zip(pending, results, strict=True):
                # A failed token publish still stored the request (the reconciler schedules it).
                if isinstance(result, Enqueued | TokenPublishFailed):
                    expected[request.key].append(json.loads(request.body)["tag"])
                    enqueued += 1
                else:
                    retry.append(request)
            pending = retry
            if pending:
                await asyncio.sleep(0.2)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ending.wait(), 0.1)
    return enqueued


async def soak(options: SoakOptions) -> SoakResult:
    """Run one soak; the result's ``ok`` is the verdict."""
    say = options.progress or (lambda _: None)
    workdir = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "run.jsonl"
    log_path.unlink(missing_ok=True)
    began = time.monotonic()
    clustered = "cluster" in options.classes
    if clustered and {"network", "server"} & set(options.classes):
        raise ValueError("the cluster class runs alone or with process faults (its workers use no proxies)")
    replicas = 3 if clustered else 1
    server = EmbeddedServer(store_dir=workdir / "store", log_file=workdir / "nats-server.log")
    cluster = EmbeddedCluster(3, store_root=workdir / "cluster") if clustered else None
    if cluster is not None:
        await cluster.start()
    else:
        await server.start()
    url = cluster.url if cluster is not None else server.url
    proxies = [] if clustered else [FaultProxy.for_url(server.url) for _ in range(options.workers)]
    fleet: _Fleet | None = None
    try:
        for proxy in proxies:
            await proxy.start()
        nc = await connect(url, name="chaos-soak")
        config = QueueConfig(QUEUE, ack_wait=options.ack_wait, replicas=replicas)
        await Topology(Publisher(nc, config.names).api, config).ensure()
        store = FencedStore(nc, replicas=replicas)
        await store.ensure()
        worker_urls = [proxy.url for proxy in proxies] or [url] * options.workers
        fleet = _Fleet(options, worker_urls, log_path, replicas)
        for name in fleet.names():
            fleet.start(name)
        await fleet.wait_ready(fleet.names())
        say(f"chaos: {options.workers} workers, {options.keys} keys, seed {options.seed}, classes "
            f"{','.join(options.classes)}, up to {options.duration:.0f}s / {options.max_faults or 'no'} fault limit")

        counts: Counter[str] = Counter()
        expected: dict[str, list[str]] = {f"k{i}": [] for i in range(options.keys)}
        ending = asyncio.Event()
        script = FaultScript(random.Random(options.seed + 1), DEFAULT_FAULTS, gap=(0.3, 1.5))

        def injected(fault: InjectedFault) -> None:
            assert fleet is not None
            counts[f"net-{fault.kind}"] += 1
            fleet.note("soak", "fault", fault=f"net-{fault.kind}", target=f"w{fault.proxy}",
                       duration=fault.duration, level=fault.level)

        producer = asyncio.create_task(_produce(Publisher(nc, config.names), options, random.Random(options.seed + 2),
                                                expected, ending))
        injectors: list[asyncio.Task[object]] = []
        if "network" in options.classes:
            injectors.append(asyncio.create_task(script.run(proxies, on_inject=injected)))
        if "process" in options.classes:
            injectors.append(asyncio.create_task(
                _process_faults(fleet, random.Random(options.seed + 3), counts, ending, options.ack_wait)))
        if "server" in options.classes:
            injectors.append(asyncio.create_task(
                _server_faults(server, fleet, random.Random(options.seed + 4), counts, ending)))
        if cluster is not None:
            injectors.append(asyncio.create_task(
                _cluster_faults(cluster, JetStreamApi(nc), fleet, random.Random(options.seed + 5), counts, ending)))
        deadline = time.monotonic() + options.duration
        last_report = time.monotonic()
        while time.monotonic() < deadline and (options.max_faults is None
                                               or sum(counts.values()) < options.max_faults):
            await asyncio.sleep(0.2)
            if time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                say(f"chaos: {time.monotonic() - began:.0f}s, {sum(counts.values())} faults, "
                    f"{sum(map(len, expected.values()))} requests enqueued")
        ending.set()
        script.stop()
        for task in injectors:
            with contextlib.suppress(Exception):
                await task
        for name in fleet.names():
            fleet.resume(name)
        if cluster is None and not server.running:
            await server.start()
        for name in fleet.names():
            if not fleet.alive(name):
                fleet.start(name)
        enqueued = await producer
        say(f"chaos: faults stopped after {time.monotonic() - began:.0f}s; waiting for {enqueued} requests")
        await _settle(log_path, expected, options.settle_timeout)
        snapshot = await store.snapshot()
        verdict = check(read_log(log_path), expected, store_history=snapshot.history(),
                        handover_after=options.ack_wait / 2)
        await nc.close()
        return SoakResult(verdict, counts, time.monotonic() - began, enqueued, log_path)
    finally:
        if fleet is not None:
            fleet.stop_all()
        for proxy in proxies:
            await proxy.close()
        await server.aclose()
        if cluster is not None:
            await cluster.aclose()


async def _settle(log_path: Path, expected: dict[str, list[str]], timeout: float) -> None:
    """Wait until every expected request has completed (or ``timeout``: the checker reports the rest)."""
    wanted = {(key, tag) for key, tags in expected.items() for tag in tags}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = {(r["key"], r["tag"]) for r in read_log(log_path) if r["kind"] == "end" and r.get("ok", True)}
        if wanted <= done:
            return
        await asyncio.sleep(0.25)
