"""The built-in events plugin against a real nats-server: what a known workload leaves in KQ_<queue>_EVENTS.

The contract the events follow is :mod:`keyqueue.events` (``ev`` here); the publisher is the
built-in plugin ``keyqueue.builtins.events``.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import keyqueue
from keyqueue import events as ev
from keyqueue.admin.key_history import key_events, latest_events, runs_of
from keyqueue.builtins import events as ev_plugin
from keyqueue.builtins.events import sample_rate, sampled
from keyqueue.ext import JetStreamApi, Topology
from keyqueue.wire import CBOR, loads

MakeApp = Callable[..., keyqueue.App]
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))


@pytest.fixture
async def make_app(nats_url: str) -> AsyncIterator[MakeApp]:
    apps: list[keyqueue.App] = []

    def make(name: str = "shop") -> keyqueue.App:
        app = keyqueue.App(name, url=nats_url, set_as_default=False, autoload_plugins=False)
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.close()


async def read_events(app: keyqueue.App, queue: str, messages: list[int] | None = None) -> list[dict[str, Any]]:
    """Every stored event of ``queue``, in order, each checked against the contract; ``messages``
    gets the number of stored messages that carried them."""
    api = JetStreamApi(await app.connection())
    info = await api.stream_info(ev.events_stream(queue))
    out = []
    stored = 0
    for seq in range(max(1, int(info["state"]["first_seq"])), int(info["state"]["last_seq"]) + 1):  # empty reports 0..0
        msg = await api.get_msg(ev.events_stream(queue), seq=seq, direct=False)
        if msg is None:
            continue
        stored += 1
        assert msg.headers["X-CONTENT-TYPE"] == CBOR
        body = loads(msg.data, CBOR)
        if msg.headers["X-MESSAGE-TYPE"] == ev.EVENT_BATCH_MESSAGE_TYPE:
            # Several events of one key, in order, on the key's batch subject.
            assert msg.headers["X-MESSAGE-VERSION"] == "1"
            assert body["fields"] == list(ev.EVENT_FIELD_NAMES)
            events = ev.decode_events(msg.headers, msg.data)
            assert len(events) == len(body["events"]) > 1
            if msg.subject == ev.event_batch_subject(queue, None):
                # Events of several keys: only a bulk enqueue's, each with its own key.
                assert {e["event"] for e in events} == {"enqueued"} and len({e["key"] for e in events}) > 1
            else:
                assert {e["key"] for e in events} == {msg.subject.removeprefix(ev.event_batch_subject(queue, ""))}
            out.extend(events)
            continue
        assert (msg.headers["X-MESSAGE-TYPE"], msg.headers["X-MESSAGE-VERSION"]) == ("KeyqueueEvent", "1")
        assert tuple(body) == ev.EVENT_FIELD_NAMES
        assert msg.subject == ev.events_subject(queue, body["event"], body["key"])
        assert ev.decode_events(msg.headers, msg.data) == [body]
        out.append(body)
    if messages is not None:
        messages.append(stored)
    return out


async def events_until(app: keyqueue.App, queue: str, done: Callable[[list[dict[str, Any]]], bool]
                       ) -> list[dict[str, Any]]:
    async with asyncio.timeout(15):
        while True:
            await (await app.connection()).flush()
            try:
                found = await read_events(app, queue)
            except keyqueue.StreamNotFound:
                found = []
            if done(found):
                return found
            await asyncio.sleep(0.05)


def workload(app: keyqueue.App) -> Any:
    failed: set[int] = set()

    @app.task(key="{order_id}", max_attempts=3, backoff=0.01)
    async def charge(order_id: str, n: int) -> int:
        if n == 2 and n not in failed:
            failed.add(n)
            raise ValueError("flaky")
        await asyncio.sleep(0.01)
        return n

    return charge


async def test_a_known_workload_leaves_exactly_its_events(make_app: MakeApp) -> None:
    app = make_app()
    charge = workload(app)
    receipts = [await charge.enqueue(order_id="o1", n=n) for n in (1, 2, 3)]
    # A duplicate (same request id) stores nothing and publishes no event.
    await charge.options(request_id=receipts[0].request_id).enqueue(order_id="o1", n=1)
    async with app.worker(name="w1", linger=0.05):
        found = await events_until(app, "shop", lambda es: any(e["event"] == "released" for e in es))
    by_request: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(found, key=lambda e: e["ts"]):
        assert (e["queue"], e["key"]) == ("shop", "o1")
        by_request.setdefault(e["request_id"], []).append(e)
    keys = by_request.pop(None)
    assert [e["event"] for e in keys] == ["acquired", "released"]
    assert keys[1]["reason"] == "released" and all(e["worker"] == "w1" for e in keys)
    # The holder's fencing number (its lease record's sequence) is on acquired, so a key's history names it.
    assert isinstance(keys[0]["fence"], int) and keys[0]["fence"] > 0 and keys[1]["fence"] is None
    ids = [r.request_id for r in receipts]
    assert list(by_request) == ids
    assert [(e["event"], e["attempt"]) for e in by_request[ids[0]]] == [
        ("enqueued", None), ("started", 1), ("succeeded", None)]
    assert [(e["event"], e["attempt"]) for e in by_request[ids[1]]] == [
        ("enqueued", None), ("started", 1), ("retried", 1), ("started", 2), ("succeeded", None)]
    assert [(e["event"], e["attempt"]) for e in by_request[ids[2]]] == [
        ("enqueued", None), ("started", 1), ("succeeded", None)]
    for events in by_request.values():
        enqueued, started, *_, succeeded = events
        assert enqueued["task"] == started["task"] == succeeded["task"] == "charge"
        assert enqueued["worker"] is None and started["worker"] == "w1"
        assert started["wait"] is not None and 0 <= started["wait"] < 10
        assert succeeded["run"] is not None and 0.005 < succeeded["run"] < 5
        assert all(e[f] is None for e in events for f in ("triggers", "run_id"))
    assert by_request[ids[1]][2]["reason"] == "ValueError: flaky"
    # The retry's backoff, so "when is the next attempt" can be answered from the stream.
    assert 0 < by_request[ids[1]][2]["delay"] < 1
    assert all(e["delay"] is None for events in by_request.values() for e in events if e["event"] != "retried")
    config = (await JetStreamApi(await app.connection()).stream_info("KQ_shop_EVENTS"))["config"]
    assert (config["retention"], config["max_age"]) == ("limits", 7 * 24 * 3600 * 10**9)
    assert config["max_msgs"] == ev.MAX_MSGS
    assert config["max_bytes"] == -1  # a max_bytes would be reserved up front against the server's store


async def test_a_keys_events_travel_together_at_most_one_stored_message_per_request(make_app: MakeApp) -> None:
    """A hot key's events (enqueued by enqueue_many, then acquired, started, succeeded... released) go
    out in batches of the key's events: fewer stored messages than requests, every event kept, in order."""
    app = make_app()

    @app.task(key="{k}")
    async def note(k: str, n: int) -> None:
        return None

    requests = 3 * ev_plugin.BATCH_MAX
    await note.enqueue_many([{"k": "hot", "n": n} for n in range(requests)])
    async with app.worker(name="w1", linger=0.05):
        messages: list[int] = []
        found = await events_until(app, "shop", lambda es: any(e["event"] == "released" for e in es))
        found = await read_events(app, "shop", messages)
    counts = {name: sum(e["event"] == name for e in found) for name in ("enqueued", "started", "succeeded")}
    assert counts == {"enqueued": requests, "started": requests, "succeeded": requests}
    assert [e["event"] for e in found if e["request_id"] is None] == ["acquired", "released"]
    # A key's events in a message are in the order they happened; the messages of one process too.
    worker_events = [e for e in found if e["worker"] == "w1"]
    assert worker_events == sorted(worker_events, key=lambda e: e["ts"])
    assert messages[0] <= requests, f"{messages[0]} stored messages for {requests} requests"


