"""No run of any handler shape goes on beside the key's next holder (DESIGN invariant 1).

Real ``keyqueue worker`` processes on a real nats-server, each handler run logging to a file what
it did: ``start`` (with the pids of earlier runs that had started, not ended, and whose processes
were still alive at that instant, read from ``/proc``) and ``end``. A second run of a key that
starts while an earlier run's process is alive and that run has not ended is an overlap; the
handlers' own log says so, no timing is assumed. Each case breaks a different shape:

- a plain ``def`` in a thread whose worker is cut off from NATS past its lease (the thread cannot
  be stopped; before, it ran on for its 12 s beside the next holder);
- C code holding the GIL past the lease, with no fault at all (it froze the loop and the loop
  watchdog together; before, the next holder ran the key beside it);
- a ``--pool processes`` child whose worker is killed with SIGKILL (before, the child ran on as
  an orphan while the key moved).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from command_output import Command

from keyqueue.chaos.proxy import FaultProxy
from keyqueue.core.watchdog import EXIT_BLOCKED

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))
ACK_WAIT = "3"

APP = '''
import json
import os
import time
import uuid
from pathlib import Path

import keyqueue

app = keyqueue.App("shapes", set_as_default=False)
HERE = Path(__file__).parent
RUNS = HERE / "runs.jsonl"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _record(**fields) -> None:
    with open(RUNS, "a") as runs:
        runs.write(json.dumps({"pid": os.getpid(), "t": time.monotonic(), **fields}) + "\\n")


def begin(shape: str) -> tuple[str, bool]:
    """Log this run's start with the earlier runs still going on; whether it is the shape's first run."""
    runs = [json.loads(line) for line in RUNS.read_text().splitlines()] if RUNS.exists() else []
    ended = {r["run"] for r in runs if r["event"] == "end"}
    going = sorted({r["pid"] for r in runs if r["event"] == "start" and r["run"] not in ended
                    and r["pid"] != os.getpid() and _alive(r["pid"])})
    marker = HERE / f"{shape}.first"
    first = not marker.exists()
    marker.touch()
    run = uuid.uuid4().hex
    _record(event="start", run=run, shape=shape, first=first, going=going)
    return run, first


@app.task(key="{key}", max_attempts=5)
def threaded(key: str) -> str:
    run, first = begin("thread")
    if first:
        for _ in range(120):  # 12 s of sync work in a thread, far past the 3 s lease
            time.sleep(0.1)
    _record(event="end", run=run)
    return "done"


@app.task(key="{key}", max_attempts=5)
def gil_holder(key: str) -> str:
    run, first = begin("gil")
    if first:
        sum(range(10**12))  # C code that never lets the GIL go (for many minutes)
    _record(event="end", run=run)
    return "done"


@app.task(key="{key}", max_attempts=5)
def pooled(key: str) -> str:
    run, first = begin("pool")
    if first:
        time.sleep(30)
    _record(event="end", run=run)
    return "done"
'''


def runs(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def logged(tmp_path: Path, what: str, predicate: Any, workers: list[Command], timeout: float = 60) -> None:
    """Wait until the handlers' log satisfies ``predicate`` (the log is the event; it is read every 50 ms)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(runs(tmp_path)):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no {what} in {timeout}s; runs: {runs(tmp_path)}\n"
                                 + "\n---\n".join(w.output for w in workers))
        await asyncio.sleep(0.05)


