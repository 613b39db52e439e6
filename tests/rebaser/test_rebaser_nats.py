"""The Rebaser against a real nats-server, with a worker in this process: DVU, coalescing, versions, fencing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Self, TypeVar

import pytest
from rebaser_harness import InProcessRebaser, dvu_events

from keyqueue import LeaseLost, Request
from keyqueue.ext import JetStreamApi, OutgoingRequest, Publisher, connect
from keyqueue.wire import Message, Registry, encode
from keyqueue.wire import headers as H
from keyqueue_rebaser import (
    EnqueueUpdatesRequestV1,
    EnqueueUpdatesRequestV2,
    EnqueueUpdatesRequestV3,
    RebaserClient,
    RebaserProcessor,
    SnapshotConflict,
    SnapshotStore,
    Update,
    load_functions,
)
from keyqueue_rebaser.state import ChangeSetState
from keyqueue_rebaser.workload import ChangeSetModel, compare, setup_updates

ACK_WAIT = 5.0
T = TypeVar("T")


async def test_updates_apply_and_a_dvu_covers_them(nats_url: str, client: RebaserClient) -> None:
    async with InProcessRebaser(nats_url):
        setup = await client.enqueue_updates("w1", "cs1", setup_updates())
        assert setup.ok and setup.change == 1 and setup.updates_performed == len(setup_updates()) and setup.dvu_owed
        covered = await client.enqueue_updates("w1", "cs1", [Update.set_value("in0", 100)], await_dvu=True)
        assert covered.ok and covered.change == 2 and covered.dvu_run is not None and covered.dvu_errors == []
        refused = await client.enqueue_updates("w1", "cs1", [Update.add_dependency("in0", "identity", ["grand"])])
        assert refused.status == "error" and "cycle" in (refused.message or "") and refused.change == 0
        state = await client.snapshot("w1", "cs1")
        run = state.run_covering(2)
        assert run is not None and run.run == covered.dvu_run
        model = ChangeSetModel()
        model.apply(setup_updates())
        model.apply([Update.set_value("in0", 100)])
        assert compare(state.nodes, model.expected()) == []
        assert state.values()["total"] == 105 and state.values()["echo"] == "total=105 high=6/4"
        assert not state.dvu_owed


async def test_a_burst_during_a_slow_dvu_coalesces_into_one_more_run(nats_url: str, client: RebaserClient) -> None:
    """200 requests land while one slow DVU runs: after the burst at most one more DVU runs."""
    async with InProcessRebaser(nats_url, linger=1.0) as worker:
        model = ChangeSetModel(load_functions([__import__("slow_functions")], autoload=False))
        first = [*setup_updates(), Update.add_node("slowed"),
                 Update.add_dependency("slowed", "slow", ["in0", "in1"], {"seconds": 2.0})]
        model.apply(first)
        await client.enqueue_updates("w1", "hot", first, wait=False)
        await worker.wait_for(lambda w: bool(w.named("dvu_started", key="w1.hot")), what="the slow DVU")
        burst = [[Update.set_value(f"in{i % 6}", i)] for i in range(200)]
        for updates in burst:
            model.apply(updates)
        results = await client.enqueue_many([("w1", "hot", updates) for updates in burst[:-1]])
        assert all(not isinstance(r, Exception) for r in results)
        last = await client.enqueue_updates("w1", "hot", burst[-1], await_dvu=True)
        assert last.ok and last.change == 201

        runs = worker.named("dvu_started", key="w1.hot")
        finished = worker.named("dvu_finished", key="w1.hot")
        applied = worker.named("applied", key="w1.hot")
        assert len(applied) == 201
        burst_end = max(a["t"] for a in applied)
        assert burst_end < finished[0]["t"], "the burst did not land while the first DVU ran; the test proves nothing"
        after = [r for r in runs if r["t"] > burst_end]
        assert len(after) <= 1, f"{len(after)} DVU runs started after the burst"
        assert len(runs) == 2 and last.dvu_run == 2 and finished[1]["covered"] == 201
        assert finished[1]["triggers"] == 200, "the second run absorbs all 200 triggers"
        state = await client.snapshot("w1", "hot")
        expected = await asyncio.to_thread(model.expected)  # it runs `slow` too: not on the worker's loop
        assert compare(state.nodes, expected) == [] and not state.dvu_owed
        assert (state.triggers, state.dvu_runs) == (201, 2)
        # The same runs in keyqueue's events stream, where `keyqueue report` reads the coalescing ratio.
        published = await dvu_events(worker.app, "w1.hot", 2)
        assert [(e["run_id"], e["triggers"], e["worker"]) for e in published] == [
            ("w1.hot#1", 1, "inproc"), ("w1.hot#2", 200, "inproc")]
        assert all(e["run"] >= 2.0 for e in published), "each run took the slow function's 2 s"


# --- versions and bad input ----------------------------------------------------------------------

NEWER = Registry()
for _cls in (EnqueueUpdatesRequestV1, EnqueueUpdatesRequestV2, EnqueueUpdatesRequestV3):
    NEWER.register(_cls)


@NEWER.register
@dataclass(frozen=True)
class EnqueueUpdatesRequestV4(Message):
    """A newer client's version, unknown to the worker."""

    TYPE = "EnqueueUpdatesRequest"
    VERSION = 4

    workspace_id: str
    change_set_id: str
    updates: list[Update]
    from_change_set_id: str | None
    event_session_id: str | None
    priority: int

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, EnqueueUpdatesRequestV3)
        return cls(previous.workspace_id, previous.change_set_id, previous.updates, previous.from_change_set_id,
                   previous.event_session_id, priority=0)


