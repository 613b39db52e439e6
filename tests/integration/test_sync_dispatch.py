"""keyqueue's reply subscriptions take each message straight from nats-py's read loop
(:class:`keyqueue.jetstream.mux.SyncDispatch`), relying on nats-py internals: this pins them, so a
nats-py upgrade that changes them fails here, not in production."""

from __future__ import annotations

import asyncio
import inspect

import nats.aio.client
import nats.aio.subscription
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.jetstream.mux import RequestMux, SyncDispatch


def test_the_nats_py_internals_it_relies_on_are_there() -> None:
    process = inspect.getsource(nats.aio.client.Client._process_msg)
    assert "sub._pending_size += payload_size" in process
    assert "sub._pending_queue.put_nowait(msg)" in process
    waits = inspect.getsource(nats.aio.subscription.Subscription._wait_for_msgs)
    assert "await self._pending_queue.get()" in waits


async def test_messages_are_handled_in_order_at_once_and_nothing_stays_pending(nc: Client) -> None:
    seen: list[bytes] = []
    called_back: list[Msg] = []

    async def callback(msg: Msg) -> None:
        called_back.append(msg)

    sub = await nc.subscribe("dispatch.>", cb=callback)
    SyncDispatch.install(sub, lambda msg: seen.append(msg.data))
    for n in range(1000):
        await nc.publish(f"dispatch.{n % 7}", b"%d" % n)
    await nc.flush()
    async with asyncio.timeout(10):
        while len(seen) < 1000:  # noqa: ASYNC110 (the messages arrive from the socket)
            await asyncio.sleep(0.01)
    assert seen == [b"%d" % n for n in range(1000)]
    assert called_back == []
    assert sub.pending_msgs == 0 and sub.pending_bytes == 0
    await sub.unsubscribe()


async def test_a_handler_that_raises_does_not_end_the_connection(nc: Client) -> None:
    seen: list[bytes] = []

    def handle(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("a bug")
        seen.append(msg.data)

    async def callback(msg: Msg) -> None: ...

    sub = await nc.subscribe("fragile", cb=callback)
    SyncDispatch.install(sub, handle)
    await nc.publish("fragile", b"bad")
    await nc.publish("fragile", b"good")
    await nc.flush()
    async with asyncio.timeout(10):
        while not seen:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert seen == [b"good"] and nc.is_connected


async def test_the_request_mux_answers_through_it(nc: Client) -> None:
    mux = RequestMux(nc)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("echo", cb=echo)
    replies = await asyncio.gather(*(mux.request("echo", b"%d" % n, timeout=5) for n in range(100)))
    assert [r[0].data for r in replies] == [b"%d" % n for n in range(100)]
    assert isinstance(mux._sub._pending_queue, SyncDispatch)
    await mux.close()
