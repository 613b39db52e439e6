"""What the dashboard follows on a real nats-server besides its snapshots: a key's progress while
its page is open, and a queue's delayed requests with their due times."""

from __future__ import annotations

import asyncio
import datetime as dt

from nats.aio.client import Client

import keyqueue
from keyqueue.dashboard.progress import ProgressFeed
from keyqueue.dashboard.schedules import Delays
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H


async def test_progress_is_followed_from_the_first_render_until_nobody_looks(nc: Client) -> None:
    feed = ProgressFeed(nc, idle=0.0, limit=2)
    assert await feed.watch("shop", "o1") == []
    await nc.publish(QueueNames("shop").progress("o1"), dumps({"step": "packing"}, CBOR),
                     headers={H.CONTENT_TYPE: CBOR, H.REQUEST_ID: "r1"})
    async with asyncio.timeout(10):
        while not (seen := await feed.watch("shop", "o1")):
            await nc.flush()
    assert [(m.request_id, m.text) for m in seen] == [("r1", '{"step": "packing"}')]
    assert await feed.watch("shop", "o.*") is None, "a wildcard is not one key"
    await feed.watch("shop", "o2")
    await feed.watch("shop", "o3")  # the limit: the longest unviewed key (o1) is dropped
    assert not feed.following("shop", "o1") and feed.following("shop", "o3")
    await feed.expire()  # idle=0: nobody looks any more
    assert not feed.following("shop", "o2") and not feed.following("shop", "o3")
    await feed.close()


async def test_delayed_requests_are_listed_with_their_key_and_due_time(nats_url: str) -> None:
    app = keyqueue.App("later", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(queue="remind", key="{user}")
    async def remind(user: str) -> None:
        pass

    try:
        delays = Delays(await app.connection(), max_age=0.0)
        assert (await delays.of("remind")).requests == [], "no schedules stream yet"
        soon = await remind.options(countdown=600).enqueue(user="ada")
        later = await remind.options(countdown=900).enqueue(user="bob")
        found = await delays.of("remind")
        assert [(r.key, r.request_id, r.task) for r in found.requests] == [
            ("ada", soon.request_id, "remind"), ("bob", later.request_id, "remind")]
        assert found.total == 2 and soon.due is not None
        assert abs(found.requests[0].due - soon.due.timestamp()) < 0.001  # type: ignore[operator]
        assert [r.key for r in await delays.of_key("remind", "bob")] == ["bob"]
        assert dt.datetime.fromtimestamp(found.requests[1].due or 0, dt.UTC) > dt.datetime.now(dt.UTC)
    finally:
        await app.close()
