"""Delayed requests (``options(countdown=...)`` / ``options(eta=...)``) against a real nats-server,
with several workers: not before due, in the documented order, across worker and server restarts,
and never stranded without a token."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from command_output import Command
from nats.aio.msg import Msg
from schedule_fleet import QUEUE, Runs, fleet, make_app, worker

import keyqueue
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.schedules import ScheduleNames
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.server.embedded import EmbeddedServer

ROOT = Path(__file__).parents[2]
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))


def started_not_before_due(runs: Runs, dues: dict[str, dt.datetime]) -> None:
    for run in runs.done:
        if run.tag in dues:
            assert run.started >= dues[run.tag], f"{run.tag} started {run.started}, before its due {dues[run.tag]}"


async def test_delays_start_not_before_due_and_join_their_key_at_due_time(nats_url: str) -> None:
    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    try:
        async with fleet(nats_url, runs, 3):
            now = dt.datetime.now(dt.UTC)
            late = await work.options(countdown=1.5).enqueue(key="k", tag="late")
            at = await work.options(eta=now + dt.timedelta(seconds=1)).enqueue(key="k", tag="at")
            await work.enqueue(key="k", tag="now")  # enqueued after both, due before them
            many = await work.options(countdown=1).enqueue_many([{"key": "m", "tag": f"m{i}"} for i in range(5)])
            assert late.due is not None and at.due is not None and all(r.due is not None for r in many)
            assert await work.options(countdown=0.5).call(key="c", tag="called", timeout=20) == "called"
            await runs.count(9)
        dues = {"late": late.due, "at": at.due, **{f"m{i}": r.due for i, r in enumerate(many) if r.due}}
        started_not_before_due(runs, dues)
        assert runs.tags("k") == ["now", "at", "late"], "a delayed request joins its key's order at its due time"
        assert runs.tags("m") == [f"m{i}" for i in range(5)], "requests due together keep their enqueue order"
        assert not runs.overlaps
    finally:
        await producer.close()


async def test_a_repeated_request_id_is_stored_once(nats_url: str) -> None:
    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    try:
        first = await work.options(countdown=0.5, request_id="once").enqueue(key="k", tag="a")
        again = await work.options(countdown=0.5, request_id="once").enqueue(key="k", tag="a")
        assert (first.duplicate, again.duplicate, first.seq) == (False, True, again.seq)
        async with worker(nats_url, runs, "w0"):
            [run] = await runs.count(1)
        assert run.request_id == "once" and runs.tags() == ["a"]
        api = JetStreamApi(await producer.connection())
        state = (await api.stream_info(ScheduleNames(QUEUE).stream))["state"]
        assert (state["messages"], state["last_seq"]) == (0, 2), "one schedule stored, fired and moved"
    finally:
        await producer.close()


async def test_pending_delays_survive_a_worker_restart(nats_url: str) -> None:
    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    try:
        async with worker(nats_url, runs, "first"):
            receipt = await work.options(countdown=1).enqueue(key="k", tag="delayed")
        assert runs.done == [], "the worker was stopped before the request fell due"
        async with worker(nats_url, runs, "second"):
            [run] = await runs.count(1)
        assert run.worker == "second" and receipt.due is not None and run.started >= receipt.due
    finally:
        await producer.close()


async def test_pending_delays_survive_a_server_restart(nats_server: EmbeddedServer) -> None:
    runs = Runs()
    producer = make_app(nats_server.url, runs)
    work = producer.tasks["work"]
    try:
        receipt = await work.options(countdown=2).enqueue(key="k", tag="delayed")
        await producer.close()
        await nats_server.restart()  # nothing in any process holds the request meanwhile
        async with worker(nats_server.url, runs, "w0"):
            [run] = await runs.count(1)
        assert receipt.due is not None and run.started >= receipt.due
    finally:
        await producer.close()


async def test_a_server_restart_while_workers_wait(nats_server: EmbeddedServer) -> None:
    runs = Runs()
    producer = make_app(nats_server.url, runs)
    work = producer.tasks["work"]
    try:
        async with fleet(nats_server.url, runs, 2):
            receipt = await work.options(countdown=2).enqueue(key="k", tag="delayed")
            await nats_server.restart()
            [run] = await runs.count(1, timeout=60)
        assert receipt.due is not None and run.started >= receipt.due
    finally:
        await producer.close()


async def test_due_requests_are_never_stranded_without_a_token(nats_url: str) -> None:
    """The quiescence race, with due requests: keys released after a near-zero linger while
    delayed and immediate requests keep landing on them. Everything must run well inside the
    reconciler's 30 s interval, so a request stranded without a token fails the test."""
    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    keys = [f"hot{i}" for i in range(5)]
    expected = 0
    try:
        async with fleet(nats_url, runs, 3, linger=0.001):

            async def produce(p: int) -> None:
                nonlocal expected
                rng = random.Random(p)
                for j in range(60):
                    key, tag = rng.choice(keys), f"p{p}-{j}"
                    expected += 1
                    if rng.random() < 0.5:
                        await work.options(countdown=rng.random() * 1.5).enqueue(key=key, tag=tag)
                    else:
                        await work.enqueue(key=key, tag=tag)
                    await asyncio.sleep(rng.random() * 0.01)

            await asyncio.gather(*(produce(p) for p in range(4)))
            await runs.count(expected, timeout=20)
        assert sorted(runs.tags()) == sorted(set(runs.tags())), "a due request ran twice"
        assert not runs.overlaps
    finally:
        await producer.close()


