"""``python -m bench.delays [--quick | --smoke]``: how late delayed requests start after their due time.

Two ``keyqueue worker`` processes serve one queue on a fresh nats-server. The producer ``call``s a
task with ``options(countdown=...)``; the task returns how late it started (its start time less
the due time, on the machine's one clock), so the figure covers the whole path: the server's
schedule timer, the move into the key's inbox, the token, and the key session that runs it.

- *at rest*: requests on their own keys, due at times spread over some seconds (the promise:
  p99 under 1 s);
- *burst*: many requests due at the same instant, which the fleet moves one at a time (the
  ``movers`` consumer keeps one in flight, for order), so the last of them starts later.

``python -m bench`` prints these lines after its table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import keyqueue
from keyqueue.server.embedded import EmbeddedServer

REPO: Final = Path(__file__).resolve().parent.parent
QUEUE: Final = "bench-delays"
WORKERS: Final = 2

SIZES: Final = {"full": (300, 15.0, 1000), "quick": (100, 6.0, 300), "smoke": (10, 1.5, 20)}
"""Per mode: requests at rest, the seconds their due times spread over, requests in the burst."""


def declare(app: keyqueue.App) -> keyqueue.App:
    @app.task(key="{key}", queue=QUEUE)
    async def timed(key: str, due: dt.datetime) -> float:
        return (dt.datetime.now(dt.UTC) - due).total_seconds()

    return app


app = declare(keyqueue.App("bench-delays", set_as_default=False, autoload_plugins=False))
"""What the worker processes serve (``keyqueue worker bench.delays:app``)."""


@dataclass(frozen=True)
class Lateness:
    """Seconds from due time to start, for one workload."""

    name: str
    seconds: list[float]

    def percentile(self, p: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]

    def line(self) -> str:
        return (f"delays {self.name:<28} n={len(self.seconds):<5} lateness p50 {self.percentile(50) * 1000:6.0f} ms"
                f"   p99 {self.percentile(99) * 1000:6.0f} ms   max {max(self.seconds) * 1000:6.0f} ms")


async def _calls(producer: keyqueue.App, dues: list[tuple[str, dt.datetime]]) -> list[float]:
    timed = cast(keyqueue.Task[Any], producer.tasks["timed"])  # declared above: a Task, not a BatchTask
    horizon = max(due for _, due in dues) - dt.datetime.now(dt.UTC)

    async def one(key: str, due: dt.datetime) -> float:
        result: float = await timed.options(eta=due, timeout=horizon.total_seconds() + 60).call(key=key, due=due)
        return result

    return list(await asyncio.gather(*(one(key, due) for key, due in dues)))


async def measure(url: str, mode: str = "full") -> list[Lateness]:
    """Both workloads against the fleet serving ``url``."""
    spread, seconds, burst = SIZES[mode]
    rng = random.Random(16)
    producer = declare(keyqueue.App("bench-delays", url=url, set_as_default=False, autoload_plugins=False))
    try:
        now = dt.datetime.now(dt.UTC)
        rest = [(f"rest{i}", now + dt.timedelta(seconds=1 + rng.random() * seconds)) for i in range(spread)]
        at_rest = await _calls(producer, rest)
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        together = await _calls(producer, [(f"burst{i}", at) for i in range(burst)])
    finally:
        await producer.close()
    return [Lateness("at rest (spread due times)", at_rest), Lateness(f"burst ({burst} due at once)", together)]


async def run(mode: str = "full", work_dir: Path | None = None) -> list[Lateness]:
    """A fresh nats-server and ``WORKERS`` worker processes, then :func:`measure`."""
    async with EmbeddedServer(store_dir=work_dir / "delays-store" if work_dir else None) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
        env.update(KEYQUEUE_URL=server.url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
        keyqueue_cmd = str(Path(sys.executable).with_name("keyqueue"))
        procs = [await asyncio.create_subprocess_exec(
            keyqueue_cmd, "worker", "bench.delays:app", "--name", f"delays-{i}", "--log-level", "warning",
            cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            for i in range(WORKERS)]
        try:
            await _wait_for_movers(server.url)
            return await measure(server.url, mode)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                await proc.wait()


async def _wait_for_movers(url: str) -> None:
    """Until every worker process pulls due requests (each has its pull waiting on the server)."""
    from keyqueue.jetstream.api import JetStreamApi
    from keyqueue.jetstream.schedules import MOVERS, ScheduleNames

    probe = keyqueue.App("bench-delays-probe", url=url, set_as_default=False, autoload_plugins=False)
    try:
        api = JetStreamApi(await probe.connection())
        async with asyncio.timeout(60):
            while True:
                with contextlib.suppress(keyqueue.KeyqueueError):
                    info = await api.consumer_info(ScheduleNames(QUEUE).stream, MOVERS)
                    if info.get("num_waiting", 0) >= WORKERS:
                        return
                await asyncio.sleep(0.1)
    finally:
        await probe.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delays", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", dest="mode", action="store_const", const="quick")
    parser.add_argument("--smoke", dest="mode", action="store_const", const="smoke")
    args = parser.parse_args(argv)
    for result in asyncio.run(run(args.mode or "full")):
        print(result.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