async def test_a_bulk_enqueue_across_keys_stores_its_enqueued_events_a_batch_at_a_time(make_app: MakeApp,
                                                                                     nats_url: str) -> None:
    """``enqueue_many`` over many keys, one request each (a backfill): its ``enqueued`` events go out
    in call order, :data:`BATCH_MAX` to a message across keys, not one message per key; each names
    its key, ``events tail -e enqueued`` prints every one, and a key's own history still has its run."""
    app = make_app()

    @app.task(key="{k}")
    async def note(k: str) -> None:
        return None

    keys = [f"k{n}" for n in range(2 * ev_plugin.BATCH_MAX + 3)]
    await Topology(JetStreamApi(await app.connection()), app.queue_config("shop")).ensure()  # tail needs the queue
    tail = await asyncio.create_subprocess_exec(
        KEYQUEUE, "events", "tail", "shop", "--url", nats_url, "--count", str(len(keys)), "--timeout", "30",
        "-e", "enqueued", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert tail.stderr is not None and tail.stdout is not None
    async with asyncio.timeout(20):
        assert "tailing events of shop" in (await tail.stderr.readline()).decode()
    await note.enqueue_many([{"k": k} for k in keys])
    messages: list[int] = []
    found = await events_until(app, "shop", lambda es: len(es) >= len(keys))
    found = await read_events(app, "shop", messages)
    assert [(e["event"], e["key"]) for e in found] == [("enqueued", k) for k in keys]
    assert messages == [3]  # 64 + 64 + 3, where each key's event was a message of its own
    assert await asyncio.wait_for(tail.wait(), 20) == 0
    lines = (await tail.stdout.read()).decode().splitlines()
    assert [line.split()[1:3] for line in lines] == [["enqueued", k] for k in keys]
    async with app.worker(name="w1"):
        api = JetStreamApi(await app.connection())
        async with asyncio.timeout(15):
            while "released" not in await latest_events(api, "shop", keys[-1]):
                await (await app.connection()).flush()
    assert [r.outcome for r in runs_of(await key_events(api, "shop", keys[-1]))] == ["succeeded"]


async def test_dead_lettered_events_carry_the_reason_and_run_time(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{k}", max_attempts=1)
    async def boom(k: str) -> None:
        raise RuntimeError("no")

    async with app.worker(name="w1"):
        with pytest.raises(keyqueue.DeadLettered):
            await boom.call(k="a", timeout=10)  # call(): the enqueued event comes from the wrapper too
        found = await events_until(app, "shop", lambda es: any(e["event"] == "dead_lettered" for e in es))
    names = [e["event"] for e in sorted(found, key=lambda e: e["ts"]) if e["request_id"]]
    assert names == ["enqueued", "started", "dead_lettered"]
    [dead] = [e for e in found if e["event"] == "dead_lettered"]
    assert (dead["reason"], dead["attempt"], dead["task"]) == ("max-attempts", 1, "boom")
    assert dead["run"] is not None and dead["run"] >= 0


async def test_switched_off_nothing_is_published(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYQUEUE_EVENTS", "0")
    app = make_app()
    charge = workload(app)
    nc = await app.connection()
    seen: list[str] = []

    async def on_msg(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe("kq.shop.events.>", cb=on_msg)
    async with app.worker():
        for n in (1, 2, 3):
            await charge.call(order_id="o1", n=n, timeout=10)
    await nc.flush()
    await asyncio.sleep(0.1)
    assert seen == []
    with pytest.raises(keyqueue.StreamNotFound):
        await JetStreamApi(nc).stream_info(ev.events_stream("shop"))


async def test_events_tail_prints_events_live(make_app: MakeApp, nats_url: str) -> None:
    app = make_app()
    charge = workload(app)
    await Topology(JetStreamApi(await app.connection()), app.queue_config("shop")).ensure()  # tail needs the queue
    tail = await asyncio.create_subprocess_exec(
        KEYQUEUE, "events", "tail", "shop", "--url", nats_url, "--count", "4", "--timeout", "30",
        "-e", "enqueued", "-e", "succeeded", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert tail.stderr is not None and tail.stdout is not None
    async with asyncio.timeout(20):
        assert "tailing events of shop" in (await tail.stderr.readline()).decode()
    async with app.worker():
        await charge.call(order_id="o1", n=1, timeout=10)
        await charge.call(order_id="o1", n=3, timeout=10)
    assert await asyncio.wait_for(tail.wait(), 20) == 0
    lines = (await tail.stdout.read()).decode().splitlines()
    # call() publishes its enqueued event when it returns (with the ts of the enqueue): sort by ts.
    assert sorted(line.split()[1] for line in lines) == ["enqueued", "enqueued", "succeeded", "succeeded"]
    assert all(" o1 " in line and " charge " in line for line in lines)
    assert all("run=" in line for line in lines if " succeeded " in line)


def test_the_stream_config_bounds_the_events_kept() -> None:
    config = ev.stream_config("shop")
    assert (config["name"], config["subjects"]) == ("KQ_shop_EVENTS", ["kq.shop.events.>"])
    assert (config["max_msgs"], config["max_age"], config["discard"]) == (ev.MAX_MSGS, int(ev.MAX_AGE * 1e9), "old")
    assert "max_bytes" not in config and ev.stream_config("shop", max_bytes=1 << 20)["max_bytes"] == 1 << 20


async def test_latest_policy_supersedes_with_the_newest_request_named(make_app: MakeApp) -> None:
    app = make_app("prices")

    @app.task(key="{sku}", policy="latest")
    async def reprice(sku: str, price: int) -> int:
        return price

    receipts = [await reprice.enqueue(sku="s1", price=p) for p in (1, 2, 3)]
    async with app.worker(name="w1"):
        found = await events_until(app, "prices", lambda es: any(e["event"] == "released" for e in es))
    by_request: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(found, key=lambda e: e["ts"]):
        if e["request_id"]:
            by_request.setdefault(e["request_id"], []).append(e)
    ids = [r.request_id for r in receipts]
    # One attempt took the three: its started event names the first; each has its own outcome.
    assert [e["event"] for e in by_request[ids[0]]] == ["enqueued", "started", "superseded"]
    assert [e["event"] for e in by_request[ids[1]]] == ["enqueued", "superseded"]
    assert [e["event"] for e in by_request[ids[2]]] == ["enqueued", "succeeded"]
    for old in ids[:2]:
        assert by_request[old][-1]["reason"] == f"superseded by {ids[2]}"


async def test_plugins_publish_events_of_their_own_once_registered(make_app: MakeApp) -> None:
    app = make_app()
    workload(app)
    step = f"step_{secrets.token_hex(4)}"  # names stay registered for the process: one no other test uses
    with pytest.raises(ValueError, match=f"'{step}' is not one of enqueued"):
        await ev.publish_event(app, step, "shop", "o1")
    ev.register_event_names(step)
    assert ev.event_names()[:len(ev.EVENT_NAMES)] == ev.EVENT_NAMES and step in ev.event_names()
    await ev.publish_event(app, step, "shop", "o1", run=0.5, triggers=3, run_id="r1", worker="w9")
    with pytest.raises(ValueError, match="not event fields: colour"):
        await ev.publish_event(app, step, "shop", "o1", colour="red")
    [found] = await events_until(app, "shop", lambda es: len(es) == 1)
    assert (found["event"], found["key"], found["run"], found["triggers"], found["run_id"], found["worker"]) == (
        step, "o1", 0.5, 3, "r1", "w9")


def test_event_names_of_plugins_are_subject_tokens_of_their_own() -> None:
    with pytest.raises(ValueError, match="keyqueue's own"):
        ev.register_event_names("started")
    for bad in ("Step", "a.b", "a b", "", ">"):
        with pytest.raises(ValueError, match="subject token"):
            ev.register_event_names(bad)
    assert not any(name.startswith("dvu") for name in ev.EVENT_NAMES + ev.EVENT_FIELD_NAMES)


async def test_an_app_without_the_events_plugin_publishes_none(make_app: MakeApp) -> None:
    app = make_app()
    app.plugins.unregister(name=ev.PUBLISHER)
    await ev.publish_event(app, "started", "shop", "o1")
    with pytest.raises(keyqueue.StreamNotFound):
        await JetStreamApi(await app.connection()).stream_info(ev.events_stream("shop"))


def test_sampling_keeps_whole_requests_by_a_hash_of_their_id() -> None:
    ids = [f"01JREQ{i:020d}" for i in range(2000)]
    kept = [i for i in ids if sampled(i, 0.1)]
    assert 120 < len(kept) < 280, len(kept)  # about one in ten
    assert kept == [i for i in ids if sampled(i, 0.1)], "the same ids are kept every time"
    assert all(sampled(i, 1.0) for i in ids)
    assert sample_rate({"KEYQUEUE_EVENTS_SAMPLE": "0.25"}) == 0.25
    assert sample_rate({"KEYQUEUE_EVENTS_SAMPLE": "lots"}) == 1.0
    assert sample_rate({}) == 1.0
