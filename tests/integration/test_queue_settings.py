"""Who owns each setting of a queue (docs/decisions.md, "Who owns each setting"), against a real server.

Producers never fail on the consumer's settings; the lease is the queue's, kept on the server:
a worker given one sets it in place, a worker without one follows the server's; the per-key
backlog cap is the server's; a layout that differs is one line naming the fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import keyqueue
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import NS, QueueConfig, Topology

NAMES = QueueNames("shop")

MakeApp = Callable[..., keyqueue.App]
ShopTask = Any
"""The ``lease_ttl`` task of an app made by :func:`shop`."""


@pytest.fixture
async def make_app(nats_url: str) -> AsyncIterator[MakeApp]:
    apps: list[keyqueue.App] = []

    def make(**options: Any) -> keyqueue.App:
        app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False, **options)
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.close()


def shop(app: keyqueue.App) -> ShopTask:
    """Queue ``shop`` with one task that answers with the TTL of the lease record its run holds."""

    @app.task(queue="shop", key="{order_id}")
    async def lease_ttl(order_id: str) -> int:
        api = JetStreamApi(await app.connection())
        record = await api.get_msg(NAMES.lease_stream, last_by_subject=NAMES.lease(order_id))
        assert record is not None
        ttl: int = json.loads(record.data)["ttl"]
        return ttl

    return lease_ttl


async def consumer(app: keyqueue.App) -> dict[str, Any]:
    config: dict[str, Any] = (await JetStreamApi(await app.connection()).consumer_info(
        NAMES.token_stream, NAMES.consumer))["config"]
    return config


async def test_a_worker_given_a_lease_sets_it_on_a_queue_a_producer_created(make_app: MakeApp,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    producer = make_app()
    produced = shop(producer)
    await produced.enqueue(order_id="o1")  # creates the queue with the default lease, 30 s
    assert (await consumer(producer))["ack_wait"] == 30 * NS

    serving = make_app()
    shop(serving)
    with caplog.at_level(logging.INFO, logger="keyqueue.worker"):
        async with serving.worker(ack_wait=5) as worker:
            assert (await consumer(producer))["ack_wait"] == 5 * NS
            assert worker.queue_workers["shop"].settings.ack_wait == 5
            # A producer afterwards (a new one, which ensures the queue again) never checks the lease.
            assert await shop(make_app()).call(order_id="o2", timeout=10) == 5
            assert await produced.call(order_id="o3", timeout=10) == 5
    changed = [(r.levelno, r.getMessage()) for r in caplog.records if "lease changed" in r.getMessage()]
    assert changed == [(logging.WARNING, "queue shop: the lease changed on the server, ack_wait 30s → 5s; workers "
                                         "already running keep theirs until they restart")]


async def test_a_worker_without_a_lease_follows_the_servers(make_app: MakeApp, nats_url: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()
    lease_ttl = shop(app)
    await lease_ttl.enqueue(order_id="o1")
    topology = Topology(JetStreamApi(await app.connection()), QueueConfig("shop"))
    assert [str(c) for c in await topology.configure(ack_wait=5)] == ["ack_wait 30s → 5s"]

    with caplog.at_level(logging.INFO, logger="keyqueue.worker"):
        async with app.worker() as worker:  # the app's QueueConfig says 30 s: the server's 5 s wins
            assert worker.queue_workers["shop"].settings.ack_wait == 5
            assert await lease_ttl.call(order_id="o2", timeout=10) == 5  # the key's lease record lives 5 s
    assert (await consumer(app))["ack_wait"] == 5 * NS  # followed, not changed
    assert "queue shop: lease (ack_wait) 5s, the queue's on the server (`keyqueue configure shop --ack-wait " \
           "SECONDS` changes it)" in caplog.messages


async def test_a_new_lease_on_a_live_fleet_leaves_running_workers_theirs(make_app: MakeApp) -> None:
    first_app, second_app = make_app(), make_app()
    lease_ttl = shop(first_app)
    shop(second_app)
    async with first_app.worker() as first:
        assert first.queue_workers["shop"].settings.ack_wait == 30
        async with second_app.worker(ack_wait=5) as second:
            assert (await consumer(first_app))["ack_wait"] == 5 * NS
            assert (first.queue_workers["shop"].settings.ack_wait, second.queue_workers["shop"].settings.ack_wait) \
                == (30, 5)
            # Each key's record lives for the lease of the worker that holds it: 30 s or 5 s.
            ttls = {await lease_ttl.call(order_id=f"k{i}", timeout=10) for i in range(40)}
            assert ttls <= {30, 5} and ttls


async def test_producers_never_fail_on_the_consumers_settings(make_app: MakeApp, nats_client: Any) -> None:
    # A consumer whose every setting differs from a default producer's QueueConfig.
    custom = QueueConfig("shop", ack_wait=5, max_ack_pending=7, priority_policy="pinned_client", priority_timeout=3)
    await Topology(JetStreamApi(nats_client), custom).ensure()
    producer = make_app()
    receipt = await shop(producer).enqueue(order_id="o1")
    assert receipt.seq == 1
    on_server = await consumer(producer)
    assert (on_server["ack_wait"], on_server["max_ack_pending"], on_server["priority_policy"]) == (
        5 * NS, 7, "pinned_client")


async def test_the_backlog_cap_is_the_servers(make_app: MakeApp) -> None:
    producer = make_app()
    lease_ttl = shop(producer)
    await lease_ttl.enqueue(order_id="o1")
    topology = Topology(JetStreamApi(await producer.connection()), QueueConfig("shop"))
    assert [str(c) for c in await topology.configure(max_backlog_per_key=2)] == [
        "max_backlog_per_key unlimited → 2"]
    # A producer whose QueueConfig says otherwise follows the server's cap instead of failing.
    other = make_app()
    other.configure_queue(QueueConfig("shop", max_backlog_per_key=10))
    capped = shop(other)
    await capped.enqueue(order_id="o1")
    with pytest.raises(keyqueue.BacklogFull):
        await capped.enqueue(order_id="o1")
    assert (await capped.enqueue(order_id="o2")).seq == 3


async def test_a_layout_that_differs_is_one_line_naming_the_fix(make_app: MakeApp, nats_client: Any) -> None:
    await JetStreamApi(nats_client).add_stream({"name": NAMES.inbox_stream, "subjects": [NAMES.inbox_prefix + ">"],
                                                "retention": "workqueue"})
    app = make_app()
    lease_ttl = shop(app)
    line = ("stream KQ_shop_INBOX: retention is 'workqueue' on the server, 'limits' here; that is keyqueue's "
            "layout, not a setting, so keyqueue did not make this stream: with nothing using the queue, delete it "
            "(`nats stream rm KQ_shop_INBOX`, which deletes its messages) and keyqueue creates it again "
            '(docs/decisions.md, "Who owns each setting")')
    with pytest.raises(keyqueue.TopologyMismatch) as refused:
        async with app.worker():
            pass
    assert str(refused.value) == line
    with pytest.raises(keyqueue.TopologyMismatch) as refused:
        await lease_ttl.enqueue(order_id="o1")
    assert str(refused.value) == line


async def test_a_replicas_difference_names_the_replicas(make_app: MakeApp, nats_client: Any) -> None:
    await Topology(JetStreamApi(nats_client), QueueConfig("shop")).ensure()
    app = make_app()
    app.configure_queue(QueueConfig("shop", replicas=3))
    with pytest.raises(keyqueue.TopologyMismatch, match=r"^stream KQ_shop_INBOX: allow_direct is True on the "
                       r"server, False here; direct gets follow the queue's replicas: the stream has 1, this "
                       r"process's QueueConfig has replicas=3; configure the queue with replicas=1 "):
        await shop(app).enqueue(order_id="o1")