async def test_old_versions_upgrade_and_new_or_headerless_requests_are_dead_lettered(
        nats_url: str, client: RebaserClient) -> None:
    async with InProcessRebaser(nats_url) as worker:
        v1 = await client.send(EnqueueUpdatesRequestV1("w1", "cs1", [Update.add_node("a", 1)]))
        v2 = await client.send(EnqueueUpdatesRequestV2("w1", "cs1", [Update.set_value("a", 2)], "cs0"),
                               content_type=H.JSON)
        assert v1.ok and v2.ok and (v1.change, v2.change) == (1, 2)  # type: ignore[union-attr]
        v4 = await client.send(EnqueueUpdatesRequestV4("w1", "cs1", [Update.set_value("a", 4)], None, None, 1))
        assert not v4.ok  # type: ignore[union-attr]
        assert "UnsupportedVersion" in (v4.message or "") and "versions 1..3" in (v4.message or "")  # type: ignore[union-attr]
        body = encode(EnqueueUpdatesRequestV3("w1", "cs1", [Update.set_value("a", 5)], None, None)).body
        await Publisher(client.nc, client.config.names).enqueue(OutgoingRequest("w1.cs1", {}, body, "noheaders"))
        after = await client.enqueue_updates("w1", "cs1", [Update.set_value("a", 6)], event_session_id="es-1",
                                             await_dvu=True)
        assert after.ok and after.change == 3, "the change set went on after the dead-lettered requests"

        api = JetStreamApi(client.nc)
        dlq = [await api.get_msg("KQ_rebaser_DLQ", seq=s) for s in (1, 2)]
        assert [m.headers[H.DLQ_ERROR_TYPE] for m in dlq if m] == ["UnsupportedVersion", "MissingHeader"]
        state = await client.snapshot("w1", "cs1")
        assert state.values() == {"a": 6} and state.rebased_from == "cs0"
        run = state.run_covering(after.change)
        assert run is not None and run.run == after.dvu_run and run.event_sessions == ["es-1"]
        assert len(worker.named("session:dead_lettered")) == 2


async def test_enqueue_returns_only_once_the_change_set_is_scheduled(client: RebaserClient) -> None:
    """Lesson from the original: its client dropped the token publish's ack future."""
    accepted = await client.enqueue_updates("w1", "cs9", [Update.add_node("a")], wait=False)
    assert accepted.seq == 1
    api = JetStreamApi(client.nc)
    token = await api.get_msg("KQ_rebaser_TOKENS", last_by_subject="kq.rebaser.tok.w1.cs9", direct=False)
    assert token is not None, "enqueue returned before the change set's token was stored"


# --- fencing -------------------------------------------------------------------------------------


