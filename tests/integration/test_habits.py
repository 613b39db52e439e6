"""Habits users bring from Celery that keyqueue lacked, each against a real server and, where it
is about a worker, ``keyqueue worker`` processes: purge, ``expires``, ``options(queue=)`` and
``--max-requests-per-child`` (``retry_on`` and ``Retry(countdown=)``: test_time_limits.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
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
import os

import keyqueue

app = keyqueue.App("habits", result_ttl=600, set_as_default=False)
app.add_queue("habits-priority")


@app.task(key="{key}")
def charge(key: str, n: int) -> str:
    print(f"ran {key} {n} pid={os.getpid()}", flush=True)
    return f"{key}:{n}"


@app.task(key="{key}")
def refund(key: str, n: int) -> str:
    print(f"refund {key} {n}", flush=True)
    return f"refund {key}:{n}"
'''


def environment(nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


@pytest.fixture
async def habits(tmp_path: Path, nats_url: str) -> AsyncIterator[Any]:
    (tmp_path / "habits_app.py").write_text(APP)
    sys.path.insert(0, str(tmp_path))
    try:
        import habits_app

        habits_app.app.settings = habits_app.app.settings.with_url(nats_url)
        habits_app.folder = tmp_path
        yield habits_app
        await habits_app.app.close()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("habits_app", None)


async def start_worker(mod: Any, nats_url: str, *args: str) -> Command:
    return await Command.start(KEYQUEUE, "worker", "habits_app:app", *args, env=environment(nats_url),
                               cwd=mod.folder)


async def keyqueue_cli(nats_url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(KEYQUEUE, *args, env=environment(nats_url),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_purge_removes_pending_requests_by_key_or_task_with_a_confirmation(habits: Any, nats_url: str) -> None:
    charge, refund, app = habits.charge, habits.refund, habits.app
    await charge.enqueue_many([{"key": k, "n": n} for k in ("a", "b") for n in range(3)])
    await refund.enqueue_many([{"key": k, "n": 9} for k in ("a", "b")])
    code, out, err = await keyqueue_cli(nats_url, "purge", "habits", "--key", "a")  # no --yes, no terminal
    assert code == 1 and "Remove 4 pending request(s) from queue habits (key a)? They will never run" in out + err
    code, out, _ = await keyqueue_cli(nats_url, "purge", "habits", "--key", "a", "--yes")
    assert (code, out) == (0, "removed 4 pending request(s) from queue habits (key a)\n")
    assert await app.purge(task="refund") == 1  # b's refund; b's charges keep their order
    code, out, _ = await keyqueue_cli(nats_url, "purge", "habits", "--task", "refund", "--yes")
    assert (code, out) == (0, "no pending requests in queue habits (task refund)\n")
    worker = await start_worker(habits, nats_url)
    try:
        assert await charge.call(key="b", n=3, timeout=20) == "b:3"
    finally:
        await worker.stop()
    assert [m[0] for m in worker.matches(r"(ran|refund) \w \d")] == ["ran b 0", "ran b 1", "ran b 2", "ran b 3"]


async def test_expired_requests_do_not_run_and_say_so(habits: Any, nats_url: str) -> None:
    charge, app = habits.charge, habits.app
    stale = await charge.options(expires=0.5).enqueue(key="e", n=1)
    past = await charge.options(expires=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).enqueue(key="e", n=2)
    fresh = await charge.options(expires=600).enqueue(key="e", n=3)
    await asyncio.sleep(0.6)  # the first one's expires time passes: there is no event for it
    worker = await start_worker(habits, nats_url)
    try:
        for receipt in (stale, past):
            with pytest.raises(keyqueue.Expired):
                await receipt.result(timeout=20)
        assert await fresh.result(timeout=20) == "e:3"
        assert [await app.status(r.request_id) for r in (stale, past, fresh)] == ["expired", "expired", "done"]
    finally:
        await worker.stop()
    assert [m[0] for m in worker.matches(r"ran e \d")] == ["ran e 3"]
    with pytest.raises(keyqueue.ConfigError, match="expires must be a number of seconds > 0"):
        charge.options(expires=-1)


async def test_options_queue_routes_a_request_to_another_queue_and_its_workers(habits: Any, nats_url: str) -> None:
    charge = habits.charge
    priority = await start_worker(habits, nats_url, "--queue", "habits-priority")
    try:
        await priority.wait_for(r"queue habits-priority: serial tasks sent with options\(queue=...\)")
        receipt = await charge.options(queue="habits-priority").enqueue(key="r", n=1)
        assert receipt.queue == "habits-priority"
        assert await receipt.result(timeout=20) == "r:1"  # no worker serves queue habits: this one ran it
        assert priority.matches(r"ran r 1")
    finally:
        await priority.stop()
    with pytest.raises(keyqueue.ConfigError, match=r"declare it with app.add_queue\('nowhere'\)"):
        await charge.options(queue="nowhere").enqueue(key="r", n=2)


async def test_max_requests_per_child_replaces_a_worker_process_after_n_requests(habits: Any, nats_url: str) -> None:
    charge = habits.charge
    parent = await start_worker(habits, nats_url, "--processes", "1", "--max-requests-per-child", "3",
                                "--concurrency", "1")
    try:
        await parent.wait_for(r"serving queue habits\b")
        for n in range(7):
            assert await charge.call(key="m", n=n, timeout=30) == f"m:{n}"
        await parent.wait_for(r"served its --max-requests-per-child and drained; starting a new one", count=2)
    finally:
        assert await parent.stop() == 0
    pids = [m[1] for m in parent.matches(r"ran m \d pid=(\d+)")]
    assert len(pids) == 7
    assert len(set(pids[:3])) == len(set(pids[3:6])) == 1 and len({pids[0], pids[3], pids[6]}) == 3
