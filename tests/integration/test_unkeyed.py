"""Unkeyed tasks (``@app.task()`` without ``key=``) on a real nats-server, served by real
``keyqueue worker`` processes: every request runs, results come back, failures are retried and
then dead-lettered with the reason (and replayed), a pending request is cancelled and says so, and
a request whose worker is killed with SIGKILL part-way runs again on the next worker; async
handlers, sync ones in threads and sync ones in a ``--pool processes`` child. None of it takes a
key's lock: no token, no lease record, nothing in the inbox.

The app under test is written to ``tmp_path``; each run its handlers make appends a line to
``runs.jsonl`` (the file is the event the tests wait for).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from command_output import Command

from keyqueue import Cancelled, DeadLettered
from keyqueue.admin.dead_letters import dead_letters, replay
from keyqueue.errors import StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.subjects import UNKEYED, QueueNames
from keyqueue.wire import headers as H

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import asyncio
import json
import os
import threading
import time
from pathlib import Path

import keyqueue

app = keyqueue.App("plain", set_as_default=False, result_ttl=300)
HERE = Path(__file__).parent


def record(ctx, **fields):
    line = {"pid": os.getpid(), "thread": threading.current_thread().name, "id": ctx.request_id, "key": ctx.key,
            "attempt": ctx.attempt, "delivered": ctx.fencing[1], **fields}
    with open(HERE / "runs.jsonl", "a") as runs:
        runs.write(json.dumps(line) + "\\n")


@app.task()
async def add(ctx: keyqueue.Context, x: int, y: int) -> int:
    record(ctx, task="add")
    await asyncio.sleep(0)
    return x + y


@app.task()
def mul(ctx: keyqueue.Context, x: int, y: int) -> int:
    record(ctx, task="mul")
    return x * y


@app.task(max_attempts=3, backoff=0.01)
async def flaky(ctx: keyqueue.Context, n: int) -> int:
    record(ctx, task="flaky")
    if not (HERE / "flaky-ok").exists():
        raise RuntimeError(f"flaky {n} failed")
    return n


@app.task(max_attempts=3)
async def refuse(ctx: keyqueue.Context, n: int) -> None:
    record(ctx, task="refuse")
    raise keyqueue.Reject(f"request {n} is not acceptable")


@app.task()
async def hold(ctx: keyqueue.Context, name: str) -> str:
    record(ctx, task="hold", name=name)
    while not (HERE / name).exists():  # released by the test
        await asyncio.sleep(0.02)
    return name


@app.task(max_attempts=3, backoff=60)
async def patient(ctx: keyqueue.Context, n: int) -> int:
    record(ctx, task="patient")
    if ctx.fencing[1] == 1:
        raise RuntimeError("its first delivery fails, and the retry would wait 60 s")
    return n


@app.task()
def stall(ctx: keyqueue.Context, name: str) -> str:
    record(ctx, task="stall", name=name)
    if ctx.fencing[1] == 1:  # its first delivery: killed with its worker part-way
        time.sleep(60)
    return name
'''


class Plain:
    """The app in ``tmp_path``: its ``keyqueue worker`` processes and, imported here, its producer."""

    def __init__(self, tmp_path: Path, nats_url: str, app: ModuleType) -> None:
        self.tmp_path = tmp_path
        self.nats_url = nats_url
        self.app = app
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
        self.env.update(KEYQUEUE_URL=nats_url, PYTHONUNBUFFERED="1", KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
        self.workers: list[Command] = []

    async def worker(self, *options: str) -> Command:
        worker = await Command.start(KEYQUEUE, "worker", "plain_app:app", *options, env=self.env, cwd=self.tmp_path)
        self.workers.append(worker)
        await worker.wait_for(r"serving queue plain")
        return worker

    def runs(self, task: str | None = None) -> list[dict[str, Any]]:
        path = self.tmp_path / "runs.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [line for line in lines if task is None or line["task"] == task]

    async def logged(self, what: str, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Wait until the handlers' log satisfies ``predicate``."""
        await until(what, lambda: _true(predicate(self.runs())))

    async def close(self) -> None:
        for worker in self.workers:
            if worker.proc.returncode is None:
                worker.proc.kill()
                await worker.wait()


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    """Wait until ``check()`` is true, asking every 20 ms (what the tests wait for is a file or a server's state)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no {what} within {timeout}s")
        await asyncio.sleep(0.02)


async def _true(value: bool) -> bool:
    return value


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.fixture
async def plain(tmp_path: Path, nats_url: str) -> AsyncIterator[Plain]:
    (tmp_path / "plain_app.py").write_text(APP)
    spec = importlib.util.spec_from_file_location(f"plain_app_{id(tmp_path)}", tmp_path / "plain_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.app.settings = module.app.settings.with_url(nats_url)
    fleet = Plain(tmp_path, nats_url, module)
    try:
        yield fleet
    finally:
        await fleet.close()
        await module.app.close()


async def test_every_request_runs_once_with_its_result_and_no_key_is_locked(plain: Plain) -> None:
    app = plain.app
    await plain.worker("--concurrency", "8")
    adds = await app.add.enqueue_many([{"x": i, "y": 1} for i in range(200)])
    muls = await app.mul.enqueue_many([{"x": i, "y": 3} for i in range(100)])
    results = await asyncio.gather(*(receipt.result(timeout=30) for receipt in adds + muls))

    assert results == [i + 1 for i in range(200)] + [i * 3 for i in range(100)]
    runs = plain.runs()
    assert sorted(r["id"] for r in runs) == sorted(r.request_id for r in adds + muls)  # each ran, once
    assert {r.key for r in adds + muls} == {UNKEYED} and {r["key"] for r in runs} == {UNKEYED}
    assert {r["thread"] for r in runs if r["task"] == "add"} == {"MainThread"}  # async: on the loop
    assert all(r["thread"].startswith("keyqueue-") for r in runs if r["task"] == "mul")  # sync: in threads
    nc = await connect(plain.nats_url)
    try:
        api, names = JetStreamApi(nc), QueueNames("plain")
        work = (await api.stream_info(names.work_stream))["state"]
        assert (work["messages"], work["last_seq"]) == (0, 300)  # stored there, each acked (removed)
        assert (await api.stream_info(names.inbox_stream))["state"]["last_seq"] == 0
        assert (await api.stream_info(names.token_stream))["state"]["last_seq"] == 0  # no token, ever
        assert await api.subjects(names.lease_stream, names.lease_prefix + ">") == {}  # no lease record
    finally:
        await nc.close()


async def test_failures_are_retried_then_dead_lettered_with_the_reason_and_replayed(plain: Plain) -> None:
    app = plain.app
    await plain.worker()
    flaky = await app.flaky.enqueue(n=7)
    with pytest.raises(DeadLettered) as failed:
        await flaky.result(timeout=30)
    with pytest.raises(DeadLettered) as refused:
        await app.refuse.call(n=8, timeout=30)

    assert failed.value.reason == "max-attempts" and failed.value.type_name == "RuntimeError"
    assert refused.value.reason == "rejected"
    assert [r["attempt"] for r in plain.runs("flaky")] == [1, 2, 3]
    assert [r["attempt"] for r in plain.runs("refuse")] == [1]  # bad input is not retried
    assert await flaky.status() == "failed"
    nc = await connect(plain.nats_url)
    try:
        api, names = JetStreamApi(nc), QueueNames("plain")
        letters = {letter.message_type: letter for letter in await dead_letters(api, "plain", key=UNKEYED)}
        assert set(letters) == {"flaky", "refuse"}
        dead = letters["flaky"]
        assert (dead.reason, dead.attempts, dead.error_type) == ("max-attempts", 3, "RuntimeError")
        assert dead.request_id == flaky.request_id and dead.error_message == "flaky 7 failed"
        assert dead.headers[H.DLQ_ORIGINAL_SUBJECT] == names.work("flaky")
        assert (letters["refuse"].reason, letters["refuse"].attempts) == ("rejected", 1)
        assert (await api.stream_info(names.work_stream))["state"]["messages"] == 0  # acked once dead

        (plain.tmp_path / "flaky-ok").touch()
        assert await replay(api, Publisher(nc, names), "plain", seqs=[dead.seq]) == 1
        await plain.logged("the replayed run", lambda runs: len([r for r in runs if r["task"] == "flaky"]) == 4)
        replayed = plain.runs("flaky")[-1]["id"]
        assert replayed == f"{flaky.request_id}.replay-{dead.seq}"
        assert await app.app.result(replayed, queue="plain", timeout=30) == 7  # back in the work stream, ran
    finally:
        await nc.close()


async def test_a_pending_request_is_cancelled_and_never_runs(plain: Plain) -> None:
    app = plain.app
    await plain.worker("--concurrency", "1")  # one slot: the second request waits while the first runs
    first = await app.hold.enqueue(name="first")
    await plain.logged("the first run", lambda runs: any(r.get("name") == "first" for r in runs))
    second = await app.hold.enqueue(name="second")

    assert await first.status() == "running"
    assert await second.status() == "pending"
    assert await second.cancel() == "pending"  # it will not start
    (plain.tmp_path / "first").touch()
    assert await first.result(timeout=30) == "first"
    with pytest.raises(Cancelled):
        await second.result(timeout=30)
    assert await second.status() == "cancelled"
    assert await first.status() == "done"
    assert [r["name"] for r in plain.runs("hold")] == ["first"]


async def test_a_request_whose_worker_is_killed_part_way_runs_again_on_the_next(plain: Plain) -> None:
    app = plain.app
    # A sync task in a pool child: the child dies with its worker, and the request is delivered again
    # once its lease (2 s) ends.
    doomed = await plain.worker("--ack-wait", "2", "--pool", "processes")
    receipt = await app.stall.enqueue(name="s1")
    await plain.logged("the first run", lambda runs: len(runs) == 1)
    [child] = [r["pid"] for r in plain.runs()]
    assert child != doomed.proc.pid
    doomed.proc.kill()
    await doomed.wait()
    await until("the pool child's end", lambda: _true(_ended(child)))  # the kernel ends it with its parent
    await plain.worker("--ack-wait", "2")

    assert await receipt.result(timeout=30) == "s1"
    assert [(r["delivered"], r["attempt"]) for r in plain.runs()] == [(1, 1), (2, 1)]
    assert plain.runs()[1]["thread"].startswith("keyqueue-")


async def test_a_drain_gives_a_request_waiting_out_its_backoff_to_the_next_worker(plain: Plain) -> None:
    app = plain.app
    draining = await plain.worker("--drain-timeout", "60")
    receipt = await app.patient.enqueue(n=3)
    await plain.logged("the failed first attempt", lambda runs: len(runs) == 1)
    # SIGTERM: neither the retry's 60 s nor the drain's 60 s are waited out: the request goes back.
    assert await draining.stop(timeout=20) == 0
    await plain.worker()

    assert await receipt.result(timeout=20) == 3  # the next worker has it at once (the lease is 30 s)
    assert [(r["delivered"], r["attempt"]) for r in plain.runs()] == [(1, 1), (2, 1)]


async def test_an_older_queue_gains_unkeyed_tasks_delays_and_rate_limits(nats_url: str) -> None:
    import keyqueue
    from keyqueue.jetstream.topology import Topology

    app = keyqueue.App("later", url=nats_url, set_as_default=False, result_ttl=60)

    @app.task(key="{n}")
    async def keyed(n: int) -> int:
        return n

    @app.task()
    async def ping(n: int) -> int:
        return n

    @app.task(rate_limit="1/h")
    async def limited(n: int) -> int:
        return n

    try:
        nc = await app.connection()
        api, names = JetStreamApi(nc), QueueNames("later")
        await Topology(api, app.queue_config("later")).ensure()  # the queue as a keyqueue without this made it
        with pytest.raises(StreamNotFound):
            await api.stream_info(names.work_stream)
        assert await app.purge(key=UNKEYED) == 0  # none to remove: not an error
        early = await keyed.enqueue(n=1)
        async with app.worker(drain_timeout=0.5):
            delayed = await ping.options(countdown=1).enqueue(n=5)
            assert delayed.due is not None and await delayed.status() == "scheduled"
            assert await early.result(timeout=30) == 1
            assert await delayed.result(timeout=30) == 5  # moved into the work stream when due, then ran
            first, second = await limited.enqueue(n=1), await limited.enqueue(n=2)
            assert await first.result(timeout=30) == 1

            async def in_hand() -> bool:
                return bool((await api.consumer_info(names.work_stream, names.consumer))["num_ack_pending"] == 1)

            await until("the second in the worker's hand, waiting for the limit", in_hand)
            assert await second.status() == "pending"
            starts, _ = await RequestRecords(nc, "later").get_runs("limited", UNKEYED)
            assert len(starts) == 1  # one run of the task, across the fleet, this hour
        await Topology(api, app.queue_config("later")).configure(ack_wait=7)  # keyqueue configure --ack-wait 7
        for stream in (names.token_stream, names.work_stream):  # the queue's lease, for keys and unkeyed requests
            assert (await api.consumer_info(stream, names.consumer))["config"]["ack_wait"] == 7_000_000_000
    finally:
        await app.close()


async def test_a_run_longer_than_the_lease_keeps_its_request(nats_url: str) -> None:
    import keyqueue

    app = keyqueue.App("long", url=nats_url, set_as_default=False, result_ttl=60)
    deliveries: list[int] = []

    @app.task()
    async def slow(ctx: keyqueue.Context) -> int:
        deliveries.append(ctx.fencing[1])
        await asyncio.sleep(4)  # more than twice the 1.5 s lease: only keepalives keep it here
        await ctx.progress({"slept": 4})
        return ctx.fencing[1]

    try:
        async with app.worker(ack_wait=1.5):
            receipt = await slow.enqueue()
            assert await receipt.result(timeout=30) == 1
            api, names = JetStreamApi(await app.connection()), QueueNames("long")
            consumer = await api.consumer_info(names.work_stream, names.consumer)
            progress = await app.progress(receipt.request_id)
        assert deliveries == [1]
        assert progress is not None and progress.value == {"slept": 4}  # kept by request id, as for a key
        assert consumer["num_redelivered"] == 0 and consumer["config"]["ack_wait"] == 1_500_000_000
    finally:
        await app.close()
