"""The soak: workers behind fault proxies, producers, seeded faults, and the checker's verdict.

    python -m keyqueue.chaos --seed 7 --faults 500                     (make chaos)
    python -m keyqueue.chaos --seed 7 --faults 1000 --classes all      (make chaos-cluster)

One embedded nats-server, or a 3-node cluster with R3 streams when a cluster class is chosen (or
``nodes=3``); ``workers`` worker processes (:mod:`keyqueue.chaos.worker`), each connected through
its own :class:`~keyqueue.chaos.proxy.FaultProxy` (on a cluster: one proxy per node, all given to
the worker, faulted together as a :class:`~keyqueue.chaos.proxy.ProxyGroup`); a producer that
keeps enqueueing numbered requests on ``keys`` keys (retrying with the same request id until each
is stored, so the expected order per key is exact, and logging ``stored`` once it is); and fault
injectors for the chosen classes (:data:`CLASSES`, any mix):

- ``network``: per-worker blackholes (bytes held 2-5 s, past the lease, then delivered), resets,
  latency bursts, slow links (:data:`~keyqueue.chaos.proxy.DEFAULT_FAULTS`);
- ``process``: loop stalls just under and just over the lease, SIGSTOP past the lease, kill -9,
  graceful drain, and a request whose handler blocks the loop for 1.5x the lease;
- ``server``: on one server, restarts and kill -9; on a cluster, rolling restarts;
- ``cluster``: kill -9 of the node leading a queue stream or the token consumer;
- ``partition``: one node cut off from the other two (its route proxies), then healed;
- ``stepdown``: the leader of a queue stream or of the token consumer steps down;
- ``clock``: each worker's wall clock runs 10-60 s ahead or behind (drawn per worker).

The workload's handler shapes (``handlers``, :mod:`keyqueue.chaos.handlers`): each request runs
in an ``async def``, a ``def`` in a thread or a ``def`` in a process-pool child, drawn per
request among those chosen; one request every ``stall_every`` seconds holds the GIL or blocks its
loop for 1.5x the lease, or runs that much longer in a thread or child; with ``bad-input``, bad
requests are mixed in. Each worker process's RSS is sampled after ``rss_warmup`` seconds and once
every request has completed (:class:`~keyqueue.chaos.fleet.RssWatch`), and printed;
``rss_limit`` makes it part of ``ok``.

:mod:`keyqueue.chaos.injectors` says exactly what each fault does. The run ends after
``duration`` seconds or ``max_faults`` faults, whichever comes first; then every fault is
reverted, producers stop, and the soak waits for every request to complete before it checks the
log (:func:`keyqueue.chaos.checker.check`, safety and liveness) and the fenced store's history.
Workers that die meanwhile (a kill, the loop watchdog) are started again until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

from nats.aio.client import Client

from keyqueue.admin.dead_letters import dead_letters
from keyqueue.chaos.checker import GIVEN_BACK, LivenessBounds, Verdict, check, read_log
from keyqueue.chaos.fenced import FencedStore
from keyqueue.chaos.fleet import Faults, Fleet, LogTail, LoopLag, RssSample, RssWatch, SilenceWatch, WorkerSpec
from keyqueue.chaos.handlers import (
    BAD_INPUTS,
    FOREIGN_ACK_SID,
    HANDLERS,
    RUNNING,
    SLOW,
    STALLING,
    bad_request,
    foreign_subjects,
    work_headers,
)
from keyqueue.chaos.injectors import NODE_FAULT_CLASSES, node_faults, process_faults, server_faults
from keyqueue.chaos.proxy import DEFAULT_FAULTS, Faultable, FaultProxy, FaultScript, InjectedFault, ProxyGroup
from keyqueue.core.outage import Deadline, ride_out
from keyqueue.errors import (
    EnqueueError,
    KeyqueueError,
    TokenPublishFailed,
)
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect, link_of
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import HOST, EmbeddedServer

T = TypeVar("T")

QUEUE = "chaos"
CLASSES = ("network", "process", "server", "cluster", "partition", "stepdown", "clock")
"""Every fault class; ``all`` on the command line means all of them."""
DEFAULT_CLASSES = ("network", "process", "server")
CLUSTER_CLASSES = ("cluster", "partition", "stepdown")
"""Classes that need a cluster: choosing one runs the soak on 3 nodes with R3 streams."""
RSS_LIMIT = 0.10
"""How much a worker's RSS may grow from its warm-up to the end of the soak (printed; fails the
soak only with ``rss_limit``)."""


@dataclass
class SoakOptions:
    """What a soak runs; every field has a command-line flag of the same name."""

    seed: int = 1
    duration: float = 60.0
    max_faults: int | None = None
    classes: tuple[str, ...] = DEFAULT_CLASSES
    nodes: int | None = None
    """nats-servers: 1, or 3 (a cluster, R3 streams); None: 3 if a cluster class is chosen, else 1."""
    workers: int = 3
    keys: int = 12
    rate: float = 60.0
    """Requests enqueued per second, spread over the keys."""
    max_backlog: int = 2000
    """The producer stores nothing while more requests than this wait in the inbox (0: no limit):
    a fleet slower than ``rate`` (a slow machine, a soak of many faults) then ends the faults with a
    backlog it can drain within ``settle_timeout``, so that a request not done says something about
    keyqueue, not about the machine. The time held back is printed."""
    work: float = 0.02
    """Longest time a request's processor works (drawn uniformly from 0)."""
    ack_wait: float = 2.0
    concurrency: int = 8
    clock_offsets: tuple[float, float] = (10.0, 60.0)
    """With the ``clock`` class: each worker's offset is drawn from this range, ahead or behind."""
    handlers: tuple[str, ...] = ("async",)
    """Handler shapes and ``bad-input`` (:data:`keyqueue.chaos.handlers.HANDLERS`): each request
    takes one of the running shapes chosen (``async`` if none is), flagged ones a stalling shape."""
    stall_every: float = 8.0
    """Seconds between two requests flagged to stall (``gil``, ``blocking``: 1.5x the lease) or to be
    slow (``thread``, ``process``: a body 1.5x the lease longer), each chosen shape in turn."""
    bad_every: float = 2.0
    """With ``bad-input``: seconds between two bad requests (their kinds in turn)."""
    pool_size: int = 4
    """With ``process``: children in each worker's process pool."""
    rss_warmup: float = 10.0
    """Seconds a worker process runs before its warm-up RSS sample."""
    rss_limit: float | None = None
    """Fail the soak if a worker's RSS after the last fault exceeds its warm-up RSS by more than
    this fraction (0.10: 10%); None: only print the comparison."""
    bounds: LivenessBounds | None = None
    """The checker's liveness bounds; None: its defaults for ``ack_wait``."""
    dump_after: float = 15.0
    """Dump a worker silent this long with requests waiting (:class:`~keyqueue.chaos.fleet.SilenceWatch`)."""
    settle_timeout: float = 90.0
    workdir: Path = field(default_factory=lambda: Path("chaos-run"))
    progress: Callable[[str], None] | None = print

    @property
    def clustered(self) -> bool:
        return (self.nodes or (3 if set(CLUSTER_CLASSES) & set(self.classes) else 1)) > 1