async def test_a_stale_writer_fails_and_names_its_fencing_token(nats_url: str) -> None:
    nc = await connect(nats_url)
    try:
        store = await SnapshotStore.open(nc, "fencing_test")
        _, revision = await store.load("w.cs")
        newer = await store.save("w.cs", ChangeSetState(fencing=(7, 1)), expected_revision=revision)
        with pytest.raises(SnapshotConflict, match=r"fencing token \(6, 3\)"):
            await store.save("w.cs", ChangeSetState(fencing=(6, 3)), expected_revision=revision)
        state, current = await store.load("w.cs")
        assert current == newer and state.fencing == (7, 1)
    finally:
        await nc.close()


class FakeContext:
    """Just enough of a key session's context to drive a processor by hand."""

    def __init__(self, key: str, fencing: tuple[int, int]) -> None:
        import logging

        self.queue, self.key, self.fencing = "rebaser", key, fencing
        self.request_id, self.attempt = "", 1
        self.log = logging.LoggerAdapter(logging.getLogger("test"), {})

    hold_removal = None

    def lease_valid(self) -> bool:
        return True

    def lease_remaining(self) -> float:
        return float("inf")

    def check_lease(self) -> None:
        return None

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        return await step()

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def progress(self, data: bytes, headers: object = None) -> None:
        return None


async def test_a_stale_holder_stops_when_a_newer_holder_wrote(nats_url: str) -> None:
    nc = await connect(nats_url)
    try:
        store = await SnapshotStore.open(nc, "stale_test")
        functions = load_functions(autoload=False)

        async def send(inbox: str, headers: object, body: bytes) -> None:
            return None

        def request(seq: int, value: int) -> Request:
            encoded = encode(EnqueueUpdatesRequestV3("w", "cs", [Update.set_value("a", value)], None, None))
            return Request("w.cs", seq, "kq.rebaser.in.w.cs", encoded.headers, encoded.body)

        setup = RebaserProcessor(store, functions, send)
        ctx0 = FakeContext("w.cs", (1, 1))
        await setup.open(ctx0)  # type: ignore[arg-type]
        encoded = encode(EnqueueUpdatesRequestV3("w", "cs", [Update.add_node("a", 0)], None, None))
        await setup.handle(ctx0, Request("w.cs", 1, "s", encoded.headers, encoded.body))  # type: ignore[arg-type]
        await setup.idle(ctx0)  # type: ignore[arg-type]
        await setup.close(ctx0, "done")  # type: ignore[arg-type]

        stale, newer = RebaserProcessor(store, functions, send), RebaserProcessor(store, functions, send)
        stale_ctx, newer_ctx = FakeContext("w.cs", (2, 1)), FakeContext("w.cs", (2, 2))
        await stale.open(stale_ctx)  # type: ignore[arg-type]
        await newer.open(newer_ctx)  # type: ignore[arg-type]
        await newer.handle(newer_ctx, request(2, 20))  # type: ignore[arg-type]
        with pytest.raises(LeaseLost, match=r"fencing token \(2, 1\).*newer holder's fencing token \(2, 2\)"):
            await stale.handle(stale_ctx, request(3, 30))  # type: ignore[arg-type]
        await newer.idle(newer_ctx)  # type: ignore[arg-type]
        state, _ = await store.load("w.cs")
        assert state.values() == {"a": 20} and state.fencing == (2, 2)
        for processor, ctx in ((stale, stale_ctx), (newer, newer_ctx)):
            await processor.close(ctx, "done")  # type: ignore[arg-type]
    finally:
        await nc.close()


async def test_throughput_smoke(nats_url: str, client: RebaserClient) -> None:
    """Many change sets at once: every request answered, and each change set settles with correct values."""
    async with InProcessRebaser(nats_url, concurrency=64):
        models = {f"cs{i}": ChangeSetModel() for i in range(20)}
        batch = []
        for cs, model in models.items():
            model.apply(setup_updates())
            batch.append(("w2", cs, setup_updates()))
        started = time.monotonic()
        responses = await client.enqueue_many(batch, wait=True)
        assert all(getattr(r, "ok", False) for r in responses), responses[:3]
        settled = await asyncio.gather(*(client.enqueue_updates("w2", cs, [Update.set_value("in1", 9)], await_dvu=True)
                                         for cs in models))
        for model in models.values():
            model.apply([Update.set_value("in1", 9)])
        assert all(r.dvu_run is not None for r in settled)
        for cs, model in models.items():
            state = await client.snapshot("w2", cs)
            assert compare(state.nodes, model.expected()) == [], cs
        assert time.monotonic() - started < 20
