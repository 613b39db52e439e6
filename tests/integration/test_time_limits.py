"""Limits that stop work (``timeout``, ``soft_timeout``), a drain that keeps its deadline, and the
retry habits users bring from Celery (``retry_on``, ``Retry(countdown=...)``), against ``keyqueue
worker`` processes.

The app (written to ``tmp_path``) logs each run's start and end to a file, so the tests see how
often a request ran, whichever process ran it."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from command_output import Command

import keyqueue

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import asyncio
import time
from pathlib import Path

import keyqueue

app = keyqueue.App("limits", result_ttl=600, set_as_default=False)
LOG = Path(__file__).with_name("runs.log")


def note(line: str) -> None:
    with LOG.open("a") as log:
        log.write(line + "\\n")
    print(line, flush=True)  # the test reads the worker's output as it comes


@app.task(key="{key}", max_attempts=1)
def ledger(key: str, n: int, seconds: float) -> int:
    note(f"start {key} {n}")
    time.sleep(seconds)  # C code: no exception reaches it before it returns
    note(f"end {key} {n}")
    return n


@app.task(key="{key}", max_attempts=1, soft_timeout=0.3, timeout=20)
async def polite(key: str) -> str:
    try:
        await asyncio.sleep(30)
    except keyqueue.SoftTimeout:
        return "cleaned up (async)"
    return "slept"


@app.task(key="{key}", max_attempts=1, soft_timeout=0.3, timeout=20)
def polite_sync(key: str) -> str:
    try:
        for _ in range(3000):
            time.sleep(0.01)
    except keyqueue.SoftTimeout:
        return "cleaned up (sync)"
    return "slept"


@app.task(key="{key}", max_attempts=1, timeout=0.3)
def stubborn(key: str) -> str:
    while True:  # swallows every Exception: only the hard limit stops it
        try:
            time.sleep(0.01)
        except Exception:
            pass


@app.task(key="{key}", max_attempts=1, timeout=0.3)
async def stubborn_async(key: str) -> str:
    await asyncio.sleep(30)
    return "slept"


@app.task(key="{key}", max_attempts=1, soft_timeout=0.3, timeout=1)
def blocked(key: str, cleanup: bool) -> str:
    note(f"blocked {key}")
    try:
        time.sleep(60)  # C code: only a process pool stops it at the hard limit
    except keyqueue.SoftTimeout:
        if cleanup:
            return "cleaned up (process)"
        time.sleep(60)
    return "slept"


@app.task(key="{key}", max_attempts=5, backoff=0.01, retry_on=(ConnectionError,))
def flaky(key: str, error: str) -> str:
    note(f"flaky {key}")
    if error == "connection" and LOG.read_text().count(f"flaky {key}") < 3:
        raise ConnectionError("the bank is down")
    if error == "value":
        raise ValueError("a bug: retrying will not help")
    return "paid"


@app.task(key="{key}", max_attempts=3)
def later(key: str) -> float:
    note(f"later {key} {time.time()}")
    if LOG.read_text().count(f"later {key}") == 1:
        raise keyqueue.Retry("the statement is not ready", countdown=1.0)
    return time.time()
'''


def environment(nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


class Limits:
    def __init__(self, folder: Path, nats_url: str) -> None:
        self.folder, self.url = folder, nats_url
        self.log = folder / "runs.log"

    async def worker(self, *args: str) -> Command:
        worker = await Command.start(KEYQUEUE, "worker", "limits_app:app", *args, env=environment(self.url),
                                     cwd=self.folder)
        await worker.wait_for("serving queue limits")
        return worker

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
async def limits(tmp_path: Path, nats_url: str) -> AsyncIterator[tuple[Limits, Any]]:
    (tmp_path / "limits_app.py").write_text(APP)
    sys.path.insert(0, str(tmp_path))
    try:
        import limits_app

        app: keyqueue.App = limits_app.app
        app.settings = app.settings.with_url(nats_url)
        yield Limits(tmp_path, nats_url), limits_app
        await app.close()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("limits_app", None)


async def test_a_sync_run_that_completes_during_the_drain_is_kept_and_never_runs_again(
        limits: tuple[Limits, Any]) -> None:
    lim, mod = limits
    first = await lim.worker("--drain-timeout", "1")
    receipt = await mod.ledger.enqueue(key="acct", n=1, seconds=2.0)
    await first.wait_for("start acct 1")
    assert await first.stop() == 0  # drains: the run ends 1 s past the deadline, within the grace
    second = await lim.worker()
    try:
        assert await mod.ledger.call(key="acct", n=2, seconds=0.0, timeout=20) == 2  # behind the first, in order
        assert await receipt.result(timeout=5) == 1
    finally:
        await second.stop()
    assert lim.lines() == ["start acct 1", "end acct 1", "start acct 2", "end acct 2"]  # the first ran once


async def test_a_sync_task_stuck_past_the_drain_deadline_ends_its_worker(limits: tuple[Limits, Any]) -> None:
    lim, mod = limits
    worker = await lim.worker("--drain-timeout", "1")
    await mod.ledger.enqueue(key="stuck", n=1, seconds=60.0)
    await worker.wait_for("start stuck 1")
    # The drain deadline (1 s) and the grace (2 s) hold: the process ends, the sleeping thread with it.
    assert await worker.stop(timeout=15) == 75
    await worker.wait_for(r"1 key session\(s\) still ran 2s after the drain deadline .*stuck.*: stopping this "
                          r"worker process now \(exit status 75\)")
    assert lim.lines() == ["start stuck 1"]


async def test_soft_and_hard_limits_for_async_and_sync_tasks(limits: tuple[Limits, Any]) -> None:
    lim, mod = limits
    worker = await lim.worker()
    try:
        assert await mod.polite.call(key="a", timeout=20) == "cleaned up (async)"
        assert await mod.polite_sync.call(key="b", timeout=20) == "cleaned up (sync)"
        for task in (mod.stubborn, mod.stubborn_async):
            with pytest.raises(keyqueue.DeadLettered) as dead:
                await task.call(key="c", timeout=20)
            assert dead.value.type_name == "KeyqueueTimeout"
            assert f"task {task.name} exceeded its timeout of 0.3s" in dead.value.message
    finally:
        assert await worker.stop() == 0


async def test_retry_only_listed_exceptions_and_retry_with_a_countdown(limits: tuple[Limits, Any]) -> None:
    lim, mod = limits
    worker = await lim.worker()
    try:
        assert await mod.flaky.call(key="k1", error="connection", timeout=20) == "paid"  # retried: listed
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await mod.flaky.call(key="k2", error="value", timeout=20)
        assert (dead.value.type_name, dead.value.reason) == ("ValueError", "not-retried")
        assert await mod.later.call(key="k3", timeout=20) > 0
    finally:
        assert await worker.stop() == 0
    lines = lim.lines()
    assert lines.count("flaky k1") == 3 and lines.count("flaky k2") == 1
    [first, second] = [float(line.split()[2]) for line in lines if line.startswith("later k3")]
    assert second - first >= 1.0  # the task's own countdown, not its backoff (0.5 s)


async def test_the_process_pool_stops_sync_tasks_blocked_in_c_at_their_limits_and_the_drain(
        limits: tuple[Limits, Any]) -> None:
    lim, mod = limits
    worker = await lim.worker("--pool", "processes", "--drain-timeout", "1")
    try:
        # The soft limit interrupts time.sleep inside the child; the hard limit kills it.
        assert await mod.blocked.call(key="p1", cleanup=True, timeout=20) == "cleaned up (process)"
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await mod.blocked.call(key="p2", cleanup=False, timeout=20)
        assert dead.value.type_name == "KeyqueueTimeout"
        await mod.ledger.enqueue(key="pool", n=1, seconds=60.0)
        await worker.wait_for("start pool 1")
    finally:
        # The drain deadline holds: the child is killed, its run did not complete and stays stored.
        assert await worker.stop(timeout=15) == 0
    second = await lim.worker()
    try:
        await second.wait_for("start pool 1")  # runs again on the key's next holder
    finally:
        await second.stop(timeout=15)
    assert "end pool 1" not in lim.lines()