@dataclass
class SoakResult:
    verdict: Verdict
    faults: Counter[str]
    elapsed: float
    enqueued: int
    log_path: Path
    clock_offsets: dict[str, float] = field(default_factory=dict)
    rss: list[RssSample] = field(default_factory=list)
    rss_limit: float | None = None
    held_back: float = 0.0
    """Seconds the producer stored nothing, the backlog over ``SoakOptions.max_backlog``."""
    max_backlog: int = 0
    dumps: int = 0
    """Workers dumped for their silence (``dump`` records; their stacks in their stderr files)."""
    lags: tuple[float, ...] = ()
    """Seconds the soak's own loop (every worker's proxy) ran late, each time it was (``lag`` records)."""

    @property
    def rss_over(self) -> list[RssSample]:
        """Workers whose RSS grew past the limit (none without ``rss_limit``)."""
        limit = self.rss_limit
        return [] if limit is None else [s for s in self.rss if s.growth is not None and s.growth > limit]

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.rss_over

    def summary(self) -> str:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items())) or "none"
        offsets = ", ".join(f"{w} {o:+.1f}s" for w, o in sorted(self.clock_offsets.items()) if o)
        return (f"faults injected: {sum(self.faults.values())} ({counts})\n"
                + (f"clock offsets: {offsets}\n" if offsets else "")
                + f"requests enqueued: {self.enqueued}; run time {self.elapsed:.0f}s; log {self.log_path}\n"
                + (f"producer held back {self.held_back:.0f}s in all, more than {self.max_backlog:,} requests waiting "
                   f"(the fleet was slower than the soak's rate)\n" if self.held_back else "")
                + (f"silent workers dumped {self.dumps} times (their stacks: {self.log_path.stem}.<worker>.stderr)\n"
                   if self.dumps else "")
                + (f"the soak's own loop, which carries every worker's proxy, ran late {len(self.lags)} times, at "
                   f"most {max(self.lags):.2f}s (`lag` records): every worker waited meanwhile\n" if self.lags else "")
                + self.verdict.summary() + self._rss_summary())

    def _rss_summary(self) -> str:
        if not self.rss:
            return ""
        limit = self.rss_limit if self.rss_limit is not None else RSS_LIMIT
        compared = [s.growth for s in self.rss if s.growth is not None]
        within = sum(growth <= limit for growth in compared)
        head = (f"\nrss: {within}/{len(compared)} compared workers within {limit:.0%} of their warm-up"
                + (f" ({len(self.rss) - len(compared)} not compared: started too late or not running at the end)"
                   if len(compared) < len(self.rss) else "")
                + ("" if self.rss_limit is not None else "; printed only (--rss-limit fails the soak on it)"))
        return "\n".join([head, *(s.show(limit) for s in self.rss)])


