"""The Rebaser's promises with worker processes and faults: order, durability of an owed DVU, no stranding.

Workers run as separate OS processes (tests/rebaser/rebaser_worker.py) and append every session
and Rebaser event to one log; the final state of each change set is compared with applying its
requests sequentially in memory (keyqueue_rebaser.workload).
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rebaser_harness import RebaserFleet, rebaser_events, session_events

from keyqueue.ext import JetStreamApi
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.subjects import QueueNames
from keyqueue_rebaser import RebaserClient, Update, load_functions
from keyqueue_rebaser.workload import ChangeSetModel, compare, setup_updates

ACK_WAIT = 2.0


@pytest.fixture
def fleet(nats_url: str, tmp_path: Path) -> Iterator[RebaserFleet]:
    f = RebaserFleet(nats_url, "rebaser", tmp_path / "log.jsonl")
    yield f
    f.stop_all()


def handled(log: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per change set, the request ids applied or refused, first occurrence of each, in log order."""
    out: dict[str, list[str]] = defaultdict(list)
    for r in log:
        if r["kind"] == "rebaser" and r["event"] in ("applied", "refused") and r["request_id"] not in out[r["key"]]:
            out[r["key"]].append(r["request_id"])
    return out


async def settle_and_compare(client: RebaserClient, models: dict[tuple[str, str], ChangeSetModel]) -> None:
    """One more request per change set, waited for through its DVU; then every stored graph must match."""
    settled = await asyncio.gather(*(client.enqueue_updates(w, cs, [Update.set_value("in5", 1)], await_dvu=True)
                                     for w, cs in models))
    assert all(r.ok and r.dvu_run is not None for r in settled), settled
    for (w, cs), model in models.items():
        model.apply([Update.set_value("in5", 1)])
        state = await client.snapshot(w, cs)
        expected = await asyncio.to_thread(model.expected)
        assert compare(state.nodes, expected) == [], f"{w}.{cs}"
        assert state.change == model.applied and not state.dvu_owed


async def test_updates_apply_in_enqueue_order_across_three_workers(client: RebaserClient, fleet: RebaserFleet,
                                                                   nats_url: str) -> None:
    for name in ("w0", "w1", "w2"):
        fleet.start(name, "--concurrency", "16")
    await fleet.wait_ready("w0", "w1", "w2")
    rng = random.Random(11)
    models = {("ws", f"cs{i}"): ChangeSetModel() for i in range(30)}
    plans: dict[tuple[str, str], list[list[Update]]] = {}
    for key, model in models.items():
        plans[key] = [setup_updates()]
        model.apply(plans[key][0])
        for _ in range(14):
            updates = model.random_request(rng)
            model.apply(updates)
            plans[key].append(updates)
    # Interleaved across change sets, in bursts, as many producers would send them.
    batch = [(w, cs, plans[(w, cs)][j]) for j in range(15) for (w, cs) in models]
    results = await client.enqueue_many(batch)
    ids: dict[str, list[str]] = defaultdict(list)
    for (w, cs, _), result in zip(batch, results, strict=True):
        ids[f"{w}.{cs}"].append(result.request_id)  # type: ignore[union-attr]
    log = await fleet.wait_for(lambda log: sum(map(len, handled(log).values())) == len(batch), timeout=60,
                               what="every request applied or refused")
    assert handled(log) == ids, "a change set's requests were not handled in enqueue order"
    assert len({r["w"] for r in rebaser_events(log, "applied")}) >= 2, "the change sets were not spread over workers"
    await settle_and_compare(client, models)


async def test_kill_9_mid_dvu_the_owed_dvu_runs_on_the_next_holder(client: RebaserClient, fleet: RebaserFleet) -> None:
    victim = fleet.start("victim")
    await fleet.wait_ready("victim")
    model = ChangeSetModel(load_functions([__import__("slow_functions")], autoload=False))
    first = [*setup_updates(), Update.add_node("slowed"),
             Update.add_dependency("slowed", "slow", ["in0", "in1"], {"seconds": 2.0})]
    requests = [first, *([Update.set_value("in0", 10 + i)] for i in range(5))]
    for updates in requests:
        model.apply(updates)
    # Stored together: the victim applies the first, starts the slow DVU, and applies the rest beside it.
    await client.enqueue_many([("w", "cs", updates) for updates in requests])
    await fleet.wait_for(lambda log: len(rebaser_events(log, "applied", w="victim")) == 6
                         and bool(rebaser_events(log, "dvu_started", w="victim")), what="6 applied, DVU running")
    victim.kill()
    log = fleet.records()
    assert not rebaser_events(log, "dvu_finished"), "the DVU finished before the kill; the test proves nothing"
    fleet.start("heir")
    log = await fleet.wait_for(lambda log: bool(rebaser_events(log, "dvu_finished", w="heir")), timeout=30,
                               what="the heir's DVU")
    owed = rebaser_events(log, "dvu_owed", w="heir", key="w.cs")
    assert owed and owed[0]["roots"] > 0 and owed[0]["change"] == 6, "the heir did not find the owed DVU in the store"
    assert not rebaser_events(log, "applied", w="heir"), "an update applied by the victim was applied again"
    await settle_and_compare(client, {("w", "cs"): model})