async def test_bad_delays_are_refused_at_the_call(nats_url: str) -> None:
    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    try:
        with pytest.raises(keyqueue.InvalidSchedule, match="naive"):
            await work.options(eta=dt.datetime(2030, 1, 1)).enqueue(key="k", tag="x")
        with pytest.raises(keyqueue.InvalidSchedule, match=">= 0"):
            await work.options(countdown=-1).enqueue(key="k", tag="x")
        with pytest.raises(keyqueue.InvalidSchedule, match="not both"):
            work.options(countdown=1, eta=dt.datetime.now(dt.UTC))
        # An inbox an operator limited to five minutes drops a request due in ten.
        await work.options(countdown=0).enqueue(key="k", tag="creates the streams")
        api = JetStreamApi(await producer.connection())
        inbox = (await api.stream_info(QueueNames(QUEUE).inbox_stream))["config"]
        await api.request(f"STREAM.UPDATE.{inbox['name']}", {**inbox, "max_age": 300 * 10**9})
        await producer.close()  # a new connection reads the streams' limits again
        with pytest.raises(keyqueue.InvalidSchedule, match="keep messages for 300s"):
            await work.options(countdown=600).enqueue(key="k", tag="x")
        api = JetStreamApi(await producer.connection())
        assert (await api.stream_info(ScheduleNames(QUEUE).stream))["state"]["messages"] == 1
    finally:
        await producer.close()


async def test_enqueue_command_with_countdown_and_eta(nats_url: str) -> None:
    """As a user runs it: a subprocess (importing the example's app here would make it this process's default app)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}

    async def enqueue(*args: str) -> tuple[int, str]:
        body = json.dumps({"user": "u1", "text": "t", "due": "2030-01-01T00:00:00+00:00"})
        command = await Command.start(KEYQUEUE, "enqueue", "examples.reminders.app:app", "remind", body, *args,
                                      "--url", nats_url, env=env, cwd=ROOT)
        return await command.wait(timeout=60), command.output

    code, out = await enqueue("--countdown", "30")
    assert code == 0, out
    receipt = json.loads(out)
    assert dt.datetime.fromisoformat(receipt["due"]) > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=20)
    code, out = await enqueue("--eta", "2030-01-01T09:00:00+01:00")
    assert json.loads(out)["due"] == "2030-01-01T08:00:00+00:00"
    code, out = await enqueue("--eta", "2030-01-01T09:00:00")
    assert code == 1 and "is naive" in out
    code, out = await enqueue("--countdown", "-1")
    assert code == 1 and "countdown must be >= 0" in out


async def test_a_due_request_refused_by_a_full_backlog_is_not_overtaken_by_a_later_one_of_its_key(
        nats_url: str) -> None:
    """Before, a refused due request was due again 5 s later, and a later due request of its key
    that found room in the backlog meanwhile ran first. Now the key is parked behind it."""
    import logging

    def capped(app: keyqueue.App) -> None:
        app.configure_queue(QueueConfig(QUEUE, max_backlog_per_key=1))

    refused = asyncio.Event()

    class Refusals(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "backlog is full" in record.getMessage():
                refused.set()

    handler = Refusals()
    logging.getLogger("keyqueue.schedules").addHandler(handler)
    runs = Runs()
    producer = make_app(nats_url, runs, extra=capped)
    work = producer.tasks["work"]
    try:
        async with fleet(nats_url, runs, 2, extra=capped):
            await work.enqueue(key="full", tag="wait-holding")  # the key's one slot, until the gate opens
            await work.options(countdown=0.2).enqueue(key="full", tag="first")
            await work.options(countdown=1.5).enqueue(key="full", tag="second")
            await asyncio.wait_for(refused.wait(), 20)  # "first" came due and found no room
            runs.gate.set()  # room again: "second" falls due while "first" waits to be due again
            await runs.count(3, timeout=30)
        assert runs.tags("full") == ["wait-holding", "first", "second"]
    finally:
        logging.getLogger("keyqueue.schedules").removeHandler(handler)
        await producer.close()


async def test_a_full_backlog_holds_up_no_other_key(nats_url: str) -> None:
    """A due request its key's backlog cap refuses is due again a little later; the fleet moves the
    others meanwhile (it moves one due request at a time, so waiting for the full key would stop all)."""

    def capped(app: keyqueue.App) -> None:
        app.configure_queue(QueueConfig(QUEUE, max_backlog_per_key=1))

    runs = Runs()
    producer = make_app(nats_url, runs, extra=capped)
    work = producer.tasks["work"]
    try:
        async with fleet(nats_url, runs, 2, extra=capped):
            await work.enqueue(key="full", tag="wait-holding")  # the key's one slot, until the gate opens
            refused = await work.options(countdown=0.2).enqueue(key="full", tag="refused-first")
            await work.options(countdown=0.5).enqueue(key="other", tag="other")
            await runs.wait(lambda done: "other" in [r.tag for r in done], what="the other key's due request")
            assert "refused-first" not in runs.tags()
            runs.gate.set()
            await runs.count(3, timeout=30)
        assert runs.tags("full") == ["wait-holding", "refused-first"]
        assert refused.due is not None and runs.done[-1].started >= refused.due
    finally:
        await producer.close()


async def _movers_settled(api: JetStreamApi, stream: str, consumer: str, timeout: float = 10.0) -> dict[str, Any]:
    """The movers consumer's info once it has nothing pending or unacknowledged (or at ``timeout``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await api.consumer_info(stream, consumer)
        if (info["num_ack_pending"] == 0 and info["num_pending"] == 0) or asyncio.get_running_loop().time() > deadline:
            return info
        await asyncio.sleep(0.05)  # the server's state: nothing to await


