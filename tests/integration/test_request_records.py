"""Requests by id against a real nats-server with several workers: caller-chosen ids, kept results, cancels."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from command_output import Command
from nats.aio.msg import Msg

import keyqueue
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.records import RequestRecords

WORKERS = 3
ROOT = Path(__file__).parents[2]


@dataclass
class Fleet:
    """What the workers' task functions saw, shared by every worker in this process."""

    runs: list[tuple[str, int]] = field(default_factory=list)
    started: dict[int, asyncio.Event] = field(default_factory=dict)
    release: dict[int, asyncio.Event] = field(default_factory=dict)
    saw_cancel: dict[int, bool] = field(default_factory=dict)

    def event(self, table: dict[int, asyncio.Event], n: int) -> asyncio.Event:
        return table.setdefault(n, asyncio.Event())


def declare(app: keyqueue.App, fleet: Fleet, result_ttl: float | None = 60) -> dict[str, Any]:
    """The same tasks on every app: ``work`` keeps results, ``plain`` does not."""

    @app.task(key="{account}", max_attempts=1, result_ttl=result_ttl)
    async def work(ctx: keyqueue.Context, account: str, n: int, block: bool = False) -> dict[str, Any]:
        fleet.runs.append((account, n))
        if block:
            fleet.event(fleet.started, n).set()
            await fleet.event(fleet.release, n).wait()
            fleet.saw_cancel[n] = ctx.cancel_requested
        if n < 0:
            raise ValueError(f"negative {n}")
        return {"account": account, "n": n}

    @app.task(key="{account}")
    async def plain(account: str) -> str:
        return account

    return {"work": work, "plain": plain}


@contextlib.asynccontextmanager
async def fleet_of(nats_url: str, fleet: Fleet, count: int = WORKERS,
                   declare_tasks: Callable[[keyqueue.App, Fleet], dict[str, Any]] = declare
                   ) -> AsyncIterator[tuple[keyqueue.App, dict[str, Any]]]:
    """``count`` workers, each its own app and connection, and a producer app (yielded with its tasks)."""
    apps = [keyqueue.App("ledger", url=nats_url, set_as_default=False, autoload_plugins=False)
            for _ in range(count + 1)]
    tasks = [declare_tasks(app, fleet) for app in apps]
    async with contextlib.AsyncExitStack() as stack:
        for app in apps:
            stack.push_async_callback(app.close)
        for app in apps[1:]:
            await stack.enter_async_context(app.worker(concurrency=4, linger=0.01))
        yield apps[0], tasks[0]


async def test_a_repeated_request_id_runs_once_across_workers(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet) as (_app, tasks):
        work = tasks["work"]
        receipts = [await work.options(request_id="charge-o17-1").enqueue(account="a1", n=1) for _ in range(5)]
        assert [r.duplicate for r in receipts] == [False, True, True, True, True]
        assert len({r.seq for r in receipts}) == 1
        assert await receipts[0].result(timeout=10) == {"account": "a1", "n": 1}
        # a later request on the key finishes after it, so the first would have run twice by now
        assert await work.call(account="a1", n=2, timeout=10) == {"account": "a1", "n": 2}
        assert fleet.runs == [("a1", 1), ("a1", 2)]


async def test_a_request_id_a_header_cannot_carry_is_refused_at_the_call(nats_url: str) -> None:
    fleet = Fleet()
    app = keyqueue.App("ledger", url=nats_url, set_as_default=False, autoload_plugins=False)
    work = declare(app, fleet)["work"]
    for bad in ("two words", "line\r\nX-Injected: 1", "", "é-unicode", "x" * 257):
        with pytest.raises(keyqueue.InvalidRequestId):
            await work.options(request_id=bad).enqueue(account="a1", n=1)
    await app.close()
    assert fleet.runs == []


async def test_results_are_found_by_id_from_a_fresh_process(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet) as (_app, tasks):
        work = tasks["work"]
        ok = await work.enqueue(account="a1", n=1)
        failed = await work.options(request_id="will.fail/1").enqueue(account="a2", n=-1)
        plain = await tasks["plain"].enqueue(account="a3")
        assert await ok.result(timeout=10) == {"account": "a1", "n": 1}
        with pytest.raises(keyqueue.DeadLettered, match="negative -1"):
            await failed.result(timeout=10)
        with pytest.raises(keyqueue.ResultNotKept, match="plain keeps no results"):
            await plain.result(timeout=10)
        # A separate app (its own connection, no tasks declared) needs only the queue and the id.
        async with keyqueue.App("other", url=nats_url, set_as_default=False, autoload_plugins=False) as fresh:
            assert await fresh.result(ok.request_id, queue="ledger", timeout=10) == {"account": "a1", "n": 1}
            with pytest.raises(keyqueue.DeadLettered) as dead:
                await fresh.result("will.fail/1", queue="ledger", timeout=10)
            assert (dead.value.type_name, dead.value.reason) == ("ValueError", "max-attempts")
            with pytest.raises(keyqueue.KeyqueueTimeout, match="not finished yet"):
                await fresh.result("never-enqueued", queue="ledger", timeout=0.2)