class Fleet:
    def __init__(self, tmp_path: Path, nats_url: str) -> None:
        (tmp_path / "shapes_app.py").write_text(APP)
        self.tmp_path = tmp_path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
        self.env.update(KEYQUEUE_URL=nats_url, PYTHONUNBUFFERED="1", KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
        self.workers: list[Command] = []

    async def worker(self, name: str, *options: str, url: str | None = None) -> Command:
        env = dict(self.env, **({"KEYQUEUE_URL": url} if url else {}))
        worker = await Command.start(KEYQUEUE, "worker", "shapes_app:app", "--ack-wait", ACK_WAIT, "--name", name,
                                     *options, env=env, cwd=self.tmp_path)
        self.workers.append(worker)
        await worker.wait_for(r"serving queue")
        return worker

    async def enqueue(self, task: str) -> None:
        enqueue = await Command.start(KEYQUEUE, "enqueue", "shapes_app:app", task, '{"key": "k"}', env=self.env,
                                      cwd=self.tmp_path)
        assert await enqueue.wait() == 0, enqueue.output

    async def close(self) -> None:
        for worker in self.workers:
            if worker.proc.returncode is None:
                worker.proc.kill()
                await worker.wait()


def assert_no_overlap(log: list[dict[str, Any]]) -> None:
    starts = [r for r in log if r["event"] == "start"]
    assert len(starts) >= 2, log  # the key ran again on its next holder
    assert all(r["going"] == [] for r in starts), log  # ... and never while an earlier run went on


async def test_a_sync_task_in_a_thread_does_not_outlive_its_lost_lease(tmp_path: Path, nats_url: str) -> None:
    fleet = Fleet(tmp_path, nats_url)
    try:
        async with FaultProxy.for_url(nats_url) as proxy:
            cut_off = await fleet.worker("cut-off", url=proxy.url)
            await fleet.enqueue("threaded")
            await logged(tmp_path, "first run", lambda log: any(r["event"] == "start" for r in log), fleet.workers)
            proxy.blackhole()  # 9 s without NATS: renewals fail, the lease ends; the thread cannot be stopped
            await fleet.worker("next")
            status = await cut_off.wait(timeout=30)
            await logged(tmp_path, "second run's end", lambda log: any(r["event"] == "end" for r in log),
                         fleet.workers)
            proxy.heal()
    finally:
        await fleet.close()
    log = runs(tmp_path)
    assert status == EXIT_BLOCKED, cut_off.output
    assert cut_off.matches(r"still going on after their leases ended .* stopping this worker process now")
    assert_no_overlap(log)
    first = next(r for r in log if r["event"] == "start" and r["first"])
    assert not any(r["event"] == "end" and r["run"] == first["run"] for r in log)  # it ended with its process


async def test_c_code_holding_the_gil_past_the_lease_ends_with_its_process(tmp_path: Path, nats_url: str) -> None:
    fleet = Fleet(tmp_path, nats_url)
    try:
        holder = await fleet.worker("holder")
        await fleet.enqueue("gil_holder")
        await logged(tmp_path, "first run", lambda log: any(r["event"] == "start" for r in log), fleet.workers)
        await fleet.worker("next")  # free to take the key the moment the holder's lease record is gone
        status = await holder.wait(timeout=30)
        await logged(tmp_path, "second run's end", lambda log: any(r["event"] == "end" for r in log), fleet.workers)
    finally:
        await fleet.close()
    # Neither the loop nor the watchdog's thread could run: the kernel's lease alarm ended it.
    assert status == -signal.SIGKILL, holder.output
    assert_no_overlap(runs(tmp_path))


async def test_a_pool_child_dies_with_its_killed_worker(tmp_path: Path, nats_url: str) -> None:
    fleet = Fleet(tmp_path, nats_url)
    try:
        parent = await fleet.worker("parent", "--pool", "processes")
        await fleet.enqueue("pooled")
        await logged(tmp_path, "first run", lambda log: any(r["event"] == "start" for r in log), fleet.workers)
        [child] = {r["pid"] for r in runs(tmp_path)}
        assert child != parent.proc.pid  # the run is in a pool child
        parent.proc.kill()
        await parent.wait()
        await fleet.worker("next")
        await logged(tmp_path, "second run's end", lambda log: any(r["event"] == "end" for r in log), fleet.workers)
    finally:
        await fleet.close()
    assert_no_overlap(runs(tmp_path))
    assert not alive(child)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
