"""``python -m bench.spark``: keyqueue on Spark against keyqueue without it, in one run on one machine.

Rows (printed as a table, and as Markdown rows for docs/benchmarks.md):

* bulk enqueue: ``Task.enqueue_many`` of ``--rows`` rows over ``--keys`` keys, 10,000 at a time,
  from this process: the baseline;
* ``keyqueue backfill`` of the same rows from a Parquet file (``run_backfill``, ``local[*]``,
  no ``--app`` check), timed once the Spark session has started; its detail names the start-up
  (the JVM and session) and what the backfill's own first steps cost;
* ``keyqueue report`` over ``--events`` lifecycle events (``run_report``), timed the same way,
  against reading the same events in this process (``read_range``, one connection).

Each system gets a fresh queue on one embedded nats-server started for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.report import _cells, table
from bench.results import Report, Row
from keyqueue.events import ensure_events_stream, event
from keyqueue.server.embedded import EmbeddedServer

KQ = "keyqueue"
ENQUEUE = "8. bulk enqueue of the backfill's rows (Task.enqueue_many)"
BACKFILL = "8. keyqueue backfill, local[*]"
REPORT = "9. keyqueue report, local[*]"
READ = "9. reading the events in one process (read_range)"


def write_input(path: Path, rows: int, keys: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    numbers = pa.array(range(rows), type=pa.int64())
    accounts = pa.array([f"acct-{i % keys}" for i in range(rows)])
    pq.write_table(pa.table({"account": accounts, "amount": numbers}), path)


async def enqueue_baseline(url: str, rows: int, keys: int, chunk: int = 10_000) -> float:
    import keyqueue

    app = keyqueue.App("bench_enqueue", url=url, autoload_plugins=False, set_as_default=False)

    @app.task(key="{account}")
    async def post(account: str, amount: int) -> None:
        """What the rows would run."""

    try:
        await post.enqueue(account="warm", amount=-1)  # creates the queue's streams
        started = time.perf_counter()
        for lo in range(0, rows, chunk):
            await post.enqueue_many([{"account": f"acct-{i % keys}", "amount": i}
                                     for i in range(lo, min(rows, lo + chunk))])
        return time.perf_counter() - started
    finally:
        await app.close()


async def publish_events(url: str, queue: str, count: int, window: int = 2000) -> None:
    """``count`` events of requests over 10,000 keys: enqueued, started, succeeded, and a retry now and then."""
    from keyqueue.events import EVENT_HEADERS, events_subject
    from keyqueue.ext import connect, parse_pub_ack
    from keyqueue.wire import CBOR, dumps

    nc = await connect(url, name="bench-events")
    try:
        await ensure_events_stream(nc, queue, max_msgs=count + 1000)
        t0 = time.time() - 3600
        items: list[dict[str, Any]] = []
        request = 0
        while len(items) < count:
            key, rid, ts = f"acct-{request % 10_000}", f"r{request}", t0 + request * 0.003
            common = {"key": key, "request_id": rid, "task": "post", "worker": "w1"}
            items.append(event("enqueued", ts, queue, **common))
            items.append(event("started", ts + 0.5, queue, attempt=1, wait=0.5, **common))
            if request % 20 == 3:
                items.append(event("retried", ts + 0.6, queue, attempt=1, reason="TimeoutError", **common))
            items.append(event("succeeded", ts + 0.7, queue, attempt=1, run=0.01 * (request % 7), **common))
            request += 1
        items = items[:count]

        async def one(body: dict[str, Any]) -> None:
            parse_pub_ack(await nc.request(events_subject(queue, body["event"]), dumps(body, CBOR),
                                           headers=dict(EVENT_HEADERS), timeout=30))

        for lo in range(0, len(items), window):
            await asyncio.gather(*(one(b) for b in items[lo:lo + window]))
    finally:
        await nc.close()


async def read_baseline(url: str, queue: str) -> tuple[int, float]:
    from keyqueue.events import events_stream
    from keyqueue_spark.streams import connect_to, decode_message, read_range, stream_bounds

    nc = await connect_to(url)
    try:
        started = time.perf_counter()
        bounds = await stream_bounds(nc, events_stream(queue))
        count = 0
        async for page in read_range(nc, events_stream(queue), bounds.first_seq, bounds.last_seq):
            for message in page:
                decode_message(message.headers, message.data)
                count += 1
        return count, time.perf_counter() - started
    finally:
        await nc.close()


class Arrivals:
    """When the first and the last message on ``subject`` arrived (a core subscription in a thread of its own)."""

    def __init__(self, url: str, subject: str) -> None:
        self.url, self.subject = url, subject
        self.count, self.first, self.last = 0, 0.0, 0.0
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)

    async def _listen(self) -> None:
        from keyqueue.ext import connect

        nc = await connect(self.url, name="bench-arrivals")

        async def arrived(_: Any) -> None:
            now = time.perf_counter()
            self.first = self.first or now
            self.last = now
            self.count += 1

        await nc.subscribe(self.subject, cb=arrived)
        await nc.flush()
        self._ready.set()
        await asyncio.get_running_loop().run_in_executor(None, self._stop.wait)
        await nc.close()

    def __enter__(self) -> Arrivals:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args(argv)
    report = Report(mode="spark", command="python -m bench.spark " + " ".join(argv or []))
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp:
        root = Path(tmp)
        server = EmbeddedServer(store_dir=root / "store", log_file=root / "nats.log")
        server.start_sync()
        try:
            run_all(report, server.url, root, args)
        finally:
            server.close_sync()
    print(table(report))
    print()
    for row in report.rows:
        print("| " + " | ".join(c.replace("|", "\\|") for c in _cells(row)) + " |")
    return 0


def run_all(report: Report, url: str, root: Path, args: argparse.Namespace) -> None:
    from keyqueue_spark import spark_session
    from keyqueue_spark.backfill import BackfillJob, run_backfill
    from keyqueue_spark.report import run_report

    rows, keys = args.rows, args.keys
    data = root / "rows.parquet"
    write_input(data, rows, keys)

    enqueue_s = asyncio.run(enqueue_baseline(url, rows, keys))
    baseline = report.add(Row(ENQUEUE, KQ, rows / enqueue_s, "req/s",
                              f"{rows:,} rows over {keys:,} keys in {enqueue_s:.1f}s, 10,000 per call, one process"))

    started = time.perf_counter()
    spark = spark_session(args.master, "bench-spark", conf={"spark.ui.showConsoleProgress": "false"})
    session_s = time.perf_counter() - started
    try:
        with Arrivals(url, "kq.bench_backfill.in.>") as stored:
            started = time.perf_counter()
            summary = run_backfill(spark, BackfillJob(input_path=str(data), queue="bench_backfill", task="post",
                                                      key="account", url=url), show_progress=False)
            backfill_s = time.perf_counter() - started
        assert summary["accepted"] - summary["duplicates"] == rows == stored.count, (summary, stored.count)
        rate = rows / backfill_s
        until_first, writing = stored.first - started, stored.last - stored.first
        report.add(Row(BACKFILL, KQ, rate, "req/s",
                       f"{rows:,} rows in {backfill_s:.1f}s once the session had started ({session_s:.1f}s: "
                       f"with it {rows / (backfill_s + session_s):,.0f} req/s); first row stored after "
                       f"{until_first:.1f}s (input read and counted, shuffled by key, Python workers started), "
                       f"then {rows / writing:,.0f} req/s while writing; "
                       f"{spark.sparkContext.defaultParallelism} tasks", ratio=rate / baseline.value,
                       baseline=ENQUEUE, goal=">= 0.5x", met=rate / baseline.value >= 0.5))

        asyncio.run(publish_events(url, "bench_report", args.events))
        count, read_s = asyncio.run(read_baseline(url, "bench_report"))
        read = report.add(Row(READ, KQ, count / read_s, "events/s", f"{count:,} events decoded in {read_s:.1f}s"))
        started = time.perf_counter()
        _, data_out = run_report(spark, "bench_report", root / "report", url=url, show_progress=False)
        report_s = time.perf_counter() - started
        assert data_out.summary["events"] == count, data_out.summary
        report.add(Row(REPORT, KQ, count / report_s, "events/s",
                       f"{count:,} events, report written in {report_s:.1f}s (Spark already started)",
                       ratio=count / report_s / read.value, baseline=READ))
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main())
