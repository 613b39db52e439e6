"""Spark example: backfill 100,000 change-set requests over 10,000 keys into the rebaser queue, drain
it with a worker that records lifecycle events, then report on the events -- all on one machine.

    python -m examples.spark                 # embedded nats-server, local[*] Spark
    python -m examples.spark --url nats://127.0.0.1:4222 --rows 20000 --keys 2000

Writes out/spark-example/ (input.parquet, report/report.html, report/aggregates/*.parquet).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from pathlib import Path

import pandas as pd

from examples.spark.fleet import drain
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_spark.backfill import BackfillJob, run_backfill
from keyqueue_spark.report import run_report
from keyqueue_spark.session import spark_session

QUEUE, TASK = "rebaser", "EnqueueUpdatesRequest"


def make_input(path: Path, rows: int, keys: int, seed: int = 9) -> None:
    """Change-set update requests: a few hot change sets, a long tail, 0.1% poison updates."""
    rng = random.Random(seed)
    weights = [1.0 / (1 + i) ** 0.8 for i in range(keys)]
    change_sets = rng.choices(range(keys), weights=weights, k=rows)
    frame = pd.DataFrame({
        "change_set": [f"w{c % 10}.cs{c}" for c in change_sets],
        "n": range(rows),
        "updates": [[{"op": rng.choice(["add", "set", "remove"]), "node": rng.randrange(10**6)}
                     for _ in range(rng.randint(1, 3))] for _ in range(rows)],
        "poison": [rng.random() < 0.001 for _ in range(rows)],
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an existing NATS server (default: start an embedded one)")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--out", type=Path, default=Path("out/spark-example"))
    args = parser.parse_args()
    logging.getLogger("keyqueue").setLevel(logging.ERROR)  # the poison updates' dead letters are expected

    started = time.monotonic()
    server = None
    if args.url is None:
        server = EmbeddedServer()
        server.start_sync()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        source = args.out / "input.parquet"
        make_input(source, args.rows, args.keys)
        print(f"[1/4] {args.rows:,} rows over {args.keys:,} change sets -> {source}")

        spark = spark_session(args.master, "keyqueue spark example", conf={"spark.ui.showConsoleProgress": "false"})
        t = time.monotonic()
        summary = run_backfill(spark, BackfillJob(str(source), QUEUE, TASK, "change_set", url, job_id="example"))
        print(f"[2/4] backfill: {summary['rows']:,} rows, {summary['accepted'] - summary['duplicates']:,} enqueued, "
              f"{summary['duplicates']:,} duplicates, {summary['errors']:,} errors in {time.monotonic() - t:.1f}s")

        # When each request was enqueued: the inbox's store times, read with the keyqueue source.
        inbox = spark.read.format("keyqueue").option("url", url).option("queue", QUEUE).option("stream", "inbox").load()
        enqueued = {r["request_id"]: (r["timestamp"].timestamp(), r["key"])
                    for r in inbox.select("request_id", "timestamp", "key").collect()}
        t = time.monotonic()
        events = asyncio.run(_drain_and_record(url, enqueued))
        print(f"[3/4] worker drained the queue: {events:,} events in {time.monotonic() - t:.1f}s")

        t = time.monotonic()
        page, data = run_report(spark, QUEUE, args.out / "report", url=url)
        s = data.summary
        print(f"[4/4] report: {s['events']:,} events, {s['keys']:,} keys, {s['dvu_runs']:,} DVU runs, "
              f"{s['coalescing_ratio']:.2f} triggers per run, in {time.monotonic() - t:.1f}s -> {page}")
        spark.stop()
    finally:
        if server is not None:
            server.close_sync()
    print(f"done in {time.monotonic() - started:.0f}s")


async def _drain_and_record(url: str, enqueued: dict[str, tuple[float, str]]) -> int:
    from keyqueue.events import ensure_events_stream, event
    from keyqueue_spark.streams import connect_to, publish_events

    nc = await connect_to(url)
    try:
        await ensure_events_stream(nc, QUEUE)
        await publish_events(nc, QUEUE, [event("enqueued", ts, QUEUE, key=key, request_id=rid, task=TASK)
                                         for rid, (ts, key) in enqueued.items()])
    finally:
        await nc.close()
    times = {rid: ts for rid, (ts, _) in enqueued.items()}
    return len(enqueued) + await drain(url, QUEUE, times, TASK)


if __name__ == "__main__":
    main()