class _Producer:
    """Enqueues requests at ``rate`` until ``ending``, each retried with its id until stored.

    Each request takes a running shape of ``options.handlers`` (drawn per request); one every
    ``stall_every`` seconds is flagged to stall in a stalling shape or to be slow in a sync one
    (and one per ``block-loop`` fault to block its loop); with ``bad-input``, a bad request is
    mixed in every ``bad_every`` seconds on a random key, logged as ``bad_input`` rather than
    ``stored`` (it is expected in the dead-letter queue, never run in order)."""

    def __init__(self, publisher: Publisher, options: SoakOptions, rng: random.Random, fleet: Fleet,
                 urls: list[str]) -> None:
        self.publisher, self.options, self.rng, self.fleet = publisher, options, rng, fleet
        self.urls = urls
        """The servers' client URLs, for what only a bare connection can send (``foreign-subject``)."""
        self.foreign: dict[str, float] = {}
        """The key of each foreign token stored, and when it was sent (a worker must give it back after)."""
        self._foreign_rng = random.Random(options.seed + 9)  # the request keys' draws stay as they were
        self._foreign_sent = itertools.count()
        self._sending: set[asyncio.Task[None]] = set()
        self.expected: dict[str, list[str]] = {f"k{i}": [] for i in range(options.keys)}
        self.enqueued = 0
        self.bad = 0
        self._blocks: list[tuple[str, float]] = []
        self._tags: dict[str, str] = {}
        self._bad: dict[str, str] = {}
        self._shapes = [shape for shape in RUNNING if shape in options.handlers] or ["async"]
        self._stalls = [shape for shape in (*STALLING, *SLOW) if shape in options.handlers]
        self._shape_rng = random.Random(options.seed + 7)
        self.held_back = 0.0
        """Seconds the producer stored nothing because the backlog was over ``max_backlog``."""
        self._backlog_checked = -math.inf
        self._over = False

    def flag_block(self, seconds: float) -> None:
        """Make one of the next requests block its handler's event loop for ``seconds`` (once)."""
        self._blocks.append(("blocking", seconds))

    async def run(self, ending: asyncio.Event) -> int:
        options, rng = self.options, self.rng
        keys = list(self.expected)
        counter = dict.fromkeys(keys, 0)
        stalls = itertools.cycle(self._stalls)
        bad_kinds = itertools.cycle(BAD_INPUTS)
        next_stall = time.monotonic() + options.stall_every / 2
        next_bad = time.monotonic() + options.bad_every / 2
        while not ending.is_set():
            if await self._over_backlog():
                self.held_back += 0.1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ending.wait(), 0.1)
                continue
            batch = []
            if self._stalls and time.monotonic() >= next_stall:
                next_stall += options.stall_every
                self._blocks.append((next(stalls), options.ack_wait * 1.5))
            for key in rng.sample(keys, max(1, min(len(keys), int(options.rate / 10)))):
                tag = f"{key}-{counter[key]}"
                counter[key] += 1
                work: dict[str, object] = {"tag": tag, "sleep": round(rng.uniform(0, options.work), 4)}
                if len(self._shapes) > 1:
                    work["shape"] = self._shape_rng.choice(self._shapes)
                elif self._shapes != ["async"]:
                    work["shape"] = self._shapes[0]
                if self._blocks:
                    work["shape"], work["block"] = self._blocks.pop()
                rid = f"{options.seed}-{tag}"
                self._tags[rid] = tag
                batch.append(OutgoingRequest(key, work_headers(rid), json.dumps(work).encode(), rid))
            if "bad-input" in options.handlers and time.monotonic() >= next_bad:
                next_bad += options.bad_every
                key = self._shape_rng.choice(keys)
                kind = next(bad_kinds)
                if kind == "foreign-subject":  # beside the requests: its PubAck may take seconds
                    sending = asyncio.create_task(self._foreign())
                    self._sending.add(sending)
                    sending.add_done_callback(self._sending.discard)
                    kind = next(bad_kinds)
                tag = f"{key}-bad-{self.bad}"
                self.bad += 1
                rid = f"{options.seed}-{tag}"
                headers, body = bad_request(kind, rid, tag)
                self._tags[rid], self._bad[rid] = tag, kind
                batch.append(OutgoingRequest(key, headers, body, rid))
            await self._enqueue(batch)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), 0.1)
        if self._sending:
            await asyncio.wait(self._sending)
        return self.enqueued

    async def _over_backlog(self) -> bool:
        """Whether more than ``max_backlog`` requests wait in the inbox (asked at most once a second;
        a server that does not answer within a second leaves the last answer standing)."""
        limit = self.options.max_backlog
        if limit <= 0:
            return False
        now = time.monotonic()
        if now - self._backlog_checked >= 1.0:
            self._backlog_checked = now
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    info = await self.publisher.api.stream_info(self.publisher.names.inbox_stream)
                self._over = int(info["state"].get("messages", 0)) > limit
        return self._over

    async def _foreign(self) -> None:
        """Send :func:`~keyqueue.chaos.handlers.foreign_subjects` over a bare connection to one of the
        servers, logged as a ``bad_input`` once the token's PubAck says it is stored (a server or a
        stream leader down meanwhile: not logged; the next turn sends another)."""
        n = next(self._foreign_sent)
        lines, key = foreign_subjects(QUEUE, n)
        host, port = self._foreign_rng.choice(self.urls).removeprefix("nats://").rsplit(":", 1)
        sent_at = time.time()  # the log's clock (a worker may give the key back before the PubAck)
        try:
            async with asyncio.timeout(5.0):
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    await reader.readline()  # INFO
                    writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n' + lines)
                    await writer.drain()
                    stored = await _foreign_ack(reader, writer)
                finally:
                    writer.close()
        except (OSError, TimeoutError, ValueError, EOFError):
            return
        if not stored:
            return
        self.foreign[key] = sent_at
        self.fleet.note("producer", "bad_input", key=key, tag=f"foreign-{n}", request_id=f"foreign-{n}",
                        bad="foreign-subject", t=sent_at)

    async def _enqueue(self, pending: list[OutgoingRequest]) -> None:
        while pending:
            try:
                results = await self.publisher.enqueue_many(pending)
            except EnqueueError as e:  # the whole call failed (the server is down): retry it
                results = [e] * len(pending)
            except Exception as e:  # connection errors of any kind: retry the same ids
                results = [EnqueueError(str(e))] * len(pending)
            retry = []
            for request, result in zip(pending, results, strict=True):
                # A failed token publish still stored the request (the reconciler schedules it).
                if isinstance(result, Enqueued | TokenPublishFailed):
                    tag = self._tags.pop(request.request_id)
                    bad = self._bad.pop(request.request_id, None)
                    if bad is not None:
                        self.fleet.note("producer", "bad_input", key=request.key, tag=tag,
                                        request_id=request.request_id, bad=bad)
                        continue
                    self.expected[request.key].append(tag)
                    self.fleet.note("producer", "stored", key=request.key, tag=tag)
                    self.enqueued += 1
                else:
                    retry.append(request)
            pending = retry
            if pending:
                await asyncio.sleep(0.2)


