"""A queue worker's helper tasks (the reconciler, the re-checks of keys whose release was cut short,
the probe of waiting tokens) share a task group with its key sessions: an error one of them did
not expect must end neither the worker nor a session, on a real nats-server."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from queue_workers import running

from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H


class Gate(BaseProcessor):
    """Each request waits for ``go`` once it has arrived, then is done."""

    def __init__(self, arrived: asyncio.Event, go: asyncio.Event, done: list[bytes]) -> None:
        self.arrived, self.go, self.done = arrived, go, done

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.arrived.set()
        await self.go.wait()
        self.done.append(request.data)
        return None


@pytest.mark.parametrize("helper", ["reconciler", "rechecks"])
async def test_an_unexpected_error_in_a_helper_ends_neither_the_worker_nor_a_session(
    nats_server: EmbeddedServer, helper: str, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connect(nats_server.url)
    config = QueueConfig("helpers", ack_wait=5)
    await Topology(JetStreamApi(nc), config).ensure()
    arrived, go, failed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    done: list[bytes] = []
    worker = QueueWorker(nc, config, lambda key: Gate(arrived, go, done), concurrency=2,
                         settings=SessionSettings(ack_wait=5, linger=0.05), reconcile_interval=0.2)

    async def broken(*args: object) -> None:
        await arrived.wait()  # while a session holds its key
        failed.set()
        raise RuntimeError("a bug in a helper")

    if helper == "reconciler":
        real_reconcile = worker.reconciler.reconcile
        worker.reconciler.reconcile = broken  # type: ignore[method-assign]
    else:
        real_delete = worker.io.delete_token
        worker.io.delete_token = broken  # type: ignore[method-assign]
    try:
        async with running(worker) as task:
            await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: "r1"}, b"first", "r1"))
            await arrived.wait()
            session = worker.sessions["k"]
            if helper == "rechecks":
                # A release the connection cut short, of another key: the worker re-checks it.
                worker.recheck_later(Token("other", config.names.token("other"), "", 10**9, 1, time.monotonic()), 1)
            await failed.wait()
            again = asyncio.Event()
            if helper == "reconciler":
                async def reconcile() -> list[str]:
                    again.set()
                    return await real_reconcile()

                worker.reconciler.reconcile = reconcile  # type: ignore[method-assign]
            else:
                async def delete_token(token: Token) -> None:
                    again.set()
                    await real_delete(token)

                worker.io.delete_token = delete_token  # type: ignore[method-assign]
            await asyncio.sleep(0)  # the failure has reached whatever awaits the helper
            go.set()
            await asyncio.wait([session])
            assert not session.cancelled() and done == [b"first"]
            assert not task.done()
            await again.wait()  # and the helper goes on: its next pass, its next try
    finally:
        await nc.close()
    [logged] = [r for r in caplog.records if "a bug in a helper" in str(r.exc_info and r.exc_info[1])]
    assert logged.levelno == logging.ERROR
