"""keyqueue's connection while it is up: no limit on what is published, and nats-py's reports logged."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg


async def test_publishing_more_than_nats_pys_default_buffer_at_once_works(nc: Client, nats_client: Client) -> None:
    # pending_size=0 only refuses publishes while disconnected; connected, nothing is limited.
    sub = await nats_client.subscribe("load.>")
    await nats_client.flush()
    chunk = b"y" * 64 * 1024
    for i in range(100):  # 6.4 MB without waiting: more than the 2 MB nats-py buffers by default
        await nc.publish(f"load.{i}", chunk)
    await nc.flush()
    received = [await sub.next_msg(timeout=10) for _ in range(100)]
    assert [m.subject for m in received] == [f"load.{i}" for i in range(100)]
    assert all(m.data == chunk for m in received)


async def test_an_exception_in_a_subscription_callback_is_logged_once_per_interval(
        nc: Client, caplog: pytest.LogCaptureFixture) -> None:
    done = asyncio.Event()

    async def broken(msg: Msg) -> None:
        if msg.data == b"done":
            done.set()  # nats-py runs one subscription's callbacks in turn: the others are reported
            return
        raise ValueError(f"broken callback {msg.data.decode()}")

    await nc.subscribe("cb", cb=broken)
    with caplog.at_level(logging.DEBUG, logger="keyqueue.connection"):
        for body in (b"1", b"2", b"3", b"done"):
            await nc.publish("cb", body)
        await asyncio.wait_for(done.wait(), 10)
    reported = [r for r in caplog.records if r.name == "keyqueue.connection" and "ValueError" in r.getMessage()]
    assert len(reported) == 1, [r.getMessage() for r in reported]
    assert reported[0].levelno == logging.WARNING
    assert "broken callback 1" in reported[0].getMessage()
    assert reported[0].exc_info is not None  # raised by a callback: where it was raised is shown
