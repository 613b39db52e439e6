"""Drive one peer through the keyed workload: ``python -m bench.peers.drive PEER [options]``.

Runs in the peers' virtual environment. Like keyqueue's workload 1: store every request first
(``keys`` x ``per_key``, round-robin), then start one worker process with ``concurrency`` slots,
wait until every request ran (or the time limit), stop the worker, and print one JSON line:
the rate from the first handler start to the last handler end, and whether per-key order and
exclusivity held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.records import check, read_records, span_rate

REPO = Path(__file__).resolve().parent.parent.parent


def _worker(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is None:
        # The main process only: Celery and Dramatiq forward it to their children, and a
        # second SIGTERM would make them kill the children before the records are written.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait(done: Any, total: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if done() >= total:
            return True
        time.sleep(0.02)
    return False


def _plan(keys: int, per_key: int) -> list[tuple[str, int]]:
    return [(f"h{k}", i) for i in range(per_key) for k in range(keys)]


def celery(args: argparse.Namespace, out: Path) -> tuple[bool, int]:
    import redis

    os.environ["BENCH_REDIS_URL"] = args.redis
    from bench.peers.celery_app import DONE, run

    client = redis.Redis.from_url(args.redis)
    client.flushdb()
    for key, index in _plan(args.keys, args.per_key):
        run.apply_async((key, index, 0))
    celery_bin = str(Path(sys.executable).parent / "celery")
    proc = _worker([celery_bin, "-A", "bench.peers.celery_app", "worker", "--pool", "threads",
                    "--concurrency", str(args.concurrency), "-Q", "bench", "--without-gossip", "--without-mingle",
                    "--without-heartbeat", "--loglevel", "WARNING"],
                   {"BENCH_REDIS_URL": args.redis, "BENCH_OUT": str(out)}, out.with_suffix(".log"))
    total: int = args.keys * args.per_key
    try:
        finished = _wait(lambda: int(client.get(DONE) or 0), total, args.timeout)
    finally:
        _stop(proc)
    return finished, int(client.get(DONE) or 0)


def dramatiq(args: argparse.Namespace, out: Path) -> tuple[bool, int]:
    import redis

    os.environ["BENCH_REDIS_URL"] = args.redis
    from bench.peers.dramatiq_app import DONE, run

    client = redis.Redis.from_url(args.redis)
    client.flushdb()
    for key, index in _plan(args.keys, args.per_key):
        run.send(key, index, 0)
    dramatiq_bin = str(Path(sys.executable).parent / "dramatiq")
    proc = _worker([dramatiq_bin, "bench.peers.dramatiq_app", "--processes", "1", "--threads",
                    str(args.concurrency), "--queues", "bench"],
                   {"BENCH_REDIS_URL": args.redis, "BENCH_OUT": str(out)}, out.with_suffix(".log"))
    total: int = args.keys * args.per_key
    try:
        finished = _wait(lambda: int(client.get(DONE) or 0), total, args.timeout)
    finally:
        _stop(proc)
    return finished, int(client.get(DONE) or 0)


def procrastinate(args: argparse.Namespace, out: Path) -> tuple[bool, int]:
    import psycopg

    os.environ["BENCH_PG_URL"] = args.pg
    from bench.peers.procrastinate_app import app, run

    with psycopg.connect(args.pg, autocommit=True) as conn:  # an empty database, as flushdb empties Redis
        conn.execute("drop schema if exists public cascade")
        conn.execute("create schema public")

    async def prepare() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            plan = _plan(args.keys, args.per_key)
            by_key: dict[str, list[dict[str, Any]]] = {}
            for key, index in plan:
                by_key.setdefault(key, []).append({"key": key, "index": index, "stamp": 0})
            for key, jobs in by_key.items():
                await run.configure(lock=key).batch_defer_async(*jobs)

    asyncio.run(prepare())
    proc = _worker([sys.executable, "-m", "bench.peers.procrastinate_app", str(out), str(args.concurrency)],
                   {"BENCH_PG_URL": args.pg}, out.with_suffix(".log"))
    total: int = args.keys * args.per_key

    with psycopg.connect(args.pg, autocommit=True) as conn:
        def done() -> int:
            row = conn.execute("select count(*) from procrastinate_jobs where queue_name = 'bench'").fetchone()
            return total - int(row[0] if row else total)

        try:
            finished = _wait(done, total, args.timeout)
        finally:
            _stop(proc)
        ran: int = done()
        return finished, ran


PEERS = {"celery": celery, "dramatiq": dramatiq, "procrastinate": procrastinate}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.drive")
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--per-key", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--redis", default="")
    parser.add_argument("--pg", default="")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.peer}.tsv"
    out.unlink(missing_ok=True)
    finished, ran = PEERS[args.peer](args, out)
    records = read_records([out])
    total: int = args.keys * args.per_key
    result = check(records, total)
    print(json.dumps({
        "peer": args.peer,
        "rate": span_rate(records) if records else float("nan"),
        "finished": finished,
        "ran": ran,
        "total": total,
        "runs": len(records),
        "ordered": result.ordered,
        "exclusive": result.exclusive,
        "check": result.summary(),
        "detail": result.detail,
    }))


if __name__ == "__main__":
    main()
