"""``keyqueue worker --processes N``: a parent supervising N real worker processes on a real nats-server.

The app under test (written to ``tmp_path``) appends a start and an end record per run to a
JSON-lines log, with its process id as the worker; ``keyqueue.chaos.checker`` then checks that no
two runs of a key overlapped, that each key's requests completed in order, and that none was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import click
import pytest
from command_output import Command

from keyqueue.chaos.checker import check, read_log
from keyqueue.cli.supervisor import describe_exit
from keyqueue.cli.worker import ProcessCount
from keyqueue.server.local import running_local_servers

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import asyncio
import json
import os
import time
from pathlib import Path

import keyqueue

app = keyqueue.App("procs")
LOG = Path(__file__).with_name("runs.jsonl")


def record(kind, key, tag, **extra):
    entry = {"w": str(os.getpid()), "kind": kind, "t": time.time(), "key": key, "tag": tag, **extra}
    with open(LOG, "a") as log:
        log.write(json.dumps(entry) + "\\n")


@app.task(key="{key}", max_attempts=5, backoff=0.05)
async def step(key: str, tag: str, sleep: float = 0.02) -> str:
    record("start", key, tag)
    print(f"start {key} {tag}", flush=True)
    try:
        await asyncio.sleep(sleep)
    except BaseException:
        record("end", key, tag, ok=False)
        raise
    record("end", key, tag)
    return tag
'''


class Parent(Command):
    """The ``keyqueue worker procs_app:app --processes`` parent; its stdout and stderr lines, read as they come."""

    @classmethod
    async def start(cls, *args: str, cwd: Path, env: dict[str, str]) -> Parent:  # type: ignore[override]
        return await super().start(str(KEYQUEUE), "worker", "procs_app:app", *args, env=env, cwd=cwd)

    def child_pids(self) -> dict[str, int]:
        """Each child's name -> the pid of its latest process."""
        return {m[1]: int(m[2]) for m in self.matches(r"started worker process (\S+) \(pid (\d+)\)")}


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(values)
    return env


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "procs_app.py").write_text(APP)
    return tmp_path


