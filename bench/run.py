"""One benchmark run: raw JetStream baselines, keyqueue's workloads, the peers; then the report.

Everything runs against one embedded nats-server started for the run, in the same run, so the
ratios to raw JetStream hold even on a noisy machine.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import machine, raw
from bench.fleet import WorkerOptions
from bench.peers import PeerResult, Workload, compare, run_peers
from bench.records import handoffs_ms
from bench.results import Report, Row, Sizes
from bench.user_path import ProductRates
from bench.workloads import Bench, enqueue_rates, held_keys, interleaved, keyed_run, latency, summary
from keyqueue.jetstream.connect import connect
from keyqueue.server.embedded import EmbeddedServer

KQ = "keyqueue"
RAW = "raw JetStream"

HOT_1 = "1. hot keys, 1 process"
HOT_2 = "1. hot keys, 2 processes"
HOT_2_16 = "1. hot keys, 2 processes, 16 slots each"
COLD = "2. cold keys"
COLD_DEFAULT = "2. cold keys, default 16 slots"
BULK = "3. bulk enqueue (enqueue_many)"
SINGLE = "3. single enqueue (sequential)"
LAT_IDLE = "4. latency enqueue->start, idle"
LAT_LOAD = "4. latency enqueue->start, under load"
HANDOFF_SOLO = "5. hand-off on one hot key, alone"
HANDOFF_1 = "5. hand-off, all hot keys busy, 1 process"
HANDOFF_2 = "5. hand-off, all hot keys busy, 2 processes"
HELD = "6. keys held by one process"
REBASER = "7. Rebaser DVU coalescing"
PRODUCT_HOT = "1p. hot keys, product path"
PRODUCT_HOT_2 = "1p. hot keys, product path, --processes 2"
PRODUCT_COLD = "2p. cold keys, product path"
PRODUCT_IO = "1p. hot keys, product path, task awaits 1 ms of I/O"
PRODUCT_UNKEYED = "1u. unkeyed requests, product path"
SERVER_HOT = "1p. server cost per hot request"
SERVER_COLD = "2p. server cost per cold key"
R3_RAW = "raw on R3: fetch(200)+ack"
R3_HOT = "1p. hot keys, product path, 3 nodes R3"
PEERS_HOT = "peers: hot keys, 1 process"
PEERS_COLD = "peers: cold keys, 1 process"
VERSUS_HOT = "1p. hot keys, product path, vs best peer"
VERSUS_COLD = "2p. cold keys, product path, vs best peer"

RAW_PUBLISH = "raw: publish_async"
RAW_FETCH = "raw: fetch(200)+ack"
RAW_SEQUENTIAL = "raw: publish, awaited one at a time"

Progress = Callable[[str], None]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _detail(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _ratio(row: Row, baseline: float, name: str, goal: float | None) -> Row:
    row.ratio = row.value / baseline if baseline else math.nan
    row.baseline = name
    if goal is not None:
        row.goal = f">= {goal:g}x"
        row.met = row.ratio >= goal
    return row


async def run(sizes: Sizes, *, peers: bool, command: str, work_dir: Path | None = None,
              options: WorkerOptions | None = None, say: Progress = _say) -> Report:
    """Measure everything for ``sizes``; returns the report (nothing is written here)."""
    started = time.monotonic()
    report = Report(sizes.mode, command, machine.facts())
    options = options or WorkerOptions(concurrency=128)
    scratch = Path(work_dir or tempfile.mkdtemp(prefix="keyqueue-bench-"))
    report.notes.append(
        f"keyqueue rows 1-6 measure the core: QueueWorker with {options.concurrency} slots per process, linger "
        f"{options.linger * 1000:.0f} ms, ack_wait {options.ack_wait:.0f} s, a no-op processor, on the event loop "
        f"`keyqueue worker` runs ({options.loop or 'auto'}: uvloop where installed); producers "
        "in the benchmark's own process on Publisher. Rows 1p/2p measure the product path: `keyqueue "
        "worker` serving a no-op @app.task with the default processor, hooks and the events plugin, "
        "fed by Task.enqueue_many. Like raw fetch+ack and rows 1-2, each is timed on requests stored first "
        "(the workers paused with SIGSTOP meanwhile); its detail also gives the rate with the requests "
        "stored and served at once, the producer on the same cores."
    )
    async with EmbeddedServer(store_dir=scratch / "store", log_file=scratch / "nats-server.log") as server:
        say(f"nats-server on {server.url}; scratch in {scratch}")
        say("raw JetStream baselines ...")
        rates = await raw.measure(server.url, sizes.raw, monitoring=server.monitoring_url)
        report.add(Row(RAW_PUBLISH, RAW, rates.publish_async, "msg/s", f"{sizes.raw:,} messages"))
        report.add(Row(RAW_FETCH, RAW, rates.fetch_ack, "msg/s", _detail(
            f"{sizes.raw:,} messages", rates.server.text() + " per message, publish included" if rates.server else "")))
        report.add(Row(RAW_SEQUENTIAL, RAW, rates.publish_sequential, "msg/s"))

        nc = await connect(server.url, name="bench-producer")
        assert server.pid is not None
        b = Bench(server.url, server.monitoring_url, server.pid, nc, scratch / "records", options)
        try:
            await _keyqueue(b, sizes, report, rates, say)
        finally:
            await nc.close()

        per_key = sizes.product_hot_per_key
        product_total = sizes.hot_keys * per_key
        say(f"1p/2p. the product path: keyqueue worker + @app.task, plugins on: {sizes.hot_keys} keys x "
            f"{per_key}, then {sizes.product_cold} keys x 1 ...")
        from bench.user_path import measure

        product = await measure(server.url, sizes.hot_keys, per_key, sizes.product_cold,
                                monitoring=server.monitoring_url, loop=options.loop, unkeyed=product_total)
        # The peers right after the product path, so that on a shared machine both meet the same load.
        peer_results = await _run_peers(sizes, scratch, say) if peers else None
        _ratio(report.add(Row(PRODUCT_HOT, KQ, product.hot, "req/s",
                              f"{product_total:,} requests stored first; one `keyqueue worker` process (128 "
                              "slots), default processor, hooks and the events plugin; worker CPU "
                              f"{product.hot_cpu_us:.0f} us/request; stored (Task.enqueue_many) and served at once: "
                              f"{product.hot_end_to_end:,.0f} req/s, "
                              f"{product.hot_end_to_end / rates.fetch_ack:.2f}x")),
               rates.fetch_ack, RAW_FETCH, 0.6)
        _ratio(report.add(Row(PRODUCT_UNKEYED, KQ, product.unkeyed, "req/s", _detail(
            f"{product_total:,} requests of a no-op task without a key, stored first; the same worker, its "
            f"unkeyed lane (no token, no lease record: fetch + ack); worker CPU {product.unkeyed_cpu_us:.0f} "
            f"us/request; stored and served at once: {product.unkeyed_end_to_end:,.0f} req/s",
            product.unkeyed_server.text() + " per request, enqueue included" if product.unkeyed_server else ""))),
               rates.fetch_ack, RAW_FETCH, 0.6)
        _server_rows(report, product, rates, sizes)
        say(f"{PRODUCT_IO} ...")
        io = await measure(server.url, sizes.hot_keys, per_key, 0, end_to_end=False,
                           monitoring=server.monitoring_url, loop=options.loop, task="io_note")
        _ratio(report.add(Row(PRODUCT_IO, KQ, io.hot, "req/s",
                              f"{product_total:,} requests stored first; the handler awaits asyncio.sleep(0.001); "
                              f"worker CPU {io.hot_cpu_us:.0f} us/request")), rates.fetch_ack, RAW_FETCH, None)
        say(f"{PRODUCT_HOT_2} ...")
        two = await measure(server.url, sizes.hot_keys, per_key, 0, processes=2, end_to_end=False,
                            loop=options.loop)
        _ratio(report.add(Row(PRODUCT_HOT_2, KQ, two.hot, "req/s",
                              f"{product_total:,} requests stored first; `keyqueue worker --processes 2` (this "
                              f"machine has {os.cpu_count()} cores, shared with nats-server); workers' CPU "
                              f"{two.hot_cpu_us:.0f} us/request")),
               rates.fetch_ack, RAW_FETCH, 0.8)
        _ratio(report.add(Row(PRODUCT_COLD, KQ, product.cold, "req/s",
                              f"{sizes.product_cold:,} keys stored first; the same worker; worker CPU "
                              f"{product.cold_cpu_us:.0f} us/request; stored and served at once: "
                              f"{product.cold_end_to_end:,.0f} req/s")), rates.fetch_ack, RAW_FETCH, 0.25)

        per_change_set = 40 if sizes.mode == "full" else 10
        say(f"7. Rebaser: 50 change sets x {per_change_set} updates ...")
        from bench.rebaser import rebaser_run

        rb = await rebaser_run(server.url, 50, per_change_set)
        report.add(Row(REBASER, KQ, rb.rate, "req/s",
                       f"{rb.requests:,} update requests on {rb.change_sets} change sets, end to end to the "
                       f"covering DVU; {rb.triggers:,} DVU triggers ran as {rb.runs:,} runs "
                       f"({rb.triggers / max(rb.runs, 1):.1f} per run)"))
    say(f"{R3_RAW} / {R3_HOT}: a 3-node cluster, R3 streams ...")
    await _replicated(sizes, report, scratch, options)
    if peer_results is not None:
        _peer_rows(report, sizes, rates.fetch_ack, product, peer_results)
    else:
        say("peers: not run (pass --peers; only full mode runs them by default)")
        report.add(Row(PEERS_HOT, "(skipped)", math.nan, "", "peers not run: pass --peers"))
    report.seconds = time.monotonic() - started
    return report


def _workloads(sizes: Sizes) -> tuple[Workload, Workload]:
    """The hot and the cold workload of the product path, which the peers serve too."""
    return Workload("hot keys", sizes.hot_keys, sizes.product_hot_per_key), Workload("cold keys", sizes.product_cold, 1)


async def _run_peers(sizes: Sizes, scratch: Path, say: Progress) -> list[PeerResult]:
    hot, cold = _workloads(sizes)
    say(f"peers: {hot}; {cold} ...")
    return await run_peers([hot, cold], scratch / "peers", say)


def _peer_rows(report: Report, sizes: Sizes, raw_rate: float, product: ProductRates,
               results: list[PeerResult]) -> None:
    """The peers on the product path's two workloads, each beside raw fetch+ack and keyqueue.

    Against the path users run (rows 1p/2p), not the core's rows 1/2: the peers run their own task
    APIs too. Each peer's row is taken against raw fetch+ack; one row per workload gives keyqueue
    against the best peer that ran, with the issue's goal."""
    hot, cold = _workloads(sizes)
    for workload, name, keyqueue, versus_name, goal in ((hot, PEERS_HOT, product.hot, VERSUS_HOT, 15.0),
                                                         (cold, PEERS_COLD, product.cold, VERSUS_COLD, 3.0)):
        for result in (r for r in results if r.workload == workload):
            _ratio(report.add(Row(name, result.name, result.rate, "req/s", f"{workload}; {result.detail}",
                                  check=result.check)), raw_rate, RAW_FETCH, None)
        versus = compare(workload, raw_rate, keyqueue, results)
        report.versus.append(versus)
        best = versus.best_peer()
        row = report.add(Row(versus_name, KQ, versus.vs_best_peer, "x", (
            f"{keyqueue:,.0f} req/s against {best[0]}'s {best[1]:,.0f} req/s ({workload}); "
            f"raw fetch+ack {raw_rate:,.0f} msg/s" if best else "no peer ran: their rows say why")))
        row.goal = f">= {goal:g}x"
        row.met = None if best is None else versus.vs_best_peer >= goal


