"""The chaos harness's parts against a real nats-server: the fault proxy, its script, the fenced store,
the soak's producer and its look at the token stream."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.chaos.checker import check
from keyqueue.chaos.fenced import FencedRecord, FencedStore
from keyqueue.chaos.fleet import Fleet, LogTail, SilenceWatch, WorkerSpec
from keyqueue.chaos.handlers import foreign_subjects
from keyqueue.chaos.proxy import FaultProxy, FaultScript, FaultSpec, ProxyGroup
from keyqueue.chaos.soak import QUEUE, SoakOptions, _foreign_ack, _foreign_tokens_stored, _Producer
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology

NO_DELIVERY = 0.3
"""How long a held message is watched for *not* arriving (it must arrive only after heal)."""


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[FaultProxy]:
    async with FaultProxy.for_url(nats_url) as p:
        yield p


async def quiet(_: Exception) -> None:
    """nats-py's error callback: the faults are injected on purpose, their errors are expected."""


@pytest.fixture
async def pc(proxy: FaultProxy) -> AsyncIterator[Client]:
    """A nats-py client connected through the proxy."""
    client = await nats.connect(proxy.url, connect_timeout=2, reconnect_time_wait=0.1, max_reconnect_attempts=-1,
                                error_cb=quiet)
    try:
        yield client
    finally:
        await client.close()


PROBE = b"subscribed?"