async def soak(options: SoakOptions) -> SoakResult:
    """Run one soak; the result's ``ok`` is the verdict."""
    say = options.progress or (lambda _: None)
    unknown = set(options.classes) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown fault class(es) {sorted(unknown)}; choose from {', '.join(CLASSES)}")
    unknown = set(options.handlers) - set(HANDLERS)
    if unknown:
        raise ValueError(f"unknown handler(s) {sorted(unknown)}; choose from {', '.join(HANDLERS)}")
    workdir = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    for marker in workdir.glob("blocked-*"):
        marker.unlink()
    log_path = workdir / "run.jsonl"
    log_path.unlink(missing_ok=True)
    began = time.monotonic()
    clustered = options.clustered
    replicas = 3 if clustered else 1
    server: EmbeddedServer | None = None
    cluster: EmbeddedCluster | None = None
    if clustered:
        cluster = EmbeddedCluster(3, store_root=workdir / "cluster", advertise_clients=False,
                                  route_proxy=lambda _i, _j, upstream, port: FaultProxy(HOST, upstream, port=port))
        await cluster.start()
        node_urls = cluster.urls
    else:
        server = EmbeddedServer(store_dir=workdir / "store", log_file=workdir / "nats-server.log")
        await server.start()
        node_urls = [server.url]
    names = [f"w{i}" for i in range(options.workers)]
    groups = {name: ProxyGroup([FaultProxy.for_url(url) for url in node_urls]) for name in names}
    rng = random.Random(options.seed + 6)
    offsets = ({name: rng.choice((-1, 1)) * round(rng.uniform(*options.clock_offsets), 1) for name in names}
               if "clock" in options.classes else {})
    fleet: Fleet | None = None
    settled = asyncio.Event()  # every request completed (or the soak failed): supervisor and RSS watch stop
    try:
        for group in groups.values():
            for proxy in group.proxies:
                await proxy.start()
        nc = await connect(",".join(node_urls), name="chaos-soak")
        config = QueueConfig(QUEUE, ack_wait=options.ack_wait, replicas=replicas)
        await _patiently(nc, Topology(Publisher(nc, config.names).api, config).ensure, SET_UP_WAIT,
                         "creating the soak's streams")
        store = FencedStore(nc, replicas=replicas)
        await _patiently(nc, store.ensure, SET_UP_WAIT, "creating the fenced store")
        pool_size = options.pool_size if "process" in options.handlers else 0
        fleet = Fleet(WorkerSpec(QUEUE, options.ack_wait, options.concurrency, replicas, pool_size),
                      {name: ",".join(group.urls) for name, group in groups.items()}, log_path, offsets)
        for name, offset in offsets.items():
            fleet.note(name, "clock", offset=offset)
        for name in fleet.names():
            fleet.start(name)
        await fleet.wait_ready(fleet.names(), timeout=60)
        say(f"chaos: {options.workers} workers, {options.keys} keys, seed {options.seed}, "
            f"{'3-node R3 cluster' if clustered else 'one server'}, classes {','.join(options.classes)}, "
            f"handlers {','.join(options.handlers)}, "
            f"up to {options.duration:.0f}s / {options.max_faults or 'no'} fault limit")

        faults = Faults(fleet)
        ending = asyncio.Event()
        script = FaultScript(random.Random(options.seed + 1), DEFAULT_FAULTS, gap=(0.3, 1.5))
        network_ids: dict[int, int] = {}

        def injected(fault: InjectedFault) -> None:
            network_ids[id(fault)] = faults.begin(f"net-{fault.kind}", names[fault.proxy], duration=fault.duration,
                                                  level=fault.level)

        def reverted(fault: InjectedFault) -> None:
            faults.end(network_ids.pop(id(fault)))

        producer = _Producer(Publisher(nc, config.names), options, random.Random(options.seed + 2), fleet,
                             node_urls)
        producing = asyncio.create_task(producer.run(ending))
        # Until every request has completed: a worker that dies after the last fault (a stalling
        # handler's first run, a watchdog) is started again as well.
        supervising = asyncio.create_task(fleet.supervise(settled))
        rss = RssWatch(fleet, options.rss_warmup)
        sampling = asyncio.create_task(rss.run(settled))
        silence = SilenceWatch(fleet, options.dump_after)
        listening = asyncio.create_task(silence.run(settled))
        lag = LoopLag(fleet)
        timing = asyncio.create_task(lag.run(settled))
        tasks: list[asyncio.Task[object]] = []
        if "network" in options.classes:
            targets: list[Faultable] = [groups[name] for name in names]
            tasks.append(asyncio.create_task(script.run(targets, on_inject=injected, on_revert=reverted)))
        if "process" in options.classes:
            tasks.append(asyncio.create_task(process_faults(
                fleet, faults, random.Random(options.seed + 3), ending, options.ack_wait, producer.flag_block)))
        if server is not None and "server" in options.classes:
            tasks.append(asyncio.create_task(server_faults(server, faults, random.Random(options.seed + 4), ending)))
        if cluster is not None and set(NODE_FAULT_CLASSES) & set(options.classes):
            tasks.append(asyncio.create_task(node_faults(cluster, JetStreamApi(nc), config, options.classes, faults,
                                                         random.Random(options.seed + 5), ending)))
        deadline = time.monotonic() + options.duration
        last_report = time.monotonic()
        while time.monotonic() < deadline and (options.max_faults is None or faults.total < options.max_faults):
            await asyncio.sleep(0.2)
            if time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                held = f" (held back {producer.held_back:.0f}s: backlog over {options.max_backlog:,})" \
                    if producer.held_back else ""
                say(f"chaos: {time.monotonic() - began:.0f}s, {faults.total} faults, {producer.enqueued} "
                    f"requests enqueued{held}")
        ending.set()
        script.stop()
        for task in tasks:
            with contextlib.suppress(Exception):
                await task
        for name in fleet.names():
            fleet.resume(name)
        if server is not None and not server.running:
            await server.start()
        if cluster is not None:
            for node in cluster.servers:
                if not node.running:
                    await node.start(timeout=60)
        for name in fleet.names():
            if not fleet.alive(name):
                fleet.start(name)
        enqueued = await producing
        say(f"chaos: faults stopped after {time.monotonic() - began:.0f}s; waiting for {enqueued} requests")
        api = JetStreamApi(nc)
        gone = await _settle(log_path, producer.expected, producer.foreign, options.settle_timeout,
                             functools.partial(_foreign_tokens_stored, api))
        for key in gone:
            fleet.note("soak", "token_gone", key=key)
        await _note_dead_letters(fleet, api)
        settled.set()
        await sampling
        await supervising
        await listening
        await timing
        rss_samples = rss.final()
        snapshot = await _patiently(nc, store.snapshot, SNAPSHOT_WAIT, "reading the fenced store's history")
        verdict = check(read_log(log_path), producer.expected, store_history=snapshot.history(),
                        handover_after=options.ack_wait / 2,
                        bounds=options.bounds or LivenessBounds.for_lease(options.ack_wait))
        await nc.close()
        return SoakResult(verdict, faults.counts, time.monotonic() - began, enqueued, log_path, offsets, rss_samples,
                          options.rss_limit, producer.held_back, options.max_backlog, silence.dumps, tuple(lag.lags))
    finally:
        settled.set()
        if fleet is not None:
            fleet.stop_all()
        for group in groups.values():
            for proxy in group.proxies:
                await proxy.close()
        if server is not None:
            await server.aclose()
        if cluster is not None:
            await cluster.aclose()


