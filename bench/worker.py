"""One keyqueue worker process for the benchmark: ``python -m bench.worker URL QUEUE OUT [options]``.

It runs a :class:`~keyqueue.core.worker.QueueWorker` with a no-op processor that only stamps
each request's start and end, and is driven over its standard streams so the parent can line
several processes up:

- prints ``ready`` once connected and the queue's topology exists;
- starts pulling keys on a ``go`` line, prints ``started`` once the worker runs;
- on a ``stop`` line (or end of input) drains, writes its records to OUT, prints ``done N``.

Records are kept in memory while the benchmark runs (a list append per request) so that writing
them costs the measured path nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from bench.records import write_records
from keyqueue.app.event_loop import LOOPS, run
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.topology import QueueConfig, Topology


class StampingProcessor(BaseProcessor):
    """The benchmark's no-op handler: remembers when each request started and ended."""

    def __init__(self, rows: list[tuple[str, bytes, int, int]]) -> None:
        self.rows = rows

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        start = time.monotonic_ns()
        self.rows.append((request.key, request.data, start, time.monotonic_ns()))
        return None


async def _line() -> str:
    line: str = await asyncio.to_thread(sys.stdin.readline)
    return line.strip()


def _say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    nc = await connect(args.url, name=f"bench-worker-{args.queue}")
    config = QueueConfig(args.queue, ack_wait=args.ack_wait)
    await Topology(JetStreamApi(nc), config).ensure()
    rows: list[tuple[str, bytes, int, int]] = []
    processor = StampingProcessor(rows)
    worker = QueueWorker(nc, config, lambda key: processor, concurrency=args.concurrency,
                         settings=SessionSettings(ack_wait=args.ack_wait, linger=args.linger))
    _say("ready")
    if await _line() != "go":
        await nc.close()
        return
    run = asyncio.create_task(worker.run(), name="worker")
    await worker.started()
    _say("started")
    await _line()  # "stop", or the parent went away
    if args.kill_on_stop:
        # Skip the drain (e.g. ten thousand held keys): write what ran and leave at once.
        write_records(Path(args.out), rows)
        _say(f"done {len(rows)}")
        os._exit(0)
    worker.stop()
    await run
    await nc.close()
    write_records(Path(args.out), rows)
    _say(f"done {len(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker")
    parser.add_argument("url")
    parser.add_argument("queue")
    parser.add_argument("out")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--linger", type=float, default=0.05)
    parser.add_argument("--ack-wait", type=float, default=30.0)
    parser.add_argument("--kill-on-stop", action="store_true")
    parser.add_argument("--loop", choices=LOOPS, default="auto",
                        help="the event loop, as keyqueue worker --loop (default auto: uvloop where installed)")
    parser.add_argument("--profile", help="write a pyinstrument HTML/text profile of the run here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(async_mode="disabled", interval=0.0005)
        profiler.start()
        try:
            run(serve(args), args.loop)
        finally:
            profiler.stop()
            Path(args.profile).write_text(profiler.output_text(unicode=False, color=False, show_all=False))
            if profiler.last_session is not None:
                profiler.last_session.save(str(Path(args.profile).with_suffix(".pyisession")))
        return
    run(serve(args), args.loop)


if __name__ == "__main__":
    main()
