"""A stream whose ingest queue is full refuses a publish with 429 (10167): nothing is stored, and
keyqueue tries it again as it does while JetStream is unavailable for a moment.

nats-server queues every message bound for a stream before it stores it; past ``max_buffered_msgs``
(100,000 by default; 10 here) it drops the message and answers a publish that has a reply subject
with ``429 Too Many Requests``, err_code 10167 (``stream.go``, ``queueInbound``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import JetStreamUnavailable
from keyqueue.jetstream import publish
from keyqueue.jetstream.api import JetStreamApi, parse_pub_ack
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H


@pytest.fixture
async def small_ingest_queue(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    server = EmbeddedServer(store_dir=tmp_path / "store", log_file=tmp_path / "nats-server.log",
                            max_buffered_msgs=10)
    async with server:
        yield server


async def flood(nc: Client, subject: str, count: int) -> None:
    """Messages with no reply subject, as fast as the connection takes them."""
    for _ in range(count):
        await nc.publish(subject, b"x" * 64)
    await nc.flush()


async def test_a_full_ingest_queue_refuses_with_10167_read_as_unavailable(small_ingest_queue: EmbeddedServer) -> None:
    nc = await connect(small_ingest_queue.url)
    try:
        config = QueueConfig("full", ack_wait=30)
        await Topology(JetStreamApi(nc), config).ensure()
        mux = RequestMux(nc)
        sent = [await mux.send(config.names.inbox(f"k{i}"), b"x" * 64) for i in range(3000)]
        replies = [(await wait(future, 30, "a publish"))[0] for future in sent]
        refused: list[Msg] = []
        for reply in replies:
            try:
                parse_pub_ack(reply)
            except JetStreamUnavailable as e:
                assert e.err_code == 10167 and reply.headers is not None and reply.headers.get("Status") == "429"
                refused.append(reply)
        assert refused, "no publish was refused: the stream's ingest queue never filled"
        await mux.close()
    finally:
        await nc.close()


async def test_an_enqueue_refused_by_a_full_stream_is_tried_again(small_ingest_queue: EmbeddedServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Another connection floods the same inbox stream; the enqueue is refused, pauses, and is
    stored (before: it failed with a bare ``JetStreamError``)."""
    flooding, nc = await connect(small_ingest_queue.url), await connect(small_ingest_queue.url)
    refusals: list[bytes] = []
    real_unavailable = publish._unavailable

    def unavailable(reply: Msg) -> bool:
        if b'"err_code":10167' in reply.data:
            refusals.append(reply.data)
        return real_unavailable(reply)

    monkeypatch.setattr(publish, "_unavailable", unavailable)
    try:
        config = QueueConfig("retried", ack_wait=30)
        await Topology(JetStreamApi(nc), config).ensure()
        producer = Publisher(nc, config.names, outage_wait=30)
        for attempt in range(5):  # until one enqueue meets the full queue (the first, in practice)
            flooded = asyncio.create_task(flood(flooding, config.names.inbox("noise"), 20_000))
            await asyncio.sleep(0)  # the flood's first messages go out first
            enqueued = await producer.enqueue(OutgoingRequest("k", {H.MSG_ID: f"r{attempt}"}, b"", f"r{attempt}"))
            await flooded
            assert enqueued.seq > 0 and not enqueued.duplicate
            if refusals:
                break
        assert refusals, "no enqueue met a full ingest queue"
        stored = await JetStreamApi(nc).get_msg(config.names.inbox_stream, last_by_subject=config.names.inbox("k"))
        assert stored is not None and stored.seq == enqueued.seq
    finally:
        await flooding.close()
        await nc.close()