async def _note_dead_letters(fleet: Fleet, api: JetStreamApi) -> None:
    """Log each request stored in the queue's dead-letter stream (``dlq`` records): what the checker
    counts a bad request settled by when the worker that dead-lettered it died before logging it."""
    try:
        letters = await dead_letters(api, QUEUE)
    except KeyqueueError as e:  # the checker then judges by the workers' events alone
        fleet.note("soak", "dlq_unread", error=repr(e))
        return
    for letter in letters:
        fleet.note("soak", "dlq", key=letter.key, request_id=letter.request_id, reason=letter.reason)


async def _foreign_ack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Read a bare connection until the foreign token's PubAck; whether it says stored."""
    while line := await reader.readline():
        if line.startswith(b"PING"):
            writer.write(b"PONG\r\n")
        elif line.startswith((b"HMSG ", b"-ERR")):
            return False  # no responders (503: the stream has no leader), or the server refused it
        elif len(parts := line.split()) >= 4 and parts[0] == b"MSG" and parts[2] == b"%d" % FOREIGN_ACK_SID:
            body = await reader.readexactly(int(parts[-1]) + 2)
            ack = json.loads(body[:-2] or b"{}")
            return "seq" in ack and "error" not in ack
    return False  # the server closed the connection


async def _settle(log_path: Path, expected: dict[str, list[str]], foreign: dict[str, float], timeout: float,
                  tokens_stored: Callable[[set[str]], Awaitable[set[str]]] | None = None) -> set[str]:
    """Wait until every expected request has completed and every foreign token's key was given back
    after it was sent (or ``timeout``: the checker reports the rest).

    Once only foreign tokens are left, ``tokens_stored`` is asked each second which of their keys
    still have a token stored: one gone was read and released by a worker that may have died before
    it logged the rest of the give-back. Returns those keys (the soak logs them ``token_gone``)."""
    wanted = {(key, tag) for key, tags in expected.items() for tag in tags}
    tokens = dict(foreign)
    gone: set[str] = set()
    tail = LogTail(log_path)
    deadline = time.monotonic() + timeout
    asked = -math.inf
    while time.monotonic() < deadline:
        for r in await tail.read():
            if r["kind"] == "end" and r.get("ok", True):
                wanted.discard((r["key"], r["tag"]))
            elif r.get("event") in GIVEN_BACK:
                key = str(r["key"])
                if float(str(r["t"])) >= tokens.get(key, math.inf):
                    del tokens[key]
        if tokens and not wanted and tokens_stored is not None and time.monotonic() - asked >= 1.0:
            asked = time.monotonic()
            with contextlib.suppress(KeyqueueError):
                left = await tokens_stored(set(tokens))
                for key in set(tokens) - left:
                    del tokens[key]
                    gone.add(key)
        if not wanted and not tokens:
            return gone
        await asyncio.sleep(0.25)
    return gone


