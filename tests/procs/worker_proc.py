"""A keyqueue worker process for fault-injection tests.

    python tests/procs/worker_proc.py URL QUEUE LOGFILE [--concurrency N] [--ack-wait S] ...

Requests are ``Work`` messages (keyqueue.wire, v1) with ``sleep`` seconds and a ``tag``. Every
handler start and end, and every session event, is appended to LOGFILE as one JSON line with
the worker's name and wall-clock time, so the test can check exclusivity, order and loss.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyqueue.chaos.worker import EventLog
from keyqueue.chaos.worker import RunLog as Log
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.pull import PullOptions
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.wire import Message, Registry, decode


@dataclass(frozen=True)
class Work(Message):
    TYPE = "Work"
    VERSION = 1
    tag: str
    sleep: float = 0.0
    fail: bool = False


REGISTRY = Registry()
REGISTRY.register(Work)


class Recording(BaseProcessor):
    def __init__(self, log: Log) -> None:
        self.log = log

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        work = decode(request.headers, request.data, REGISTRY)
        assert isinstance(work, Work)
        self.log.write("start", key=request.key, tag=work.tag, seq=request.seq, attempt=ctx.attempt,
                       fencing=list(ctx.fencing))
        await asyncio.sleep(work.sleep)
        if work.fail:
            raise RuntimeError(f"poison {work.tag}")
        self.log.write("end", key=request.key, tag=work.tag, seq=request.seq)
        return Reply(work.tag.encode())


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("logfile")
    p.add_argument("--name", default=f"w{os.getpid()}")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ack-wait", type=float, default=2.0)
    p.add_argument("--linger", type=float, default=0.05)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--base-delay", type=float, default=0.05)
    p.add_argument("--reconcile-interval", type=float, default=30.0)
    p.add_argument("--priority-policy", default="none")
    p.add_argument("--priority-timeout", type=float, default=10.0)
    p.add_argument("--min-pending", type=int, default=0)
    p.add_argument("--min-ack-pending", type=int, default=0)
    p.add_argument("--priority", type=int, default=None)
    p.add_argument("--pull-expires", type=float, default=10.0)
    args = p.parse_args()
    log = Log(args.logfile, args.name)
    worker: QueueWorker | None = None

    async def reconnected() -> None:
        if worker is not None:
            worker.reconnected()

    nc = await connect(args.url, name=args.name, reconnected=reconnected)
    config = QueueConfig(args.queue, ack_wait=args.ack_wait, priority_policy=args.priority_policy,
                         priority_timeout=args.priority_timeout)
    pull = PullOptions(expires=args.pull_expires, heartbeat=min(2.0, args.pull_expires / 2),
                       min_pending=args.min_pending, min_ack_pending=args.min_ack_pending, priority=args.priority)
    settings = SessionSettings(ack_wait=args.ack_wait, linger=args.linger, drain_timeout=args.drain_timeout,
                               retry=RetryPolicy(max_attempts=args.max_attempts, base_delay=args.base_delay))
    worker = QueueWorker(nc, config, lambda key: Recording(log), concurrency=args.concurrency, settings=settings,
                         reconcile_interval=args.reconcile_interval, name=args.name, pull=pull,
                         observer=EventLog(log, args.name))
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_usr1() -> None:
        log.write("statuses", statuses=dict(worker.puller.statuses), pin=worker.puller.state.pin_id)

    loop.add_signal_handler(signal.SIGUSR1, on_usr1)

    def on_signal() -> None:
        signals["n"] += 1
        log.write("signal", n=signals["n"])
        worker.stop(now=signals["n"] > 1)

    loop.add_signal_handler(signal.SIGTERM, on_signal)
    loop.add_signal_handler(signal.SIGINT, on_signal)
    run = asyncio.create_task(worker.run())
    await worker.started()
    log.write("ready")
    await run
    log.write("exit", statuses=worker.puller.statuses)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
