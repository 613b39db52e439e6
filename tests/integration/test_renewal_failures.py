"""Why a lease was lost is said where a user looks (the lease-lost warning), against a real nats-server."""

from __future__ import annotations

import asyncio
import logging

import pytest
from queue_workers import running

from keyqueue.core.observer import Outcome
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H


class Hold(BaseProcessor):
    def __init__(self, arrived: asyncio.Event) -> None:
        self.arrived = arrived

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.arrived.set()
        await asyncio.sleep(300)
        return None


async def test_a_lease_lost_to_failed_renewals_is_logged_with_why_they_failed(
    nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connect(nats_server.url)
    config = QueueConfig("renewals", ack_wait=3)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    arrived = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Hold(arrived), concurrency=2,
                         settings=SessionSettings(ack_wait=3, linger=0.05))
    caplog.set_level(logging.INFO, "keyqueue")
    try:
        async with running(worker):
            await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: "r1"}, b"", "r1"))
            await arrived.wait()
            session = worker.sessions["k"]
            # The lease records' stream is gone: every renewal gets "no responders" until the lease ends.
            await api.delete_stream(config.names.lease_stream)
            assert await session == Outcome.LEASE_LOST
    finally:
        await nc.close()
    [lost] = [r for r in caplog.records if "lease lost" in r.getMessage()]
    assert lost.levelno == logging.WARNING
    assert "the last renewal failed: ConnectionFailed" in lost.getMessage(), lost.getMessage()
