"""Workflows under kill -9: real ``keyqueue worker --processes 3`` fleets on a real nats-server.

A chain goes on when its producer is killed right after enqueueing it, and when the worker in each
of its steps is killed mid-step or right after handing its result on (before its request left the
inbox): a step killed runs again, and every step is stored once (an enqueue repeated after a
crash finds its request id stored). A chord's callback runs exactly once when a member's worker
is killed mid-member and the member that completed the group is killed right after enqueueing the
callback (so it ran twice).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest
from command_output import Command

from keyqueue import chord

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import keyqueue

HERE = Path(__file__).parent
CRASH_AFTER = {int(s) for s in os.environ.get("WF_CRASH_AFTER_ENQUEUEING", "").split(",") if s}


def record(kind, tag, **extra):
    with open(HERE / "runs.jsonl", "a") as log:
        log.write(json.dumps({"w": os.getpid(), "kind": kind, "tag": tag, "t": time.time(), **extra}) + "\\n")


class StepsStored:
    """Log each enqueue of a workflow's step and whether the inbox stored it or knew it already (a
    duplicate of its request id); kill this worker the first time it has stored a step named in
    WF_CRASH_AFTER_ENQUEUEING: the step that enqueued it ran, handed on, and is still in its inbox."""

    @keyqueue.hookimpl
    def keyqueue_wrap_enqueue(self, app, request):
        step = request.headers.get("X-KQ-Workflow-Step")
        if step is None:
            return None
        mark = HERE / f"crashed-{step}"

        @contextlib.contextmanager
        def watch():
            yield
            if request.receipt is None:
                return
            record("stored", f"step-{step}", duplicate=request.receipt.duplicate)
            if int(step) in CRASH_AFTER and not mark.exists():
                mark.touch()
                record("crash", f"after-enqueueing-{step}")
                print(f"crashing after enqueueing step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        return watch()


app = keyqueue.App("wfprocs", plugins=[StepsStored()])


@app.task(key="{key}", max_attempts=5, backoff=0.05)
async def stage(value: int, key: str, tag: str, hold: float = 0.0) -> int:
    """Adds one; its first run of ``tag`` holds on for ``hold`` seconds (the tests kill it meanwhile)."""
    first = HERE / f"ran-{tag}"
    holds = not first.exists()
    first.touch()  # before it says it started: a kill that follows the line finds it
    record("start", tag)
    print(f"start {tag}", flush=True)
    if holds:
        await asyncio.sleep(hold)
    record("end", tag)
    print(f"end {tag}", flush=True)
    return value + 1


@app.task(key="total")
async def total(values: list[int]) -> int:
    record("start", "callback")
    print("start callback", flush=True)
    record("end", "callback")
    return sum(values)
'''

PRODUCER = '''
import asyncio
import sys

import wfapp


async def main():
    wfapp.app.settings = wfapp.app.settings.with_url(sys.argv[1])
    receipt = await (wfapp.stage.s(0, "p0", "p0", 0.2) | wfapp.stage.s("p1", "p1", 0.2)
                     | wfapp.stage.s("p2", "p2", 0.2)).enqueue(workflow_id=sys.argv[2])
    print("enqueued", receipt.workflow_id, flush=True)
    await asyncio.sleep(3600)  # killed here


asyncio.run(main())
'''


class Parent(Command):
    """``keyqueue worker wfapp:app --processes 2``: its children's lines, prefixed with their names."""

    def child_pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for m in self.matches(r"started worker process (\S+) \(pid (\d+)\)")}


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYQUEUE_", "WF_"))}
    env.update(values)
    return env


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "wfapp.py").write_text(APP)
    (tmp_path / "producer.py").write_text(PRODUCER)
    return tmp_path


