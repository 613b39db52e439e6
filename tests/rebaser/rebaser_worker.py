"""A Rebaser worker process for fault tests: keyqueue's worker with the Rebaser plugin, logging every event.

    python tests/rebaser/rebaser_worker.py URL LOGFILE --name w1 [--ack-wait S] [--linger S] ...

It runs what ``keyqueue worker`` runs (an App's worker, its signals and drain), with two plugins
that append to LOGFILE, one JSON line per event: the Rebaser's observer (``kind`` ``rebaser``:
applied, dvu_started, dvu_finished, dvu_owed, ...) and the key lifecycle hooks (``kind``
``session``). Each line has the worker's name ``w`` and the wall-clock time ``t``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slow_functions
from event_log import SessionEvents

import keyqueue
from keyqueue.chaos.worker import RunLog as Log
from keyqueue_rebaser import RebaserPlugin, RebaserSettings, load_functions


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("logfile")
    p.add_argument("--name", default=f"w{os.getpid()}")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--ack-wait", type=float, default=2.0)
    p.add_argument("--linger", type=float, default=0.05)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    args = p.parse_args()
    log = Log(args.logfile, args.name)

    def observe(event: str, fields: dict[str, Any]) -> None:
        log.write("rebaser", event=event, **{k: v for k, v in fields.items() if k != "t"})

    def on_session(event: str, fields: dict[str, Any]) -> None:
        log.write("session", event=event.removeprefix("session:"), **fields)

    class Ready:
        @keyqueue.hookimpl
        def keyqueue_worker_started(self) -> None:
            log.write("ready")

    settings = RebaserSettings(retry=keyqueue.RetryPolicy(max_attempts=5, base_delay=0.05))
    rebaser = RebaserPlugin(settings=settings, functions=load_functions([slow_functions], autoload=False),
                            observer=observe, ack_wait=args.ack_wait)
    app = keyqueue.App("rebaser-tests", url=args.url, plugins=[rebaser, SessionEvents(on_session), Ready()],
                       autoload_plugins=False, set_as_default=False)
    try:
        await app.worker(concurrency=args.concurrency, linger=args.linger, drain_timeout=args.drain_timeout,
                         name=args.name).serve()
    finally:
        log.write("exit")
        await app.close()


if __name__ == "__main__":
    asyncio.run(main())