async def test_result_waits_until_the_request_finishes(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet) as (_app, tasks):
        receipt = await tasks["work"].enqueue(account="a1", n=7, block=True)
        waiting = asyncio.create_task(receipt.result(timeout=30))
        await fleet.event(fleet.started, 7).wait()
        assert not waiting.done()
        fleet.event(fleet.release, 7).set()
        assert await waiting == {"account": "a1", "n": 7}


async def test_an_expired_result_says_so(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet, count=1,
                        declare_tasks=lambda app, f: declare(app, f, result_ttl=1)) as (app, tasks):
        receipt = await tasks["work"].enqueue(account="a1", n=1)
        assert await receipt.result(timeout=10) == {"account": "a1", "n": 1}
        records = RequestRecords(await app.connection(), "ledger")
        # The server replaces it with its delete marker when the TTL passes: a timer of the server's
        # that no subscriber hears (markers are stored, not delivered), so look until it is there.
        for _ in range(100):
            stored = await records.get_result(receipt.request_id)
            if stored is not None and not stored.data:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(keyqueue.ResultExpired, match="result_ttl has passed"):
            await receipt.result(timeout=1)


async def test_a_cancelled_request_never_runs_while_its_key_is_busy(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet) as (app, tasks):
        work = tasks["work"]
        first = await work.enqueue(account="a1", n=1, block=True)
        await fleet.event(fleet.started, 1).wait()
        second = await work.enqueue(account="a1", n=2)
        # The call's request is published on the key's inbox subject, where a plain subscriber sees it too.
        published: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_request(msg: Msg) -> None:
            if not published.done():
                published.set_result((msg.headers or {})["Nats-Msg-Id"])

        sub = await (await app.connection()).subscribe("kq.ledger.in.a1", cb=on_request)
        caller = asyncio.create_task(work.call(account="a1", n=3, timeout=30))
        third_id = await published
        await sub.unsubscribe()
        assert await second.cancel() == "pending"
        assert await app.cancel(third_id, queue="ledger") == "pending"  # its task keeps results: found by id
        assert await first.cancel() == "running"
        fleet.event(fleet.release, 1).set()
        assert await first.result(timeout=10) == {"account": "a1", "n": 1}
        assert fleet.saw_cancel[1] is True
        with pytest.raises(keyqueue.Cancelled):
            await caller
        with pytest.raises(keyqueue.Cancelled):
            await second.result(timeout=10)
        assert await work.call(account="a1", n=4, timeout=10) == {"account": "a1", "n": 4}
        assert fleet.runs == [("a1", 1), ("a1", 4)]
        assert await second.cancel() == "cancelled"
        assert await first.cancel() == "running"  # the first answer stands


async def test_cancelling_a_finished_request_says_done(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet) as (_app, tasks):
        receipt = await tasks["work"].enqueue(account="a1", n=1)
        await receipt.result(timeout=10)
        assert await receipt.cancel() == "done"
        assert fleet.runs == [("a1", 1)]