@pytest.fixture
async def producer(app_dir: Path, nats_url: str) -> AsyncIterator[ModuleType]:
    """The app module imported in this process (it crashes nothing here: no WF_ variable)."""
    spec = importlib.util.spec_from_file_location(f"wfapp_{id(app_dir)}", app_dir / "wfapp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.app.settings = module.app.settings.with_url(nats_url)
    try:
        yield module
    finally:
        await module.app.close()


@contextlib.asynccontextmanager
async def fleet(app_dir: Path, nats_url: str, *, ready: bool = True, **env: str) -> AsyncIterator[Parent]:
    """Three worker processes under a parent that releases a dead child's keys at once (so the step
    runs again at once). A token a child was delivered but had not acquired yet waits out the lease
    (``--ack-wait 3``). ``ready``: return once every child serves the queue."""
    proc = await Parent.start(KEYQUEUE, "worker", "wfapp:app", "--processes", "3", "--concurrency", "4",
                              "--ack-wait", "3", env=environment(KEYQUEUE_URL=nats_url, **env), cwd=app_dir)
    try:
        if ready:
            await proc.wait_for(r"\] .*queue wfprocs: ", count=3)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            await proc.stop()


def runs(app_dir: Path) -> tuple[Counter[str], Counter[str]]:
    """How many times each tag started and ended."""
    lines = [json.loads(line) for line in (app_dir / "runs.jsonl").read_text().splitlines() if line.strip()]
    return (Counter(r["tag"] for r in lines if r["kind"] == "start"),
            Counter(r["tag"] for r in lines if r["kind"] == "end"))


def stores(app_dir: Path) -> tuple[Counter[str], Counter[str]]:
    """How many times each step's request was stored, and how many times it was enqueued again and
    found stored already (its request id repeated within the inbox's duplicate window)."""
    lines = [json.loads(line) for line in (app_dir / "runs.jsonl").read_text().splitlines() if line.strip()]
    stored = [r for r in lines if r["kind"] == "stored"]
    return (Counter(r["tag"] for r in stored if not r["duplicate"]),
            Counter(r["tag"] for r in stored if r["duplicate"]))


async def kill_the_child_running(proc: Parent, tag: str) -> None:
    """SIGKILL the worker process that printed ``start <tag>`` (its first run of it)."""
    [started] = await proc.wait_for(rf"^\[(\S+)\] start {re.escape(tag)}$")
    victim = proc.child_pids()[started[1]]
    os.kill(victim, signal.SIGKILL)
    await proc.wait_for(rf"\(pid {victim}\) was killed by SIGKILL")


async def test_a_chain_survives_kill_9_of_its_producer(app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    async with fleet(app_dir, nats_url, ready=False) as proc:  # the chain waits for the workers to start
        maker = await Command.start(sys.executable, str(app_dir / "producer.py"), nats_url, "wf-orphan",
                                    env=environment(PYTHONPATH=str(app_dir)), cwd=app_dir)
        await maker.wait_for(r"^enqueued wf-orphan$")
        maker.proc.kill()  # right after its enqueue returned
        assert await maker.wait() == -signal.SIGKILL
        assert await producer.app.result("wf-orphan", timeout=30) == 3
        assert await proc.stop() == 0, proc.output
    started, ended = runs(app_dir)
    assert started == ended == Counter({"p0": 1, "p1": 1, "p2": 1})
    assert stores(app_dir) == (Counter({"step-0": 1, "step-1": 1, "step-2": 1}), Counter())


async def test_a_chain_survives_kill_9_of_the_worker_in_each_step(
        app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    stage = producer.stage
    # Step 1 kills its own worker right after storing step 2's request, before its own leaves the inbox.
    async with fleet(app_dir, nats_url, WF_CRASH_AFTER_ENQUEUEING="2") as proc:
        chain = (stage.s(0, "k0", "s0", 60) | stage.s("k1", "s1") | stage.s("k2", "s2", 60)
                 | stage.s("k3", "s3", 60))
        receipt = await chain.enqueue()
        await kill_the_child_running(proc, "s0")  # mid-step: it runs again on the key's next holder
        await proc.wait_for(r"crashing after enqueueing step 2$")
        await kill_the_child_running(proc, "s2")
        await kill_the_child_running(proc, "s3")
        assert await receipt.result(timeout=60) == 4
        # Step 1 runs again once its key has a holder again (and hands on again): not needed for the result.
        await proc.wait_for(r"^\[\S+\] end s1$", count=2, timeout=60)
        assert await proc.stop() == 0, proc.output
    started, ended = runs(app_dir)
    assert all(started[f"s{i}"] >= 2 for i in range(4)), started  # each step's worker died once
    assert all(ended[f"s{i}"] >= 1 for i in range(4)), ended
    assert ended["s1"] >= 2  # it handed on, died, ran again and handed on again...
    stored, again = stores(app_dir)
    assert stored == Counter({f"step-{i}": 1 for i in range(4)}), stored  # ...yet every step was stored once
    assert again["step-2"] >= 1, again
    view = await producer.app.workflow(receipt.workflow_id)
    assert view is not None and [s.state for s in view.steps] == ["done"] * 4


async def test_a_chord_callback_runs_exactly_once_under_a_member_killed_mid_run(
        app_dir: Path, nats_url: str, producer: ModuleType) -> None:
    stage, total = producer.stage, producer.total
    members = [stage.s(i, f"m{i}", f"m{i}", 60 if i == 3 else 0.1) for i in range(8)]
    callback = 8  # the callback's step number: after the 8 members
    # The member that completes the group kills its worker right after enqueueing the callback, so it runs twice.
    async with fleet(app_dir, nats_url, WF_CRASH_AFTER_ENQUEUEING=str(callback)) as proc:
        receipt = await chord(members, total.s()).enqueue()
        await kill_the_child_running(proc, "m3")
        assert await receipt.result(timeout=60) == sum(range(1, 9))
        # The crashing member's line comes through its parent's pipe, and may arrive after the
        # callback's result has come through NATS: awaited, not assumed.
        await proc.wait_for(rf"crashing after enqueueing step {callback}$", timeout=60)
        # That member runs again once its key has a holder again (not needed for the result): 9 ends in all.
        await proc.wait_for(r"^\[\S+\] end m\d+$", count=9, timeout=60)
        assert await proc.stop() == 0, proc.output
        assert len(proc.matches(rf"crashing after enqueueing step {callback}$")) == 1
    started, ended = runs(app_dir)
    assert started["callback"] == ended["callback"] == 1
    assert started["m3"] >= 2 and all(ended[f"m{i}"] >= 1 for i in range(8))
    assert sum(ended[f"m{i}"] for i in range(8)) >= 9  # the member that completed the group ended twice
    stored, _ = stores(app_dir)
    # Its run again either enqueues the callback again (stored once: the duplicate window) or finds the
    # join already handed on and enqueues nothing, depending on where the kill caught the first run:
    # either way the callback is stored, and runs, exactly once.
    assert stored == Counter({f"step-{i}": 1 for i in range(9)}), stored