async def subscribe_live(nc: Client, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> None:
    """Subscribe, and return once the server has the subscription.

    nats-py's ``flush()`` writes its PING ahead of commands still queued for its flusher task,
    so its PONG does not prove the SUB arrived. A message published on the same connection after
    the SUB does, when it comes back; ``cb`` never sees it.
    """
    live = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        if msg.data == PROBE:
            live.set()
        else:
            await cb(msg)

    await nc.subscribe(subject, cb=on_msg)
    await nc.publish(subject, PROBE)
    await asyncio.wait_for(live.wait(), 5)


async def first_message(nc: Client, subject: str) -> asyncio.Future[tuple[Msg, float]]:
    """A future for the first message on ``subject`` and the monotonic time it arrived."""
    arrived: asyncio.Future[tuple[Msg, float]] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        if not arrived.done():
            arrived.set_result((msg, time.monotonic()))

    await subscribe_live(nc, subject, on_msg)
    return arrived


async def echo(nc: Client, subject: str) -> None:
    async def on_msg(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(msg.data)

    await subscribe_live(nc, subject, on_msg)


async def round_trip(client: Client, subject: str) -> float:
    started = time.monotonic()
    reply = await client.request(subject, b"ping", timeout=5)
    assert reply.data == b"ping"
    return time.monotonic() - started


# --- the proxy ---------------------------------------------------------------------------------


async def test_the_proxy_forwards_a_nats_connection(proxy: FaultProxy, pc: Client) -> None:
    assert proxy.url == f"nats://127.0.0.1:{proxy.port}" and proxy.port > 0
    arrived = await first_message(pc, "chaos.loop")
    await pc.publish("chaos.loop", b"hello")
    msg, _ = await asyncio.wait_for(arrived, 5)
    assert msg.data == b"hello"
    assert proxy.stats.accepted == 1 and proxy.connections == 1
    assert proxy.stats.bytes_up > len(b"hello") and proxy.stats.bytes_down > len(b"hello")


async def test_a_blackhole_holds_bytes_both_ways_and_heal_delivers_them(proxy: FaultProxy, pc: Client,
                                                                         nats_client: Client) -> None:
    up = await first_message(nats_client, "chaos.up")  # published through the proxy, received directly
    down = await first_message(pc, "chaos.down")       # published directly, received through the proxy
    proxy.blackhole()
    forwarded = (proxy.stats.bytes_up, proxy.stats.bytes_down)
    await pc.publish("chaos.up", b"late ack")
    await nats_client.publish("chaos.down", b"late delivery")
    await nats_client.flush()
    await proxy.wait_until(lambda p: p.held_up > len(b"late ack") and p.held_down > len(b"late delivery"), timeout=5)

    done, _ = await asyncio.wait({up, down}, timeout=NO_DELIVERY)
    assert not done, "a blackholed proxy forwarded a message"
    assert (proxy.stats.bytes_up, proxy.stats.bytes_down) == forwarded
    assert proxy.connections == 1  # the partition keeps the connection open

    healed = time.monotonic()
    proxy.heal()
    (up_msg, up_at), (down_msg, down_at) = await asyncio.wait_for(asyncio.gather(up, down), 5)
    assert (up_msg.data, down_msg.data) == (b"late ack", b"late delivery")
    assert up_at >= healed and down_at >= healed
    await proxy.wait_until(lambda p: p.held_bytes == 0, timeout=5)
    assert proxy.stats.faults["blackhole"] == 1


async def test_held_bytes_are_delivered_in_order(proxy: FaultProxy, pc: Client, nats_client: Client) -> None:
    received: list[bytes] = []
    all_in = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        received.append(msg.data)
        if len(received) == 50:
            all_in.set()

    await subscribe_live(nats_client, "chaos.order", on_msg)
    proxy.blackhole()
    for i in range(50):
        await pc.publish("chaos.order", str(i).encode())
    await proxy.wait_until(lambda p: p.held_bytes > 0, timeout=5)
    proxy.heal()
    await asyncio.wait_for(all_in.wait(), 5)
    assert received == [str(i).encode() for i in range(50)]


async def test_a_reset_makes_nats_py_reconnect(proxy: FaultProxy) -> None:
    reconnected, disconnected = asyncio.Event(), asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    async def on_disconnect() -> None:
        disconnected.set()

    client = await nats.connect(proxy.url, reconnected_cb=on_reconnect, disconnected_cb=on_disconnect,
                                error_cb=quiet, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        arrived = await first_message(client, "chaos.after")
        accepted = proxy.stats.accepted
        proxy.reset()
        await asyncio.wait_for(disconnected.wait(), 10)
        await asyncio.wait_for(reconnected.wait(), 10)
        assert proxy.stats.accepted == accepted + 1
        assert proxy.stats.faults["reset"] == 1
        await client.publish("chaos.after", b"again")  # the subscription was restored on reconnect
        msg, _ = await asyncio.wait_for(arrived, 5)
        assert msg.data == b"again"
    finally:
        await client.close()


async def test_a_reset_during_a_blackhole_drops_what_was_held(proxy: FaultProxy, pc: Client) -> None:
    proxy.blackhole()
    await pc.publish("chaos.dropped", b"x")
    await proxy.wait_until(lambda p: p.held_bytes > 0, timeout=5)
    proxy.reset()
    await proxy.wait_until(lambda p: p.connections == 0 and p.held_bytes == 0, timeout=5)
    assert proxy.stats.bytes_up + proxy.stats.bytes_down > 0  # only what went before the blackhole


async def test_latency_delays_a_round_trip_in_both_directions(proxy: FaultProxy, pc: Client,
                                                              nats_client: Client) -> None:
    await echo(nats_client, "chaos.echo")
    assert await round_trip(pc, "chaos.echo") < 0.25
    proxy.set_latency(0.25)
    assert await round_trip(pc, "chaos.echo") >= 0.5
    proxy.set_latency(0)
    assert await round_trip(pc, "chaos.echo") < 0.25


async def test_bandwidth_throttles_and_none_lifts_it(proxy: FaultProxy, pc: Client, nats_client: Client) -> None:
    payload = b"x" * 20_000
    for limit, slow in ((40_000.0, True), (None, False)):
        arrived = await first_message(nats_client, f"chaos.bulk.{slow}")
        proxy.set_bandwidth(limit)
        started = time.monotonic()
        await pc.publish(f"chaos.bulk.{slow}", payload)
        msg, at = await asyncio.wait_for(arrived, 10)
        assert msg.data == payload
        assert (at - started >= 0.4) is slow  # 20 kB at 40 kB/s takes 0.5 s
    assert proxy.stats.faults["bandwidth"] == 1


async def test_refuse_closes_new_connections_until_lifted(proxy: FaultProxy, pc: Client) -> None:
    proxy.refuse(True)
    with pytest.raises((nats.errors.NoServersError, OSError, nats.errors.UnexpectedEOF)):
        await nats.connect(proxy.url, connect_timeout=1, allow_reconnect=False, max_reconnect_attempts=0,
                           error_cb=quiet)
    assert proxy.stats.refused == 1
    assert pc.is_connected and proxy.connections == 1  # the current connection is untouched
    proxy.refuse(False)
    late = await nats.connect(proxy.url, connect_timeout=2, allow_reconnect=False)
    await late.close()


# --- the fault script --------------------------------------------------------------------------


FAST_FAULTS = (
    FaultSpec("blackhole", 2.0, duration=(0.05, 0.15)),
    FaultSpec("reset", 1.0),
    FaultSpec("latency", 1.0, duration=(0.05, 0.15), level=(0.01, 0.05)),
    FaultSpec("bandwidth", 1.0, duration=(0.05, 0.15), level=(5_000.0, 50_000.0)),
    FaultSpec("outage", 1.0, duration=(0.05, 0.15)),
)


def test_a_script_plans_the_same_faults_for_the_same_seed() -> None:
    def first(seed: int, n: int = 30) -> list[Any]:
        plan = FaultScript(random.Random(seed), FAST_FAULTS).plan(3)
        return [next(plan) for _ in range(n)]

    assert first(7) == first(7)
    assert first(7) != first(8)
    faults = first(7, 200)
    assert {f.kind for f in faults} == {"blackhole", "reset", "latency", "bandwidth", "outage"}
    assert {f.proxy for f in faults} == {0, 1, 2}
    assert all(f.duration == 0 for f in faults if f.kind == "reset")


async def test_a_script_injects_its_plan_and_leaves_every_proxy_healed(nats_url: str) -> None:
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    async with FaultProxy.for_url(nats_url) as p0, FaultProxy.for_url(nats_url) as p1:
        clients = [await nats.connect(p.url, reconnected_cb=on_reconnect, error_cb=quiet, reconnect_time_wait=0.1,
                                      max_reconnect_attempts=-1) for p in (p0, p1)]
        try:
            script = FaultScript(random.Random(3), FAST_FAULTS, gap=(0.02, 0.05))
            seen: list[str] = []
            injected = await script.run([p0, p1], duration=1.5, on_inject=lambda f: seen.append(f.kind))

            expected = FaultScript(random.Random(3), FAST_FAULTS, gap=(0.02, 0.05)).plan(2)
            assert [(f.kind, f.proxy) for f in injected] == [(e.kind, e.proxy) for e in
                                                            (next(expected) for _ in injected)]
            assert seen == [f.kind for f in injected] and len(injected) >= 5
            assert sum(script.counts().values()) == len(injected)
            assert script.summary().startswith(f"faults injected: {len(injected)} (")
            for p in (p0, p1):
                assert not p.blackholed and p.latency == 0 and p.bandwidth is None and not p.refusing
            starts = [f.start for f in injected]
            assert starts == sorted(starts)
            # Both workers' connections come back and work after the storm.
            for client in clients:
                arrived = await first_message(client, "chaos.calm")
                await client.publish("chaos.calm", b"ok")
                msg, _ = await asyncio.wait_for(arrived, 10)
                assert msg.data == b"ok"
        finally:
            for client in clients:
                await client.close()


async def test_a_group_is_faulted_as_one_and_the_script_reports_each_revert(nats_url: str) -> None:
    async with FaultProxy.for_url(nats_url) as p0, FaultProxy.for_url(nats_url) as p1:
        group = ProxyGroup([p0, p1])
        assert group.urls == [p0.url, p1.url]
        client = await nats.connect(group.urls, connect_timeout=2, reconnect_time_wait=0.1,
                                    max_reconnect_attempts=-1, error_cb=quiet)
        try:
            script = FaultScript(random.Random(2), [FaultSpec("blackhole", duration=(0.2, 0.2))], gap=(0.0, 0.0))
            events: list[tuple[str, str, bool]] = []

            def saw(what: str) -> Callable[[Any], None]:
                return lambda fault: events.append((what, fault.kind, p0.blackholed and p1.blackholed))

            running = asyncio.create_task(script.run([group], on_inject=saw("inject"), on_revert=saw("revert")))
            await p0.wait_until(lambda p: p.blackholed, timeout=5)
            assert p1.blackholed  # every member at once
            script.stop()
            [fault] = await asyncio.wait_for(running, 5)
            assert fault.kind == "blackhole"
            # The revert is reported after both members healed.
            assert events == [("inject", "blackhole", False), ("revert", "blackhole", False)]
            assert not (p0.blackholed or p1.blackholed)
            group.reset()
            await p0.wait_until(lambda p: p.stats.faults["reset"] == 1)
            assert p1.stats.faults["reset"] == 1
        finally:
            await client.close()


async def test_stop_ends_a_running_script_and_heals(proxy: FaultProxy) -> None:
    script = FaultScript(random.Random(1), [FaultSpec("blackhole", duration=(60.0, 60.0))], gap=(0.0, 0.0))
    running = asyncio.create_task(script.run([proxy]))
    await proxy.wait_until(lambda p: p.blackholed, timeout=5)
    script.stop()
    injected = await asyncio.wait_for(running, 5)
    assert [f.kind for f in injected] == ["blackhole"]
    assert not proxy.blackholed


# --- the fenced store --------------------------------------------------------------------------


@pytest.fixture
async def store(nc: Client) -> FencedStore:
    s = FencedStore(nc)
    await s.ensure()
    await s.ensure()  # idempotent: every worker process calls it
    return s


def fencings(records: Sequence[FencedRecord]) -> list[tuple[int, ...]]:
    return [r.fencing for r in records]


async def test_the_store_accepts_increasing_and_equal_fencing_and_refuses_lower(store: FencedStore) -> None:
    assert await store.write("k1", (1, 1), {"tag": "a"})
    assert await store.write("k1", (1, 1), {"tag": "a2"})      # the same holder writes again
    assert await store.write("k1", (2, 1), {"tag": "b"})
    assert not await store.write("k1", (1, 9), {"tag": "zombie"})
    assert not await store.write("k1", (2, 0), {"tag": "zombie2"})
    assert await store.write("k1", (2, 2), {"tag": "c"})       # a redelivery to the same lease
    assert await store.write("k2", (1, 1), {"tag": "x"})       # keys are independent
    assert (store.accepted, store.refused) == (5, 2)

    snapshot = await store.snapshot()
    assert fencings(snapshot.accepted["k1"]) == [(1, 1), (1, 1), (2, 1), (2, 2)]
    assert [r.payload["tag"] for r in snapshot.accepted["k1"]] == ["a", "a2", "b", "c"]
    assert [(r.fencing, r.stored, r.payload["tag"]) for r in snapshot.refused["k1"]] == [
        ((1, 9), (2, 1), "zombie"), ((2, 0), (2, 1), "zombie2")]
    assert (snapshot.accepted_count, snapshot.refused_count) == (5, 2)
    last = snapshot.last("k1")
    assert last is not None and last.payload == {"tag": "c"}
    assert await store.last("k1") == last
    assert check([], {}, store_history=snapshot.history()).ok


class PausingStore(FencedStore):
    """Stops after its first read of the key until ``go`` is set: a writer overtaken mid-write."""

    def __init__(self, nc: Client) -> None:
        super().__init__(nc)
        self.has_read, self.go = asyncio.Event(), asyncio.Event()

    async def last(self, key: str) -> FencedRecord | None:
        record = await super().last(key)
        if not self.has_read.is_set():
            self.has_read.set()
            await self.go.wait()
        return record


async def overtaken(nc: Client, other: FencedStore, mine: tuple[int, int],
                    theirs: tuple[int, int]) -> tuple[bool, int, list[tuple[int, ...]]]:
    """A slow writer reads, ``other`` writes ``theirs``, then the slow one writes ``mine``."""
    slow = PausingStore(nc)
    attempt = asyncio.create_task(slow.attempt("race", mine, {"by": "slow"}))
    await slow.has_read.wait()
    assert await other.write("race", theirs, {"by": "other"})
    slow.go.set()
    outcome = await attempt
    snapshot = await slow.snapshot()
    return outcome.accepted, outcome.conflicts, fencings(snapshot.accepted["race"])


async def test_a_writer_overtaken_by_a_higher_fencing_is_refused(store: FencedStore, nc: Client) -> None:
    # Without the compare-and-set, the slow writer's stale read would let its (1, 1) land after (2, 1).
    assert await overtaken(nc, store, mine=(1, 1), theirs=(2, 1)) == (False, 1, [(2, 1)])


async def test_a_writer_overtaken_by_a_lower_fencing_decides_again_and_writes(store: FencedStore,
                                                                              nc: Client) -> None:
    assert await overtaken(nc, store, mine=(2, 1), theirs=(1, 1)) == (True, 1, [(1, 1), (2, 1)])


async def test_concurrent_writers_on_one_key_keep_the_fencing_monotonic(store: FencedStore, nats_url: str) -> None:
    others = [await nats.connect(nats_url) for _ in range(3)]
    try:
        writers = [FencedStore(c) for c in others]
        rng = random.Random(5)
        # Each round's tokens are above every earlier round's, so every writer reads a record it may
        # overwrite and publishes: all but the first lose the compare-and-set, read again, and are
        # accepted (equal or higher token) or refused (lower).
        rounds = [[(i, rng.randrange(3)) for _ in writers] for i in range(30)]
        for i, tokens in enumerate(rounds):
            await asyncio.gather(*(w.write("hot", f, {"round": i, "w": n})
                                   for n, (w, f) in enumerate(zip(writers, tokens, strict=True))))
        snapshot = await store.snapshot()
        history = fencings(snapshot.accepted["hot"])
        assert history == sorted(history)
        assert len(history) == sum(w.accepted for w in writers)
        assert snapshot.refused_count == sum(w.refused for w in writers) == 3 * 30 - len(history)
        for refused in snapshot.refused["hot"]:
            assert refused.stored is not None and refused.stored > refused.fencing
        assert sum(w.conflicts for w in writers) > 0, "the writers never raced: the test proves nothing"
    finally:
        for c in others:
            await c.close()


class _LogSink:
    """The producer's fleet, as far as it uses one: the lines it would log."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def note(self, w: str, kind: str, **fields: Any) -> None:
        self.lines.append({"w": w, "kind": kind, **fields})


async def test_the_soaks_producer_stores_nothing_while_the_backlog_is_over_its_limit(nc: Client,
                                                                                    tmp_path: Any) -> None:
    # No worker: every request stored waits. Over 20 waiting, the producer holds back; once the inbox
    # is emptied, it stores again.
    config = QueueConfig(QUEUE, ack_wait=2.0)
    publisher = Publisher(nc, config.names)
    await Topology(publisher.api, config).ensure()
    sink = _LogSink()
    producer = _Producer(publisher, SoakOptions(seed=1, keys=12, rate=60.0, max_backlog=20, workdir=tmp_path,
                                                progress=None),
                         random.Random(1), sink, [])  # type: ignore[arg-type]
    ending = asyncio.Event()
    running = asyncio.create_task(producer.run(ending))

    async def until(condition: Callable[[], bool]) -> None:
        """Poll the producer's counters (plain fields: nothing to await) until ``condition`` holds."""
        async with asyncio.timeout(20):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    try:
        await until(lambda: producer.held_back >= 0.3)
        stored = producer.enqueued
        assert stored > 20
        await until(lambda: producer.held_back >= 1.5)  # 12 turns of 0.1 s held back: nothing stored
        assert producer.enqueued == stored
        await publisher.api.purge(config.names.inbox_stream)
        await until(lambda: producer.enqueued > stored)  # the next check finds the inbox empty
    finally:
        ending.set()
        await running
    assert len([line for line in sink.lines if line["kind"] == "stored"]) == producer.enqueued


async def test_the_soak_finds_which_foreign_tokens_are_still_stored(nc: Client, nats_url: str) -> None:
    # A token stored on a subject that is not UTF-8, sent over a bare connection as the soak sends it:
    # the server names it with U+FFFD for each byte it cannot read; the soak finds it by its key as a
    # worker reads it, and finds it gone once the token stream no longer holds it.
    config = QueueConfig(QUEUE, ack_wait=2.0)
    api = Publisher(nc, config.names).api
    await Topology(api, config).ensure()
    lines, key = foreign_subjects(QUEUE, 7)
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n' + lines)
        await writer.drain()
        assert await _foreign_ack(reader, writer)
    finally:
        writer.close()
    await nc.publish(config.names.token("k1"), b"")  # an ordinary key's token is none of these
    await nc.flush()
    assert key == "\\xff\\xfe7"
    assert await _foreign_tokens_stored(api, {key, "\\xff\\xfe8"}) == {key}
    await api.purge(config.names.token_stream, subject=config.names.token_prefix + ">")
    assert await _foreign_tokens_stored(api, {key}) == set()


async def test_a_worker_silent_with_requests_waiting_is_dumped_once(nc: Client, nats_url: str,
                                                                    tmp_path: Path) -> None:
    # A real chaos worker, silent (nothing for it to do) while the log says a request waits: the
    # watch sends SIGQUIT and SIGHUP, and the worker writes its threads' stacks (faulthandler) and
    # its client's state and asyncio tasks (the event loop) into its stderr, and a dumped record.
    await Topology(Publisher(nc, QueueConfig(QUEUE).names).api, QueueConfig(QUEUE)).ensure()
    await FencedStore(nc).ensure()
    log_path = tmp_path / "run.jsonl"
    fleet = Fleet(WorkerSpec(QUEUE, ack_wait=2.0, concurrency=2, replicas=1), {"w0": nats_url}, log_path)
    try:
        fleet.start("w0")
        await fleet.wait_ready(["w0"], timeout=60)
        watch = SilenceWatch(fleet, after=5.0)
        watch.look(time.time())
        assert watch.dumps == 0  # nothing waits
        fleet.note("producer", "stored", key="k", tag="k-1")
        watch.look(time.time())
        assert watch.dumps == 0  # heard from within 5 s
        watch.look(time.time() + 6)
        watch.look(time.time() + 7)
        assert watch.dumps == 1  # once per silence
        stderr = log_path.with_suffix(".w0.stderr")
        dumped = None
        for _ in range(200):
            dumped = next((r for r in LogTail(log_path).new_records() if r["kind"] == "dumped"), None)
            if dumped is not None and "Stack for <Task" in stderr.read_text():
                break
            await asyncio.sleep(0.05)
        assert dumped is not None and dumped["connected"] is True and dumped["reconnecting"] is False
        assert dumped["reconnect_task"] is None and dumped["tasks"] > 0
        text = stderr.read_text()
        assert "Current thread" in text or "Thread 0x" in text  # faulthandler's dump
        assert "--- dump at" in text and "Stack for <Task" in text  # the client's state, each task's stack
        assert any(r["kind"] == "dump" and r["target"] == "w0" for r in LogTail(log_path).new_records())
        # A record of its own ends the silence: the next one is dumped again.
        fleet.note("w0", "event", event="token", key="k")
        watch.look(time.time())
        watch.look(time.time() + 6)
        assert watch.dumps == 2
        # A process that ended (or a new one not ready yet: no handler for the signals) is left alone.
        fleet.note("w0", "exited", pid=0, code=-9)
        watch.look(time.time())
        watch.look(time.time() + 60)
        assert watch.dumps == 2
    finally:
        fleet.stop_all()