def _server_rows(report: Report, product: ProductRates, rates: raw.RawRates, sizes: Sizes) -> None:
    """What the server saw per hot request and per cold key, beside raw fetch+ack's per message."""
    raw_text = f"raw fetch+ack: {rates.server.text()} per message" if rates.server else ""
    if product.hot_server is not None:
        report.add(Row(SERVER_HOT, KQ, product.hot_server.api_and_stored, "API calls + stored msgs",
                       _detail(product.hot_server.text() + " per request, enqueue included", raw_text)))
    if product.cold_server is not None:
        row = report.add(Row(SERVER_COLD, KQ, product.cold_server.api_and_stored, "API calls + stored msgs",
                             _detail(product.cold_server.text() + f" per key ({sizes.product_cold:,} keys x 1), "
                                     "enqueue included", raw_text)))
        row.goal, row.met = "<= 6", product.cold_server.api_and_stored <= 6


async def _replicated(sizes: Sizes, report: Report, scratch: Path, options: WorkerOptions) -> None:
    """Raw fetch+ack and the product path's hot keys on a 3-node cluster with R3 streams, in the same run."""
    from bench.user_path import measure
    from keyqueue.server.cluster import EmbeddedCluster

    async with EmbeddedCluster(3, store_root=scratch / "r3") as cluster:
        monitoring = [s.monitoring_url for s in cluster.servers]
        rates = await raw.measure(cluster.url, sizes.raw // 2, monitoring=monitoring, replicas=3)
        report.add(Row(R3_RAW, RAW, rates.fetch_ack, "msg/s", _detail(
            f"{sizes.raw // 2:,} messages, R3 work-queue stream",
            rates.server.text() + " per message (API and client messages summed over the 3 servers)"
            if rates.server else "")))
        per_key = sizes.product_hot_per_key
        product = await measure(cluster.url, sizes.hot_keys, per_key, 0, end_to_end=False,
                                monitoring=monitoring, loop=options.loop, replicas=3)
        _ratio(report.add(Row(R3_HOT, KQ, product.hot, "req/s", _detail(
            f"{sizes.hot_keys * per_key:,} requests stored first; one `keyqueue worker` process on the cluster",
            f"worker CPU {product.hot_cpu_us:.0f} us/request",
            product.hot_server.text() + " per request" if product.hot_server else ""))),
            rates.fetch_ack, R3_RAW, 0.5)


async def _keyqueue(b: Bench, sizes: Sizes, report: Report, rates: raw.RawRates, say: Progress) -> None:
    total = sizes.hot_total
    for processes, name in ((1, HOT_1), (2, HOT_2)):
        say(f"{name}: {sizes.hot_keys} keys x {sizes.hot_per_key} ...")
        hot = await keyed_run(b, f"hot{processes}", interleaved(sizes.hot_keys, sizes.hot_per_key, "h"), processes)
        row = report.add(Row(name, KQ, hot.rate, "req/s", _detail(f"{total:,} requests", hot.cpu(), hot.note),
                             check=hot.check.summary()))
        _ratio(row, rates.fetch_ack, RAW_FETCH, 0.5)
        gaps = handoffs_ms(hot.records)
        p50, p99 = summary(gaps)
        handoff = HANDOFF_1 if processes == 1 else HANDOFF_2
        report.add(Row(handoff, KQ, p50, "ms", f"p99 {p99:.2f} ms over {len(gaps):,} hand-offs, "
                       f"{sizes.hot_keys} keys busy at once"))
        report.distributions[f"hand-off, {sizes.hot_keys} hot keys, {processes} proc."] = gaps

    say(f"{HOT_2_16} ...")
    hot = await keyed_run(b, "hot2s16", interleaved(sizes.hot_keys, sizes.hot_per_key, "h"), 2, concurrency=16)
    row = report.add(Row(HOT_2_16, KQ, hot.rate, "req/s", _detail(f"{total:,} requests", hot.cpu(), hot.note),
                         check=hot.check.summary()))
    _ratio(row, rates.fetch_ack, RAW_FETCH, None)

    say(f"{HANDOFF_SOLO}: 1 key x {sizes.solo} ...")
    solo = await keyed_run(b, "solo", interleaved(1, sizes.solo, "solo"), 1)
    gaps = handoffs_ms(solo.records)
    p50, p99 = summary(gaps)
    row = report.add(Row(HANDOFF_SOLO, KQ, p50, "ms", f"p99 {p99:.2f} ms over {len(gaps):,} hand-offs; "
                         f"{solo.rate:,.0f} req/s on the key; {solo.cpu()} {solo.note}".strip(),
                         check=solo.check.summary()))
    row.goal, row.met = "p50 <= 1 ms", p50 <= 1.0
    report.distributions["hand-off, one hot key alone"] = gaps

    say(f"{COLD}: {sizes.cold_keys} keys x 1 ...")
    cold = await keyed_run(b, "cold", interleaved(sizes.cold_keys, 1, "c"), 1)
    row = report.add(Row(COLD, KQ, cold.rate, "req/s", _detail(f"{sizes.cold_keys:,} keys", cold.cpu(), cold.note),
                         check=cold.check.summary()))
    _ratio(row, rates.fetch_ack, RAW_FETCH, 0.25)
    say(f"{COLD_DEFAULT} ...")
    slow = b.options
    b.options = WorkerOptions(concurrency=16, linger=slow.linger, ack_wait=slow.ack_wait)
    try:
        cold16 = await keyed_run(b, "cold16", interleaved(sizes.cold_keys, 1, "c"), 1)
    finally:
        b.options = slow
    row = report.add(Row(COLD_DEFAULT, KQ, cold16.rate, "req/s",
                         _detail(f"{sizes.cold_keys:,} keys", cold16.cpu(), cold16.note),
                         check=cold16.check.summary()))
    _ratio(row, rates.fetch_ack, RAW_FETCH, None)

    say(f"{BULK} / {SINGLE} ...")
    bulk, single = await enqueue_rates(b, sizes.bulk, sizes.single)
    _ratio(report.add(Row(BULK, KQ, bulk, "req/s", f"{sizes.bulk:,} requests over 1,000 keys")),
           rates.publish_async, RAW_PUBLISH, 0.45)
    _ratio(report.add(Row(SINGLE, KQ, single, "req/s", f"{sizes.single:,} requests, 2 publishes each")),
           rates.publish_sequential, RAW_SEQUENTIAL, None)

    say(f"{LAT_IDLE} / {LAT_LOAD} ...")
    lat = await latency(b, sizes.probes, sizes.probe_interval, sizes.hot_keys, sizes.hot_per_key)
    p50, p99 = summary(lat.idle_ms)
    row = report.add(Row(LAT_IDLE, KQ, p50, "ms", f"p99 {p99:.2f} ms, {len(lat.idle_ms)} probes, each to a new key"))
    row.goal, row.met = "p50 <= 2 ms, p99 <= 10 ms", p50 <= 2.0 and p99 <= 10.0
    p50, p99 = summary(lat.loaded_ms)
    report.add(Row(LAT_LOAD, KQ, p50, "ms",
                   f"p99 {p99:.2f} ms, {lat.loaded_probes} probes during the hot-key load "
                   f"({lat.load.rate:,.0f} req/s meanwhile)", check=lat.load.check.summary()))
    report.distributions["enqueue->start, idle"] = lat.idle_ms
    report.distributions["enqueue->start, under load"] = lat.loaded_ms

    say(f"{HELD}: {sizes.held_keys} keys ...")
    held = await held_keys(b, sizes.held_keys)
    report.add(Row(HELD, KQ, held.kb_per_key, "KiB RSS/key",
                   f"{held.held:,} of {held.keys:,} held; RSS {held.rss_idle_mb:.0f} -> {held.rss_held_mb:.0f} MiB; "
                   f"consumers on the queue's streams {held.consumers}; server subscriptions "
                   f"{held.subscriptions_idle:,} -> {held.subscriptions_held:,}; "
                   f"acquired at {held.acquire_rate:,.0f} keys/s {held.note}".strip()))
