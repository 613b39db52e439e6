"""ADR-42 priority groups on the token consumer, with worker processes (docs/priority-groups.md)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "procs"))
from harness import Fleet, check_exclusive, check_order, ends_by_tag, work


@pytest.fixture
def fleet(nats_url: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(nats_url, "pq", tmp_path / "log.jsonl")
    yield f
    f.stop_all()


async def queue(nc: Client, policy: str, timeout: float = 10.0) -> tuple[Publisher, JetStreamApi]:
    config = QueueConfig("pq", ack_wait=2, priority_policy=policy, priority_timeout=timeout)  # type: ignore[arg-type]
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    return Publisher(nc, config.names), api


async def wait_for_waiting_pulls(nc: Client, stream: str, count: int, timeout: float = 20.0) -> None:
    api = JetStreamApi(nc)
    deadline = asyncio.get_running_loop().time() + timeout
    while (await api.consumer_info(stream, "workers")).get("num_waiting", 0) < count:
        assert asyncio.get_running_loop().time() < deadline, f"fewer than {count} pull requests waiting"
        await asyncio.sleep(0.02)


def acquired_by(log: list[dict], worker: str) -> list[dict]:
    return [r for r in log if r["kind"] == "event" and r["event"] == "acquired" and r["w"] == worker]


async def test_overflow_worker_waits_for_a_deep_backlog(nc: Client, fleet: Fleet) -> None:
    pub, _ = await queue(nc, "overflow")
    fleet.start("primary", "--priority-policy", "overflow", "--concurrency", "4")
    fleet.start("overflow", "--priority-policy", "overflow", "--concurrency", "8", "--min-pending", "50")
    await fleet.wait_ready("primary", "overflow")
    # 30 keys: 4 held, 26 tokens pending, below the overflow worker's threshold of 50.
    await pub.enqueue_many([work(f"a{i}", f"a{i}", sleep=0.2) for i in range(30)])
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) >= 12, timeout=30, what="12 done by the primary")
    assert not acquired_by(log, "overflow"), "the overflow worker took a token below min_pending"
    # 100 more keys push the token backlog well past 50: the overflow worker joins in.
    await pub.enqueue_many([work(f"b{i}", f"b{i}", sleep=0.2) for i in range(100)])
    log = await fleet.wait_for(lambda log: bool(acquired_by(log, "overflow")), timeout=30, what="overflow joins")
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 130, timeout=60, what="all 130")
    by_primary = [r for r in log if r["kind"] == "end" and r["w"] == "primary"]
    assert len(by_primary) > 30, "the primary stopped working while the overflow worker helped"
    check_exclusive(log)


async def test_pinned_client_takes_every_key_and_fails_over(nc: Client, fleet: Fleet) -> None:
    pub, api = await queue(nc, "pinned_client", timeout=2.0)
    args = ("--priority-policy", "pinned_client", "--priority-timeout", "2", "--pull-expires", "1")
    names = ("w0", "w1", "w2")
    for n in names:
        fleet.start(n, *args)
    await fleet.wait_ready(*names)
    keys = [f"k{i}" for i in range(10)]
    await pub.enqueue_many([work(k, f"{k}-0", sleep=0.05) for k in keys])
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 10, timeout=30, what="first round")
    holders = {r["w"] for r in log if r["kind"] == "end"}
    assert len(holders) == 1, f"more than the pinned worker took keys: {holders}"
    pinned = holders.pop()
    pinned_events = [r for r in log if r["kind"] == "event" and r["event"] == "pinned"]
    assert [r["w"] for r in pinned_events] == [pinned]

    # kill -9 the pinned worker mid-work: a standby becomes pinned and finishes every key.
    expected = {k: [f"{k}-0", f"{k}-1", f"{k}-2"] for k in keys}
    await pub.enqueue_many([work(k, f"{k}-1", sleep=0.3) for k in keys])
    await fleet.wait_for(lambda log: any(r["kind"] == "start" and r["tag"].endswith("-1") for r in log))
    next(w for w in fleet.workers if w.name == pinned).kill()
    await pub.enqueue_many([work(k, f"{k}-2") for k in keys])
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 30, timeout=60, what="every key after failover")
    check_order(log, expected)
    after = [r for r in log if r["kind"] == "event" and r["event"] == "pinned" and r["w"] != pinned]
    assert len(after) == 1, f"expected one new pinned worker, got {[r['w'] for r in after]}"
    new_pinned = after[0]["w"]
    late = {r["w"] for r in log if r["kind"] == "end" and r["tag"].endswith("-2")}
    assert late == {new_pinned}

    # unpin: the server drops the pin at once. Measured on nats-server 2.15: tokens may still
    # reach pull requests that were already waiting, unpinned, until those expire; a later
    # delivery pins a client afresh with a new Nats-Pin-Id.
    def pin_of(info: dict) -> str | None:
        return next((g.get("pinned_client_id") for g in info.get("priority_groups") or []), None)

    before = pin_of(await api.consumer_info("KQ_pq_TOKENS", "workers"))
    assert before is not None
    await api.unpin("KQ_pq_TOKENS", "workers", "workers")
    assert pin_of(await api.consumer_info("KQ_pq_TOKENS", "workers")) is None
    done = 30
    for round_ in range(3, 13):
        await pub.enqueue_many([work(k, f"{k}-{round_}") for k in keys])
        done += len(keys)
        log = await fleet.wait_for(lambda log, n=done: len(ends_by_tag(log)) == n, timeout=30, what="a round")
        repinned = [r for r in log if r["kind"] == "event" and r["event"] == "pinned" and r["pin_id"] != before
                    and r["w"] != pinned and r["t"] > after[0]["t"]]
        if repinned:
            break
        await asyncio.sleep(0.5)  # let the waiting pull requests (1 s expiry) be renewed
    assert repinned, "no client was pinned afresh after unpin"
    assert pin_of(await api.consumer_info("KQ_pq_TOKENS", "workers")) == repinned[-1]["pin_id"]
    check_exclusive(log)


async def test_prioritized_lower_number_served_first(nc: Client, fleet: Fleet) -> None:
    pub, _ = await queue(nc, "prioritized")
    fleet.start("p5", "--priority-policy", "prioritized", "--priority", "5", "--concurrency", "64")
    fleet.start("p0", "--priority-policy", "prioritized", "--priority", "0", "--concurrency", "64")
    await fleet.wait_ready("p0", "p5")
    # "ready" means pulling has begun; wait until the server holds all of both workers' pulls.
    await wait_for_waiting_pulls(nc, "KQ_pq_TOKENS", 16)  # 8 chunks of 8 slots each
    await pub.enqueue_many([work(f"k{i}", f"k{i}", sleep=0.05) for i in range(40)])
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 40, timeout=30, what="all 40")
    assert {r["w"] for r in log if r["kind"] == "end"} == {"p0"}


@pytest.mark.parametrize("policy", ["overflow", "pinned_client", "prioritized"])
async def test_exclusivity_and_order_hold_under_each_policy(nc: Client, fleet: Fleet, policy: str) -> None:
    import random

    pub, _ = await queue(nc, policy, timeout=2.0)
    extra = {"overflow": ["--min-pending", "20"], "prioritized": ["--priority", "3"], "pinned_client": []}[policy]
    fleet.start("a", "--priority-policy", policy, "--priority-timeout", "2", "--concurrency", "8")
    fleet.start("b", "--priority-policy", policy, "--priority-timeout", "2", "--concurrency", "8", *extra)
    await fleet.wait_ready("a", "b")
    rng = random.Random(3)
    keys = [f"k{i}" for i in range(50)]
    expected = {k: [f"{k}-{j}" for j in range(10)] for k in keys}
    await pub.enqueue_many([work(k, f"{k}-{j}", sleep=rng.choice([0, 0.002])) for j in range(10) for k in keys])
    log = await fleet.wait_for(lambda log: len(ends_by_tag(log)) == 500, timeout=60, what="all 500")
    assert set(ends_by_tag(log).values()) == {1}
    check_exclusive(log)
    check_order(log, expected)


async def test_a_worker_of_another_policy_is_refused_and_a_producer_is_not(nc: Client) -> None:
    from keyqueue.errors import TopologyMismatch

    await queue(nc, "overflow")
    pinned = Topology(JetStreamApi(nc), QueueConfig("pq", priority_policy="pinned_client"))
    await pinned.ensure()  # a producer never checks the consumer's settings
    with pytest.raises(TopologyMismatch) as caught:
        await pinned.ensure_worker()
    assert caught.value.field == "priority_policy"
    assert str(caught.value).startswith("consumer KQ_pq_TOKENS/workers: priority_policy is 'overflow' on the "
                                        "server, 'pinned_client' here; ")
    assert "`keyqueue recreate-consumer pq --app MODULE:APP`" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_cli_unpin_recreate_consumer_and_worker_flags(nats_url: str, tmp_path: Path) -> None:
    import subprocess

    def kq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "keyqueue.cli", *args, "--url", nats_url],
                              capture_output=True, text=True, timeout=60)

    async def make(policy: str) -> None:
        client = await connect(nats_url)
        try:
            await queue(client, policy)
        finally:
            await client.close()

    asyncio.run(make("none"))
    refused = kq("unpin", "pq")
    assert refused.returncode != 0 and "not a pinned_client queue" in refused.stderr
    assert "Traceback" not in refused.stderr

    app_file = tmp_path / "pinned_app.py"
    app_file.write_text(
        "import keyqueue\n"
        "app = keyqueue.App('pinned-app')\n"
        "app.configure_queue(keyqueue.QueueConfig('pq', ack_wait=2, priority_policy='pinned_client'))\n"
    )
    env_path = f"{tmp_path}"
    done = subprocess.run([sys.executable, "-m", "keyqueue.cli", "recreate-consumer", "pq", "--app",
                           "pinned_app:app", "--yes", "--url", nats_url], capture_output=True, text=True,
                          timeout=60, cwd=env_path)
    assert done.returncode == 0, done.stderr
    assert "pinned_client" in done.stdout
    unpinned = kq("unpin", "pq")
    assert unpinned.returncode == 0, unpinned.stderr
    shown = kq("inspect", "pq")
    assert "priority=pinned_client" in shown.stdout


async def test_worker_priority_options_need_a_policy(nats_url: str) -> None:
    import keyqueue
    from keyqueue.errors import ConfigError

    app = keyqueue.App("plain", url=nats_url, set_as_default=False)

    @app.task(key="{k}")
    async def noop(k: str) -> None:
        return None

    with pytest.raises(ConfigError, match="priority policy"):
        async with app.worker(overflow_min_pending=5):
            pass
    with pytest.raises(ConfigError, match="0-9"):
        app.worker(priority=12)
    await app.close()


@pytest.mark.parametrize(("policy", "option", "value"), [("pinned_client", "priority", 1),
                                                         ("pinned_client", "overflow_min_pending", 5),
                                                         ("overflow", "priority", 1),
                                                         ("prioritized", "overflow_min_ack_pending", 5)])
async def test_an_option_the_queues_policy_ignores_is_refused(nats_url: str, policy: str, option: str,
                                                              value: int) -> None:
    import keyqueue
    from keyqueue.errors import ConfigError

    app = keyqueue.App("policed", url=nats_url, set_as_default=False)
    app.configure_queue(keyqueue.QueueConfig("policed", priority_policy=policy))

    @app.task(queue="policed", key="{k}")
    async def noop(k: str) -> None:
        return None

    with pytest.raises(ConfigError, match=f"priority policy {policy}, which takes no"):
        async with app.worker(**{option: value}):
            pass
    await app.close()