async def test_sigterm_mid_dvu_hands_the_owed_dvu_over(fleet: RebaserFleet) -> None:
    """ack_wait is 30 s here: the change set can only move this fast by the drain's hand-off."""
    for name in ("w0", "w1"):
        fleet.start(name, "--ack-wait", "30", "--drain-timeout", "0.5")
    await fleet.wait_ready("w0", "w1")
    async with await RebaserClient.connect(fleet.url, ack_wait=30, timeout=30) as client:
        model = ChangeSetModel(load_functions([__import__("slow_functions")], autoload=False))
        first = [*setup_updates(), Update.add_node("slowed"),
                 Update.add_dependency("slowed", "slow", ["in0"], {"seconds": 2.0})]
        model.apply(first)
        await client.enqueue_updates("w", "cs", first, wait=False)
        log = await fleet.wait_for(lambda log: bool(rebaser_events(log, "dvu_started")), what="the DVU")
        leaving_name = rebaser_events(log, "dvu_started")[0]["w"]
        staying_name = "w1" if leaving_name == "w0" else "w0"
        leaving = next(w for w in fleet.workers if w.name == leaving_name)
        leaving.signal(signal.SIGTERM)
        log = await fleet.wait_for(lambda log: bool(rebaser_events(log, "dvu_finished", w=staying_name)),
                                   timeout=20, what="the staying worker's DVU")
        assert leaving.proc.wait(timeout=10) == 0
        assert not rebaser_events(log, "dvu_finished", w=leaving_name), "the drain deadline did not cut the DVU off"
        assert rebaser_events(log, "dvu_owed", w=staying_name), "the owed DVU was lost on shutdown"
        await settle_and_compare(client, {("w", "cs"): model})


async def test_quiescence_race_through_the_client_strands_nothing(client: RebaserClient, fleet: RebaserFleet,
                                                                  nats_url: str) -> None:
    """Producers keep enqueueing on a few change sets while sessions release after a near-zero linger."""
    fleet.start("w0", "--linger", "0.001")
    fleet.start("w1", "--linger", "0.001")
    await fleet.wait_ready("w0", "w1")
    change_sets = [f"hot{i}" for i in range(5)]
    producers = range(4)
    setup = [*(Update.add_node(f"p{p}", 0) for p in producers), Update.add_node("total"),
             Update.add_dependency("total", "sum", [f"p{p}" for p in producers])]
    for cs in change_sets:
        assert (await client.enqueue_updates("w", cs, setup)).ok
    last: dict[tuple[str, int], int] = {}

    async def producer(p: int) -> None:
        rng = random.Random(p)
        for j in range(100):
            cs = rng.choice(change_sets)
            await client.enqueue_updates("w", cs, [Update.set_value(f"p{p}", j)], wait=False)
            last[(cs, p)] = j
            await asyncio.sleep(rng.random() * 0.05)  # gaps, so sessions keep releasing between requests

    await asyncio.gather(*(producer(p) for p in producers))
    total = len(change_sets) + 100 * len(producers)
    log = await fleet.wait_for(lambda log: len(rebaser_events(log, "applied")) >= total, timeout=60,
                               what="every request applied")
    assert len(rebaser_events(log, "applied")) == total, "a request was applied twice"
    settled = await asyncio.gather(*(client.enqueue_updates("w", cs, [], await_dvu=True) for cs in change_sets))
    assert all(r.ok for r in settled)
    for cs in change_sets:
        state = await client.snapshot("w", cs)
        values = {p: last.get((cs, p), 0) for p in producers}
        assert state.values() == {**{f"p{p}": v for p, v in values.items()}, "total": sum(values.values())}, cs
    waiting = await requests_waiting(JetStreamApi(client.nc), QueueNames("rebaser"))
    assert waiting == 0, "a request was stranded in the inbox"
    released = session_events(log, "released", outcome="released")
    assert len(released) > 30, f"sessions did not release often enough to exercise the race: {len(released)}"
    print(f"quiescence race: {len(released)} key sessions released while requests kept arriving")