async def test_a_burst_due_at_once_is_moved_in_batches_and_keeps_each_keys_order(nats_url: str) -> None:
    """Many requests due at one instant, several per key: the mover delivered the one in flight
    moves those stored after it too (far fewer deliveries than requests), each key's in its order,
    and takes each batch it moved whole out of the schedules stream with one purge (no delete per
    request), after which the consumer goes on: nothing pending, nothing left, the next due request moved."""
    from keyqueue.jetstream.schedules import MOVERS

    runs = Runs()
    producer = make_app(nats_url, runs)
    work = producer.tasks["work"]
    nc = await producer.connection()
    stream = ScheduleNames(QUEUE).stream
    removals = {"DELETE": 0, "PURGE": 0}

    async def removal(msg: Msg) -> None:
        removals[msg.subject.split(".")[-2]] += 1

    await nc.subscribe(f"$JS.API.STREAM.MSG.DELETE.{stream}", cb=removal)
    await nc.subscribe(f"$JS.API.STREAM.PURGE.{stream}", cb=removal)
    at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.5)
    items = [{"key": f"b{k}", "tag": f"b{k}-{i}"} for i in range(4) for k in range(60)]
    try:
        async with fleet(nats_url, runs, 2):
            await work.options(eta=at).enqueue_many(items)
            await runs.count(len(items), timeout=60)
            await work.options(countdown=0.2).enqueue(key="b0", tag="later")
            await runs.count(len(items) + 1, timeout=30)
            # The mover acks "later" after its token is stored, so its run can end before the ack
            # lands: wait for the consumer to say so.
            movers = await _movers_settled(JetStreamApi(nc), stream, MOVERS)
            due_left = await JetStreamApi(nc).stream_info(stream, subjects_filter=ScheduleNames(QUEUE).due_prefix + ">")
        for k in range(60):
            assert runs.tags(f"b{k}") == [f"b{k}-{i}" for i in range(4)] + (["later"] if k == 0 else [])
        started_not_before_due(runs, {item["tag"]: at for item in items})
        assert movers["delivered"]["consumer_seq"] < len(items) / 2, movers["delivered"]
        assert removals["PURGE"] >= 1 and removals["DELETE"] == 0, removals
        assert movers["num_ack_pending"] == 0 and movers["num_pending"] == 0, movers
        assert not due_left["state"].get("subjects"), due_left["state"]
        assert not runs.overlaps
    finally:
        await producer.close()


async def test_in_a_batch_a_refused_due_request_parks_its_key_before_its_next_one(nats_url: str) -> None:
    """Two due requests of a key with a full backlog fall due at once, among other keys': the first
    is refused and scheduled again, the second goes behind it, and the other keys run meanwhile."""

    def capped(app: keyqueue.App) -> None:
        app.configure_queue(QueueConfig(QUEUE, max_backlog_per_key=1))

    runs = Runs()
    producer = make_app(nats_url, runs, extra=capped)
    work = producer.tasks["work"]
    at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    try:
        async with fleet(nats_url, runs, 2, extra=capped):
            await work.enqueue(key="full", tag="wait-holding")  # the key's one slot, until the gate opens
            await work.options(eta=at).enqueue_many(
                [{"key": "full", "tag": "first"}, *({"key": f"o{i}", "tag": f"o{i}"} for i in range(10)),
                 {"key": "full", "tag": "second"}])
            await runs.wait(lambda done: len([r for r in done if r.tag.startswith("o")]) == 10,
                            what="the other keys' due requests")
            assert "first" not in runs.tags() and "second" not in runs.tags()
            runs.gate.set()
            await runs.count(13, timeout=30)
        assert runs.tags("full") == ["wait-holding", "first", "second"]
    finally:
        await producer.close()