@pytest.fixture
async def producer(app_dir: Path, nats_url: str) -> AsyncIterator[ModuleType]:
    """The app module imported in this process, connected to ``nats_url``, to enqueue and call."""
    spec = importlib.util.spec_from_file_location(f"procs_app_{id(app_dir)}", app_dir / "procs_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.app.settings = module.app.settings.with_url(nats_url)
    try:
        yield module
    finally:
        await module.app.close()


@contextlib.asynccontextmanager
async def parent(*args: str, cwd: Path, env: dict[str, str], ready: int) -> AsyncIterator[Parent]:
    """A started parent whose ``ready`` children serve the queue; stopped (if still running) after."""
    proc = await Parent.start(*args, cwd=cwd, env=env)
    try:
        await proc.wait_for(r"\] .*queue procs: step", count=ready)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            await proc.stop()


def append_line(path: Path, line: str) -> None:
    with open(path, "a") as log:
        log.write(line + "\n")


def expected(keys: int, per_key: int) -> dict[str, list[str]]:
    return {f"k{k}": [f"k{k}-{i}" for i in range(per_key)] for k in range(keys)}


async def run_requests(producer: ModuleType, plan: dict[str, list[str]], sleep: float) -> None:
    """Enqueue every request, then wait for the last of each key (each key's requests run in order)."""
    for key, tags in plan.items():
        for tag in tags[:-1]:
            await producer.step.enqueue(key=key, tag=tag, sleep=sleep)
    await asyncio.gather(*(producer.step.call(key=key, tag=tags[-1], sleep=sleep, timeout=30)
                           for key, tags in plan.items()))


async def test_three_processes_share_the_keys_exclusively_and_in_order(
        app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    async with parent("--processes", "3", "--concurrency", "2", cwd=app_dir,
                      env=environment(KEYQUEUE_URL=nats_url), ready=3) as proc:
        assert len(proc.child_pids()) == 3
        plan = expected(keys=12, per_key=6)
        await run_requests(producer, plan, sleep=0.05)
        assert await proc.stop() == 0, proc.output
    records = read_log(app_dir / "runs.jsonl")
    verdict = check(records, plan)
    assert verdict.ok and not verdict.duplicates, verdict.summary()
    assert len({r["w"] for r in records}) > 1
    assert set(proc.child_pids().values()) >= {int(r["w"]) for r in records}
    # Each child's lines are relayed with its name.
    assert all(proc.matches(rf"^\[{re.escape(name)}\] ") for name in proc.child_pids())


async def test_a_killed_child_is_restarted_and_its_keys_move_on(
        app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    async with parent("--processes", "3", "--concurrency", "2", "--ack-wait", "2", cwd=app_dir,
                      env=environment(KEYQUEUE_URL=nats_url), ready=3) as proc:
        plan = expected(keys=8, per_key=8)
        load = asyncio.create_task(run_requests(producer, plan, sleep=0.1))
        [busy] = (await proc.wait_for(r"^\[(\S+)\] start "))[:1]
        victim = proc.child_pids()[busy[1]]
        os.kill(victim, signal.SIGKILL)
        await proc.wait_for(rf"worker process {re.escape(busy[1])} \(pid {victim}\) was killed by SIGKILL")
        killed = json.dumps({"w": str(victim), "kind": "killed", "t": time.time()})
        await asyncio.to_thread(append_line, app_dir / "runs.jsonl", killed)  # reaped: its open runs end here
        await proc.wait_for(rf"started worker process {re.escape(busy[1])} ", count=2)
        await asyncio.wait_for(load, 30)
        assert await proc.stop() == 0, proc.output
    verdict = check(read_log(app_dir / "runs.jsonl"), plan)
    assert verdict.ok, verdict.summary()  # a re-run of the killed child's request is allowed


async def test_the_parent_releases_a_dead_childs_keys_at_once(
        app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    """Before, the parent saw its child die, yet the child's keys waited out its leases (30 s
    here). Now the parent releases them as it reaps the child, and another child takes them."""
    async with parent("--processes", "2", "--ack-wait", "30", cwd=app_dir,
                      env=environment(KEYQUEUE_URL=nats_url), ready=2) as proc:
        await producer.step.enqueue(key="held", tag="held-0", sleep=3600)  # runs until its worker dies
        [first] = await proc.wait_for(r"^\[(\S+)\] start held held-0")
        victim = proc.child_pids()[first[1]]
        os.kill(victim, signal.SIGKILL)
        await proc.wait_for(rf"released 1 key\(s\) of queue procs that {re.escape(first[1])} \(pid {victim}\) "
                            r"held: held")
        # Run again (at least once) by a live child long before the 30 s lease would have ended.
        await proc.wait_for(r"^\[(\S+)\] start held held-0", count=2, timeout=15)
        assert await proc.stop() == 0, proc.output


async def test_sigterm_drains_every_child_on_the_shared_embedded_server(app_dir: Path) -> None:
    data = app_dir / "data"
    env = environment(KEYQUEUE_DATA_DIR=str(data))
    async with parent("--processes", "2", cwd=app_dir, env=env, ready=2) as proc:
        # The parent started the one server; the children were given its URL.
        assert len(proc.matches("started an embedded nats-server")) == 1
        assert not proc.matches(r"^\[.*embedded nats-server")
        [url] = running_local_servers(data).values()
        spec = importlib.util.spec_from_file_location("procs_app_embedded", app_dir / "procs_app.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.app.settings = module.app.settings.with_url(url)
        try:
            assert await module.step.call(key="a", tag="a-0", timeout=30) == "a-0"
        finally:
            await module.app.close()
        pids = proc.child_pids().values()
        assert await proc.stop() == 0, proc.output
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert running_local_servers(data) == {}  # the parent's server stopped after its children
    assert len(proc.matches(r"worker \S+ stopped: ")) == 2


async def test_a_child_that_keeps_failing_at_start_ends_the_parent(app_dir: Path, nats_url: str) -> None:
    proc = await Parent.start("--processes", "2", "--queue", "nope", cwd=app_dir,
                              env=environment(KEYQUEUE_URL=nats_url))
    assert await proc.wait() == 1, proc.output
    errors = [line for line in proc.lines if line.startswith("Error:")]
    assert len(errors) == 1, proc.output
    assert "exited with status 1" in errors[0] and "3 times in a row" in errors[0]
    assert "queue(s) nope" in errors[0]
    assert len(proc.matches("restarting it in")) <= 2 * 2


def test_processes_count() -> None:
    assert ProcessCount().convert("auto", None, None) == (os.cpu_count() or 1)
    assert ProcessCount().convert("4", None, None) == 4
    for bad in ("0", "many"):
        with pytest.raises(click.BadParameter):
            ProcessCount().convert(bad, None, None)
    assert describe_exit(-9).startswith("was killed by SIGKILL (") and describe_exit(3) == "exited with status 3"
    assert "lease alarm" in describe_exit(-9) and "loop watchdog" in describe_exit(75)
