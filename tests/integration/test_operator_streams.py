"""What the operator's view (the dashboard) reads and stores on a real nats-server: batched reads of a stream,
every key of a queue, a key's stored history, the search index, history minutes and the audit log."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client

import keyqueue
from keyqueue.admin.inspection import KEY_LIMIT, inspect_queue
from keyqueue.admin.key_history import key_events, latest_events, runs_of
from keyqueue.dashboard.audit import AuditLog, entry
from keyqueue.dashboard.history import MINUTE, History, Minute, stats_stream
from keyqueue.dashboard.search import RequestFilter, SearchIndex
from keyqueue.events import ensure_events_stream, event, events_subject
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H


@pytest.fixture
async def shop(nats_url: str) -> AsyncIterator[tuple[keyqueue.App, Any, Any]]:
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{k}")
    async def touch(k: str, note: str = "") -> None:
        pass

    @app.task(key="{k}", max_attempts=1)
    async def fail(k: str, amount: int) -> None:
        raise ValueError(f"declined {amount}")

    try:
        yield app, touch, fail
    finally:
        await app.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_pages_read_the_same_messages_with_or_without_direct_gets(nc: Client, direct: bool) -> None:
    api = JetStreamApi(nc)
    await api.add_stream({"name": "PAGES", "subjects": ["p.>"], "allow_direct": direct, "storage": "memory"})
    for i in range(25):
        await api.publish(f"p.{'a' if i % 2 else 'b'}", str(i).encode())
    await api.delete_msg("PAGES", 4)
    every = [m.seq async for page in api.pages("PAGES", batch=10) for m in page]
    assert every == [s for s in range(1, 26) if s != 4]
    only_a = [m.data async for page in api.pages("PAGES", "p.a", seq=10, limit=3, batch=2) for m in page]
    assert only_a == [b"9", b"11", b"13"]
    from_now = [m async for page in api.pages("PAGES", start_time="2100-01-01T00:00:00Z") for m in page]
    since_2000 = [m async for page in api.pages("PAGES", start_time="2000-01-01T00:00:00Z") for m in page]
    assert from_now == [] and since_2000[0].seq == 1


async def test_every_key_is_listed_and_counts_come_cheaply(shop: Any, nats_url: str) -> None:
    app, touch, _ = shop
    await touch.enqueue_many([{"k": f"k{i}"} for i in range(KEY_LIMIT + 200)])
    api = JetStreamApi(await app.connection())
    limited = await inspect_queue(api, "shop")
    assert (len(limited.keys), limited.keys_total, limited.truncated) == (KEY_LIMIT, KEY_LIMIT + 200, True)
    every = await inspect_queue(api, "shop", every_key=True)
    assert len(every.keys) == KEY_LIMIT + 200 and not every.truncated
    assert {k.condition for k in every.keys} == {"waiting"}, "a token and a request each, no worker"
    assert every.inbox_last_seq == KEY_LIMIT + 200 and every.oldest_request is not None
    counts = await inspect_queue(api, "shop", keys=False)
    assert (counts.keys, counts.requests, counts.keys_with_backlog) == ([], KEY_LIMIT + 200, KEY_LIMIT + 200)


async def test_a_keys_history_is_read_from_its_own_subjects(shop: Any) -> None:
    app, touch, fail = shop
    async with app.worker(name="w-hist"):
        for _ in range(3):
            await touch.call(k="a", timeout=10)
        with pytest.raises(keyqueue.DeadLettered):
            await fail.call(k="b", amount=7, timeout=10)
        api = JetStreamApi(await app.connection())
        async with asyncio.timeout(15):
            while "released" not in await latest_events(api, "shop", "b"):
                await (await app.connection()).flush()
    latest = await latest_events(api, "shop", "a")
    assert {"enqueued", "acquired", "started", "succeeded"} <= set(latest) and latest["acquired"].fence
    events = await key_events(api, "shop", "a", limit=5)
    # Events of one batch share its message's sequence: in stream order, never backwards.
    assert len(events) == 5 and all(e.seq <= f.seq for e, f in itertools.pairwise(events))
    runs = runs_of(await key_events(api, "shop", "a"))
    assert [r.outcome for r in runs] == ["succeeded"] * 3 and {r.worker for r in runs} == {"w-hist"}
    assert all(r.fence for r in runs)
    [dead] = runs_of(await key_events(api, "shop", "b"))
    assert (dead.outcome, dead.reason) == ("dead_lettered", "max-attempts")
    assert await key_events(api, "nosuch", "a") == []


async def test_the_search_index_follows_the_inbox_and_dlq_and_drops_what_left(shop: Any) -> None:
    app, touch, fail = shop
    receipts = [await touch.enqueue(k="s1", note=f"parcel {i}") for i in range(3)]
    nc = await app.connection()
    api = JetStreamApi(nc)
    index = SearchIndex(nc, read_per_refresh=2)
    await index.follow("shop")
    assert not index.search("shop", RequestFilter()).complete, "two read of three: still building"
    await index.follow("shop")
    found = index.search("shop", RequestFilter(text="parcel 2"))
    assert found.complete and [e.request_id for e in found.entries] == [receipts[2].request_id]
    await api.delete_msg("KQ_shop_INBOX", receipts[0].seq)
    everything = index.search("shop", RequestFilter(key="s1")).entries
    assert [e.seq for e in await index.verify("shop", everything)] == [receipts[1].seq, receipts[2].seq]
    async with app.worker(name="w-idx"):
        with pytest.raises(keyqueue.DeadLettered):
            await fail.call(k="d1", amount=4242, timeout=10)
    await index.follow("shop")
    dead = index.search("shop", RequestFilter(text="4242", where="dead")).entries
    assert [(e.key, e.task, e.error) for e in dead] == [("d1", "fail", "ValueError: declined 4242")]
    await api.purge("KQ_shop_DLQ")
    await index.follow("shop")  # fewer dead requests than indexed: the DLQ's index is read again
    assert index.search("shop", RequestFilter(where="dead")).total == 0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_history_minutes_are_written_once_and_backfilled_from_stored_events(nc: Client) -> None:
    api = JetStreamApi(nc)
    await api.add_stream({"name": "KQ_shop_INBOX", "subjects": ["kq.shop.in.>"]})
    await ensure_events_stream(nc, "shop")
    start = (int(time.time()) // MINUTE - 3) * MINUTE  # three minutes ago, on a minute's start
    for offset, name, fields in ((5, "started", {"wait": 0.2}), (6, "succeeded", {"run": 0.1}),
                                 (65, "succeeded", {"run": 0.3})):
        body = event(name, start + offset, "shop", key="k", **fields)
        await api.publish(events_subject("shop", name, "k"), dumps(body, CBOR), {H.CONTENT_TYPE: CBOR})
    clock = Clock(start + 2 * MINUTE + 30)  # the dashboard started in the third minute
    history = History(nc, clock=clock, backfill=600)
    history.add("shop", "succeeded", {"ts": clock.now + 40, "run": 0.5})  # the next minute: counted live
    history.add("shop", "succeeded", {"ts": clock.now, "run": 0.5})  # its first minute: left to the backfill
    clock.now += MINUTE + 40  # both minutes closed
    await history.flush(["shop"])
    stored: dict[int, Minute] = {}
    async for page in api.pages(stats_stream("shop")):
        for msg in page:
            if (minute := Minute.decode(msg.data)) is not None:
                stored[minute.minute] = minute
    first = start // MINUTE
    assert stored[first].counts == {"started": 1, "succeeded": 1} and stored[first + 1].counts == {"succeeded": 1}
    assert stored[first + 3].counts == {"succeeded": 1}, "the live minute"
    points = await history.points("shop", hours=1, step=1)
    assert sum(p.done for p in points) == 3 and sum(p.stored_done for p in points) == 3
    again = History(nc, clock=Clock(start), backfill=600)
    assert not await again._write("shop", Minute(first)), "a minute is written once: the first writer wins"


async def test_the_audit_log_keeps_every_action_newest_first(nc: Client) -> None:
    audit = AuditLog(nc)
    await audit.record(entry("shop", "ops", "operator", "replay", "key o1", 3, "done", "replayed 3 request(s)"))
    await audit.record(entry("other", "eve", "viewer", "delete", "seq 4", 0, "refused", "viewer"))
    found = await audit.recent(["shop", "other", "none"])
    assert [(e.queue, e.who, e.action, e.count, e.outcome) for e in found] == [
        ("other", "eve", "delete", 0, "refused"), ("shop", "ops", "replay", 3, "done")]
    info = await JetStreamApi(nc).stream_info("KQ_shop_AUDIT")
    assert info["config"]["max_age"] == 90 * 24 * 3600 * 10**9