async def _keyqueue(nats_url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "keyqueue.cli", *args, "--url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip(), err.decode().strip()


async def test_the_result_and_cancel_commands(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet, count=1) as (_app, tasks):
        work = tasks["work"]
        ok = await work.options(request_id="cli-ok").enqueue(account="a1", n=1)
        await ok.result(timeout=10)
        await work.options(request_id="cli-failed").enqueue(account="a2", n=-1)
        assert await _keyqueue(nats_url, "result", "ledger", "cli-ok", "--timeout", "10") == (
            0, json.dumps({"account": "a1", "n": 1}), "")
        code, _, err = await _keyqueue(nats_url, "result", "ledger", "cli-failed", "--timeout", "10")
        assert (code, err) == (1, "Error: ValueError: negative -1")
        code, _, err = await _keyqueue(nats_url, "result", "ledger", "no-such-request")
        assert code == 1 and "has not finished, or its task keeps no results" in err
        assert (await _keyqueue(nats_url, "cancel", "ledger", "cli-ok", "--seq", str(ok.seq)))[:2] == (0, "done")
        code, _, err = await _keyqueue(nats_url, "cancel", "nope", "cli-ok")
        assert code == 1 and "queue 'nope' does not exist" in err


async def test_rate_limits_hold_per_key_across_holders_and_spare_other_keys(nats_url: str) -> None:
    starts: dict[str, list[float]] = {}

    def declare_limited(app: keyqueue.App, fleet: Fleet) -> dict[str, Any]:
        @app.task(key="{account}", rate_limit="3/s")
        async def limited(account: str, n: int) -> int:
            starts.setdefault(account, []).append(time.time())
            return n

        return {"limited": limited}

    async with fleet_of(nats_url, Fleet(), declare_tasks=declare_limited) as (_app, tasks):
        limited = tasks["limited"]
        # A first burst fills the key's window; its session ends, and whoever holds the key next
        # must read the window from the server.
        assert await asyncio.gather(*(limited.call(account="hot", n=n, timeout=30) for n in range(3))) == [0, 1, 2]
        later = asyncio.gather(*(limited.call(account="hot", n=n, timeout=30) for n in range(3, 12)))
        # Another key is not held up by the hot one's waits: it is done while the hot key still
        # waits for its third window, at least two seconds after its first (a margin a loaded
        # machine keeps; the cold key's three calls need a few round trips).
        assert await asyncio.gather(*(limited.call(account="cold", n=n, timeout=30) for n in range(3))) == [0, 1, 2]
        assert len(starts["hot"]) <= 6, starts["hot"]
        assert await later == list(range(3, 12))
    hot = starts["hot"]
    # No 4 runs of the key inside any second (each start is stamped a moment after the limiter's
    # own, so allow that moment).
    assert all(later - earlier > 0.9 for earlier, later in zip(hot, hot[3:], strict=False)), hot


async def test_the_example_runs_with_two_worker_processes(nats_url: str) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")},
           "KEYQUEUE_URL": nats_url, "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}
    workers = [await Command.start(sys.executable, "-m", "keyqueue.cli", "worker", "examples.requests.app:app",
                                   env=env, cwd=ROOT) for _ in range(2)]
    try:
        for worker in workers:
            await worker.wait_for(r"queue payments: charge, notify, settle")
        produce = await asyncio.create_subprocess_exec(sys.executable, "-m", "examples.requests.produce", cwd=ROOT,
                                                       env=env, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        out, err = await produce.communicate()
        assert produce.returncode == 0, err.decode()
        lines = out.decode().splitlines()
        assert lines[:9] == [
            "duplicate: True same seq: True",
            "result: {'account': 'a1', 'charged': 5, 'request': 'invoice-17'}",
            "from another app: {'account': 'a1', 'charged': 5, 'request': 'invoice-17'}",
            "error kept too: ValueError: cannot charge 0",
            "cancel the one behind: pending",
            "cancel the long one: running",
            "the long one: stopped early",
            lines[7],
            lines[8],
        ]
        assert lines[7].startswith("the one behind: request ") and lines[7].endswith("it did not run")
        assert lines[8].startswith("a2 done after") and lines[9].startswith("a1's 6 done after")
        assert float(lines[9].split()[-1].rstrip("s")) >= 2.0  # 6 runs at 2 a second: the third pair waits 2s
    finally:
        for worker in workers:
            await worker.stop()


async def test_cancelling_a_delayed_request_before_it_is_due_removes_its_schedule(nats_url: str) -> None:
    fleet = Fleet()
    async with fleet_of(nats_url, fleet, count=1) as (app, tasks):
        work = tasks["work"]
        later = await work.options(countdown=3600).enqueue(account="a1", n=1)
        assert later.due is not None
        assert await later.cancel() == "cancelled"
        assert await later.cancel() == "cancelled"
        api = JetStreamApi(await app.connection())
        assert (await api.stream_info("KQ_ledger_SCHEDULES"))["state"]["messages"] == 0
        assert await work.call(account="a1", n=2, timeout=10) == {"account": "a1", "n": 2}
        assert fleet.runs == [("a1", 2)]


async def test_a_cancelled_request_is_left_out_of_a_batch(nats_url: str) -> None:
    batches: list[list[int]] = []
    started, release = asyncio.Event(), asyncio.Event()

    def declare_batch(app: keyqueue.App, fleet: Fleet) -> dict[str, Any]:
        @app.task(key="{k}", policy="batch", queue="batches", result_ttl=60)
        async def collect(items: list[dict[str, Any]]) -> list[int]:
            batches.append([i["n"] for i in items])
            if items[0]["n"] == 0:
                started.set()
                await release.wait()
            return [i["n"] * 10 for i in items]

        return {"collect": collect}

    async with fleet_of(nats_url, Fleet(), count=2, declare_tasks=declare_batch) as (_app, tasks):
        collect = tasks["collect"]
        first = await collect.enqueue({"k": "a", "n": 0})
        await started.wait()  # the first batch, [0] alone, runs (and waits) while the others come
        receipts = [await collect.enqueue({"k": "a", "n": n}) for n in (1, 2, 3)]
        assert await receipts[1].cancel() == "pending"
        release.set()
        assert await first.result(timeout=10) == 0
        assert [await receipts[0].result(timeout=10), await receipts[2].result(timeout=10)] == [10, 30]
        with pytest.raises(keyqueue.Cancelled):
            await receipts[1].result(timeout=10)
    assert batches == [[0], [1, 3]]


async def test_a_result_stored_after_the_readers_first_read_is_still_found(nc: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The race the reader must survive: a result published just before its subscribe reached the
    # server, but stored only after its first read. The subscription never sees it (it was
    # published before), and the first read found nothing; only a later read finds it.
    records = RequestRecords(nc, "ledger")
    await records.ensure()
    await records.put_result("late-1", {"X-KQ-Status": "ok"}, b'"kept"', 60)
    real_last = records._last
    reads: list[str] = []

    async def first_read_misses(subject: str) -> Any:
        reads.append(subject)
        return None if len(reads) == 1 else await real_last(subject)

    monkeypatch.setattr(records, "_last", first_read_misses)
    headers, body = await records.wait_result("late-1", timeout=10) or ({}, b"")
    assert body == b'"kept"' and headers.get("X-KQ-Status") == "ok"
    assert len(reads) == 2


async def test_a_result_is_returned_only_once_the_stream_has_stored_it(nc: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The server hands a publish to the subject's subscribers before its stream stores it, and
    # whether or not the stream then refuses it. A reader that returned what its subscription saw
    # could answer "done" where ``status`` (which reads the stream) still says pending. Here a
    # result the stream refuses (a wrong expected sequence) reaches the reader's subscription first;
    # the reader must return the one stored after it, and what it returns is what the stream holds.
    records = RequestRecords(nc, "ledger")
    await records.ensure()
    await records.put_result("race-1", {"X-KQ-Status": "pending"}, b"", 60)
    real_last = records._last
    first_read = asyncio.Event()

    async def reading(subject: str) -> Any:
        first_read.set()  # its subscription was sent before this read
        return await real_last(subject)

    monkeypatch.setattr(records, "_last", reading)
    waiting = asyncio.ensure_future(records.wait_result("race-1", timeout=10))
    await first_read.wait()
    subject = records.result_subject("race-1")
    await nc.publish(subject, b'"never stored"', headers={"X-KQ-Status": "ok",
                                                          "Nats-Expected-Last-Subject-Sequence": "999999"})
    await nc.flush()
    await records.put_result("race-1", {"X-KQ-Status": "ok"}, b'"stored"', 60)
    headers, body = await waiting or ({}, b"")
    assert body == b'"stored"' and headers.get("X-KQ-Status") == "ok"
    kept = await real_last(subject)
    assert kept is not None and kept.data == b'"stored"'


async def test_kept_results_are_pipelined_and_confirmed_before_their_requests_leave_the_inbox(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result is sent beside the work (the key's next requests run before its reply is read) and
    the session confirms it before it removes the request: while a confirmation is held, every
    request that ran is still stored; once it is given, each request's result is found."""
    stored = RequestRecords.stored
    confirming, go_on = asyncio.Event(), asyncio.Event()

    async def held(self: RequestRecords, sent: Any) -> int:
        seq = await stored(self, sent)  # really stored; its confirmation waits for the test
        confirming.set()
        await go_on.wait()
        return seq

    monkeypatch.setattr(RequestRecords, "stored", held)
    fleet = Fleet()
    app = keyqueue.App("piped", url=nats_url, set_as_default=False, autoload_plugins=False)
    tasks = declare(app, fleet)
    try:
        receipts = await tasks["work"].enqueue_many([{"account": "a", "n": n, "block": n == 2} for n in range(3)])
        api = JetStreamApi(await app.connection())
        inbox = app.queue_config("piped").names.inbox_stream
        async with app.worker(concurrency=2, linger=0.01):
            await confirming.wait()
            # The session went on to the next requests (read ahead) without awaiting a result's
            # reply; the third runs now, and the removal of the first two waits for a confirmation.
            await fleet.event(fleet.started, 2).wait()
            assert (await api.stream_info(inbox))["state"]["messages"] == 3
            go_on.set()
            fleet.event(fleet.release, 2).set()
            assert [await r.result(timeout=10) for r in receipts] == [{"account": "a", "n": n} for n in range(3)]
        # The key was given back: every removal was sent and confirmed first.
        assert await requests_waiting(api, app.queue_config("piped").names) == 0
    finally:
        go_on.set()
        await app.close()