async def _foreign_tokens_stored(api: JetStreamApi, keys: set[str]) -> set[str]:
    """Which of the foreign tokens' ``keys`` (as a worker reads them, ``\\xNN`` escaped) still have
    their token in the token stream. The server names a subject that is not UTF-8 with U+FFFD for
    each byte it cannot read, as Python's ``errors="replace"`` does."""
    names = QueueNames(QUEUE)
    stored = await api.subjects(names.token_stream, names.token_prefix + ">")
    return {key for key in keys if names.token_prefix + _foreign_raw(key).decode(errors="replace") in stored}


def _foreign_raw(key: str) -> bytes:
    """A foreign token's key as the bytes it was sent as (the inverse of ``backslashreplace``)."""
    return key.encode().decode("unicode_escape").encode("latin-1")


SNAPSHOT_WAIT: Final = 120.0
"""Seconds the soak waits for the fenced store's history after the last fault (a cluster still
electing answers "temporarily unavailable" or nothing for a while)."""

SET_UP_WAIT: Final = 60.0
"""Seconds the soak waits for a freshly started cluster to create its streams (an election, routes
still forming) before it gives up."""


async def _patiently(nc: Client, step: Callable[[], Awaitable[T]], seconds: float, what: str) -> T:
    """``step()``, tried again while the cluster does not answer yet (electing, or just formed and
    counting a peer offline: both ``JetStreamUnavailable``) or the soak's own connection is down (as
    the workers' own steps are: :func:`~keyqueue.core.outage.ride_out`), for ``seconds``."""
    link = link_of(nc)
    assert link is not None, "the soak's connection is opened by keyqueue's connect"
    return await ride_out(step, Deadline(seconds, what), link)
