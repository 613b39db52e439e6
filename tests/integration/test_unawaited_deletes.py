"""A lease record's delete that nobody waits for is still carried out when nats-server drops it.

nats-server drops every JetStream API request waiting in its queue, answering none, once
``request_queue_limit`` of them wait (10,000 by default; 100 here, so that a burst of one
worker's deletes reaches it). A key given back on one server removes its record with such a
delete (``QueueIO.forget_record``); a lost one would hold the key until the record's TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.fastpub import publish_plain
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer

RECORDS = 3000


@pytest.fixture
async def small_api_queue(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    server = EmbeddedServer(store_dir=tmp_path / "store", log_file=tmp_path / "nats-server.log",
                            request_queue_limit=100)
    async with server:
        yield server


async def records_left(nc: Client, config: QueueConfig) -> int:
    info = await JetStreamApi(nc).stream_info(config.names.lease_stream)
    return int(info["state"]["messages"])


async def written_records(io: QueueIO, config: QueueConfig) -> list[int]:
    return list(await asyncio.gather(*(io.compare_and_set(config.names.lease(f"k{i}"), 0, b"{}", 60)
                                       for i in range(RECORDS))))


async def test_the_server_drops_unanswered_deletes_once_its_api_queue_is_full(
        small_api_queue: EmbeddedServer) -> None:
    """The fact: a burst of deletes with no reply subject loses some of them, silently."""
    nc = await connect(small_api_queue.url)
    try:
        config = QueueConfig("dropped", ack_wait=30)
        await Topology(JetStreamApi(nc), config).ensure()
        io = QueueIO(nc, config)
        subject = f"$JS.API.STREAM.MSG.DELETE.{config.names.lease_stream}"
        for seq in await written_records(io, config):
            await publish_plain(nc, subject, b'{"seq":%d,"no_erase":true}' % seq)
        await nc.flush()
        await JetStreamApi(nc).stream_info(config.names.lease_stream)  # answered after the burst
        async with asyncio.timeout(10):  # the queue drains; what is left then was dropped
            left = await records_left(nc, config)
            while (now := await records_left(nc, config)) != left:
                left = now
                await asyncio.sleep(0.2)
        assert left > 0, "every unanswered delete was carried out: the server kept a full API queue"
        assert "limit reached" in small_api_queue.log_file.read_text()
    finally:
        await nc.close()


async def test_a_worker_sends_again_the_deletes_the_server_dropped(small_api_queue: EmbeddedServer) -> None:
    """The same burst through ``QueueIO.forget_record``: every record is removed, some of them by
    a delete sent again because its answer did not come."""
    nc = await connect(small_api_queue.url)
    try:
        config = QueueConfig("resent", ack_wait=30)
        await Topology(JetStreamApi(nc), config).ensure()
        io = QueueIO(nc, config)
        assert io.unanswered_removals
        seqs = await written_records(io, config)
        for seq in seqs:
            await io.forget_record(seq, 60)
        async with asyncio.timeout(30):  # far inside the records' 60 s TTL
            while io.forgotten.waiting:  # noqa: ASYNC110 - answers are counted, not signalled
                await asyncio.sleep(0.05)
        assert await records_left(nc, config) == 0
        assert io.forgotten.sent_again > 0, "no delete was lost: the API queue never filled"
        assert "limit reached" in small_api_queue.log_file.read_text()

        # A delete of a record already gone is answered "no message found": done, not sent again.
        again = io.forgotten.sent_again
        await io.forget_record(seqs[0], 60)
        async with asyncio.timeout(5):
            while io.forgotten.waiting:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert io.forgotten.sent_again == again
    finally:
        await io.forgotten.close()
        await nc.close()
