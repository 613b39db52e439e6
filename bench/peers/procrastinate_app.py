"""procrastinate on PostgreSQL, keyed with its ``lock``: jobs sharing a lock run one at a time, in order.

``python -m bench.peers.procrastinate_app CONNINFO OUT CONCURRENCY`` runs one worker until
SIGTERM, then writes its records to OUT. Runs in the peers' virtual environment only.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from procrastinate import App, PsycopgConnector

from bench.records import write_plain

app = App(connector=PsycopgConnector(conninfo=os.environ.get("BENCH_PG_URL", "")))
rows: list[tuple[str, int, int, int, int]] = []


@app.task(name="run", queue="bench")
async def run(key: str, index: int, stamp: int) -> None:
    start = time.monotonic_ns()
    rows.append((key, index, stamp, start, time.monotonic_ns()))


async def serve(concurrency: int, out: Path) -> None:
    async with app.open_async():
        # listen_notify wakes the worker on new jobs; the poll is only a fallback.
        await app.run_worker_async(queues=["bench"], concurrency=concurrency, wait=True,
                                   fetch_job_polling_interval=0.05, delete_jobs="successful")
    write_plain(out, rows)


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[2]), Path(sys.argv[1])))
