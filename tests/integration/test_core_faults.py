"""The core's promises under many workers and faults (exclusivity, order, nothing lost).

Workers run as separate OS processes (tests/procs/worker_proc.py) and append every handler
start/end and session event to one log; each test checks that log.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "procs"))
import itertools

from harness import Fleet, check_exclusive, check_order, ends_by_tag, work

ACK_WAIT = 2.0


@pytest.fixture
def fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(nats_url, "q", tmp_path / "log.jsonl")
    yield f
    f.stop_all()


async def setup_queue(nc: Client, name: str = "q", ack_wait: float = ACK_WAIT) -> tuple[Publisher, JetStreamApi]:
    config = QueueConfig(name, ack_wait=ack_wait)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    return Publisher(nc, config.names), api


def events(log: list[dict], name: str, **match: object) -> list[dict]:
    return [r for r in log if r["kind"] == "event" and r["event"] == name
            and all(r.get(k) == v for k, v in match.items())]


async def test_exclusive_and_ordered_across_four_workers(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc)
    for i in range(4):
        fleet.start(f"w{i}", "--concurrency", "32")
    await fleet.wait_ready("w0", "w1", "w2", "w3")
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(200)]
    expected = {k: [f"{k}-{j}" for j in range(20)] for k in keys}
    batch = [work(k, f"{k}-{j}", sleep=rng.choice([0, 0, 0.001, 0.005])) for j in range(20) for k in keys]
    results = await pub.enqueue_many(batch)
    assert all(not isinstance(r, Exception) for r in results)
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 4000, timeout=120, what="4000 requests")
    counts = ends_by_tag(log)
    assert set(counts.values()) == {1}, "a request ran twice without any fault"
    check_exclusive(log)
    check_order(log, expected)
    assert len({r["w"] for r in log if r["kind"] == "end"}) >= 2, "work was not spread over the fleet"


async def test_no_head_of_line_blocking(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc, ack_wait=4)
    fleet.start("w0", "--concurrency", "8", "--ack-wait", "4")
    await fleet.wait_ready("w0")
    await pub.enqueue(work("slow", "slow-0", sleep=10))
    await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"] == "slow-0" for r in log))
    others = [work(f"fast{i}", f"fast{i}-{j}") for j in range(5) for i in range(20)]
    await pub.enqueue_many(others)
    log = await fleet.wait_for(lambda log: sum(1 for t in ends_by_tag(log) if t.startswith("fast")) == 100,
                               timeout=30, what="fast keys")
    assert "slow-0" not in ends_by_tag(log), "the fast keys waited for the slow one"


async def test_quiescence_race_strands_nothing(nc: Client, fleet: Fleet) -> None:
    """Producers keep enqueueing on a few keys while sessions release after a near-zero linger."""
    pub, _ = await setup_queue(nc)
    fleet.start("w0", "--linger", "0.001")
    fleet.start("w1", "--linger", "0.001")
    await fleet.wait_ready("w0", "w1")
    keys = [f"hot{i}" for i in range(5)]
    expected: dict[str, list[str]] = {k: [] for k in keys}

    async def producer(p: int) -> None:
        rng = random.Random(p)
        for j in range(150):
            key = rng.choice(keys)
            tag = f"{key}-p{p}-{j}"
            expected[key].append(tag)
            await pub.enqueue(work(key, tag))
            await asyncio.sleep(rng.random() * 0.01)

    await asyncio.gather(*(producer(p) for p in range(4)))
    total = sum(len(v) for v in expected.values())
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == total, timeout=60, what="all requests")
    check_exclusive(log)
    released = events(log, "released")
    republished = [r for r in released if r.get("republished") in (True, "True")]
    assert len(released) > 50, "sessions did not release often enough to exercise the race"
    print(f"quiescence race: {len(released)} releases, {len(republished)} re-published tokens at the re-check")


async def test_kill_9_mid_request_reruns_elsewhere(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc)
    victim = fleet.start("victim")
    await fleet.wait_ready("victim")
    await pub.enqueue(work("k", "k-0", sleep=30))
    await pub.enqueue(work("k", "k-1"))
    await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"] == "k-0" for r in log))
    victim.kill()
    await pub.enqueue(work("k", "k-2"))
    fleet.start("heir")
    # k-0 sleeps 30 s: rather than wait, the heir's re-run is visible as a second start.
    log = await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"] == "k-0" and r["w"] == "heir"
                                               for r in log), timeout=30, what="re-run on the heir")
    rerun = next(r for r in log if r["kind"] == "start" and r["w"] == "heir")
    first = next(r for r in log if r["kind"] == "start" and r["w"] == "victim")
    assert rerun["fencing"] > first["fencing"], "the fencing token did not increase across holders"


async def test_kill_9_nothing_lost(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc)
    victim = fleet.start("victim", "--concurrency", "8")
    fleet.start("survivor", "--concurrency", "8")
    await fleet.wait_ready("victim", "survivor")
    keys = [f"k{i}" for i in range(20)]
    expected = {k: [f"{k}-{j}" for j in range(10)] for k in keys}
    await pub.enqueue_many([work(k, f"{k}-{j}", sleep=0.02) for j in range(10) for k in keys])
    await fleet.wait_for(lambda log: sum(1 for r in log if r["kind"] == "end" and r["w"] == "victim") >= 5)
    victim.kill()
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 200, timeout=60, what="every request")
    check_order(log, expected)


async def test_sigstop_past_ack_wait_then_sigcont(nc: Client, fleet: Fleet, nats_url: str) -> None:
    pub, api = await setup_queue(nc)
    paused = fleet.start("paused")
    await fleet.wait_ready("paused")
    await pub.enqueue(work("k", "k-0", sleep=1.0))
    await pub.enqueue(work("k", "k-1", sleep=6.0))
    await pub.enqueue(work("k", "k-2"))
    await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"] == "k-0" for r in log))
    paused.signal(signal.SIGSTOP)
    fleet.start("other")
    await fleet.wait_ready("other")
    # After ack_wait the token goes to `other`, which re-runs k-0 and then starts the long k-1.
    await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"] == "k-1" and r["w"] == "other"
                                         for r in log), timeout=30, what="other takes the key")
    paused.signal(signal.SIGCONT)
    log = await fleet.wait_for(lambda log: bool(events(log, "lease_lost", w="paused", key="k")), timeout=10,
                               what="the resumed worker noticing its lost lease")
    # `other` is still inside k-1 (6 s): its token must still exist, i.e. nobody acked it.
    assert not any(r["kind"] == "end" and r["tag"] == "k-1" for r in log)
    tokens = await api.stream_info("KQ_q_TOKENS")
    assert tokens["state"]["messages"] == 1, "the resumed worker deleted the other holder's token"
    log = await fleet.wait_for(lambda log: "k-2" in ends_by_tag(log), timeout=30, what="k-2 done")
    starts_by_paused = [r["tag"] for r in log if r["kind"] == "start" and r["w"] == "paused"]
    assert starts_by_paused == ["k-0"], f"the resumed worker started more work: {starts_by_paused}"
    assert not [r for r in events(log, "released", w="paused")], "the resumed worker released (acked) the key"
    check_order(log, {"k": ["k-0", "k-1", "k-2"]})


async def test_server_restart_mid_run(nats_server: EmbeddedServer, nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc)
    fleet.start("w0")
    fleet.start("w1")
    await fleet.wait_ready("w0", "w1")
    keys = [f"k{i}" for i in range(30)]
    expected = {k: [f"{k}-{j}" for j in range(10)] for k in keys}
    await pub.enqueue_many([work(k, f"{k}-{j}", sleep=0.01) for j in range(10) for k in keys])
    await fleet.wait_for(lambda log: len(ends_by_tag(log)) >= 20)
    await nats_server.restart()
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 300, timeout=90, what="every request")
    check_order(log, expected)


async def test_graceful_shutdown_hands_keys_over(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc, ack_wait=30)
    leaving = fleet.start("leaving", "--ack-wait", "30", "--drain-timeout", "5")
    await fleet.wait_ready("leaving")
    for i in range(4):
        await pub.enqueue(work(f"k{i}", f"k{i}-long", sleep=3.0))  # outlasts starting "staying" on a loaded machine
        await pub.enqueue(work(f"k{i}", f"k{i}-next"))
    await fleet.wait_for(lambda log: sum(1 for r in log if r["kind"] == "start") == 4)
    fleet.start("staying", "--ack-wait", "30")
    await fleet.wait_ready("staying")
    leaving.signal(signal.SIGTERM)
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 8, timeout=20, what="all 8 requests")
    assert leaving.proc.wait(timeout=10) == 0
    for i in range(4):
        assert any(r["kind"] == "end" and r["tag"] == f"k{i}-long" and r["w"] == "leaving" for r in log)
        assert any(r["kind"] == "end" and r["tag"] == f"k{i}-next" and r["w"] == "staying" for r in log), \
            "the next request did not move to the staying worker (ack_wait is 30 s, so it moved by hand-off)"


async def test_graceful_shutdown_interrupts_past_drain_deadline(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc, ack_wait=30)
    leaving = fleet.start("leaving", "--ack-wait", "30", "--drain-timeout", "0.5")
    await fleet.wait_ready("leaving")
    await pub.enqueue(work("k", "k-too-long", sleep=5.0))
    await fleet.wait_for(lambda log: any(r["kind"] == "start" for r in log))
    fleet.start("staying", "--ack-wait", "30")
    await fleet.wait_ready("staying")
    leaving.signal(signal.SIGTERM)
    log = await fleet.wait_for(lambda log: "k-too-long" in ends_by_tag(log), timeout=20, what="the re-run")
    assert [r["w"] for r in log if r["kind"] == "end"] == ["staying"]


async def test_bad_input_goes_to_dlq_and_key_continues(nc: Client, fleet: Fleet) -> None:
    from keyqueue.jetstream.publish import OutgoingRequest
    from keyqueue.wire import headers as H

    pub, api = await setup_queue(nc)
    fleet.start("w0")
    await fleet.wait_ready("w0")
    good = work("k", "k-ok")
    base = dict(good.headers)
    bad = [
        OutgoingRequest("k", {**base, H.MSG_ID: "garbage"}, b"\xff\x00garbage", "garbage"),
        OutgoingRequest("k", {**base, H.MSG_ID: "unknown", H.MESSAGE_TYPE: "Nope"}, good.body, "unknown"),
        OutgoingRequest("k", {**base, H.MSG_ID: "newer", H.MESSAGE_VERSION: "9"}, b"junk", "newer"),
        OutgoingRequest("k", {H.MSG_ID: "noheaders"}, good.body, "noheaders"),
    ]
    for b in bad:
        await pub.enqueue(b)
    await pub.enqueue(good)
    log = await fleet.wait_for(lambda log: "k-ok" in ends_by_tag(log), timeout=20, what="the good request")
    dead = events(log, "dead_lettered")
    assert [d["request_id"] for d in dead] == ["garbage", "unknown", "newer", "noheaders"]
    assert {d["reason"] for d in dead} == {"rejected"}
    info = await api.stream_info("KQ_q_DLQ")
    assert info["state"]["messages"] == 4
    errors = [(await api.get_msg("KQ_q_DLQ", seq=s)).headers[H.DLQ_ERROR_TYPE] for s in range(1, 5)]  # type: ignore[union-attr]
    assert errors == ["MalformedBody", "UnknownMessageType", "UnsupportedVersion", "MissingHeader"]
    assert fleet.workers[0].proc.poll() is None, "the worker died"


async def test_poison_request_retried_then_dead_lettered_in_order(nc: Client, fleet: Fleet) -> None:
    pub, api = await setup_queue(nc)
    fleet.start("w0", "--max-attempts", "4", "--base-delay", "0.1")
    await fleet.wait_ready("w0")
    await pub.enqueue(work("k", "k-poison", fail=True))
    await pub.enqueue(work("k", "k-after"))
    log = await fleet.wait_for(lambda log: "k-after" in ends_by_tag(log), timeout=30, what="k-after")
    starts = [r for r in log if r["kind"] == "start"]
    assert [(r["tag"], r["attempt"]) for r in starts] == [("k-poison", 1), ("k-poison", 2), ("k-poison", 3),
                                                          ("k-poison", 4), ("k-after", 1)]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(starts)]
    assert gaps[0] < gaps[2], f"retry delays did not grow: {gaps}"
    dlq = await api.get_msg("KQ_q_DLQ", seq=1)
    assert dlq is not None and dlq.headers["X-KQ-DLQ-Attempts"] == "4"


async def test_reconciler_schedules_stranded_request(nc: Client, fleet: Fleet) -> None:
    pub, _ = await setup_queue(nc)
    await pub.store(work("orphan", "orphan-0"))  # a producer that died between its two publishes
    fleet.start("w0")
    log = await fleet.wait_for(lambda log: "orphan-0" in ends_by_tag(log), timeout=20, what="the orphan")
    assert ends_by_tag(log)["orphan-0"] == 1
