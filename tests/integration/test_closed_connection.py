"""A connection closed for good under a worker (here: its credentials revoked by a server reload,
after which nats-py closes the client and never reconnects) ends the worker: ``keyqueue worker``
exits with status 1 and logs the cause at ERROR, and nothing loops on the closed connection."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import pytest
from command_output import Command
from queue_workers import running
from secured_server import reload_config, secured_server

import keyqueue
from keyqueue.core.observer import Outcome
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import ConnectionClosed
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

USERS = 'authorization {{ users: [ {{ user: "shop", password: "{password}" }} ] }}'

APP = '''
import asyncio

import keyqueue

app = keyqueue.App("closing", set_as_default=False)


@app.task(key="{k}")
async def hold(k: str) -> None:
    print(f"holding {k}", flush=True)
    await asyncio.sleep(300)
'''


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONUNBUFFERED="1", **values)
    return env


async def test_a_worker_whose_credentials_are_revoked_exits_non_zero_with_the_cause(tmp_path: Path) -> None:
    (tmp_path / "closing_app.py").write_text(APP)
    async with secured_server(tmp_path / "server", USERS.format(password="pw-1")) as port:
        url = f"nats://127.0.0.1:{port}"
        worker = await Command.start(KEYQUEUE, "worker", "closing_app:app", "--ack-wait", "3", cwd=tmp_path,
                                     env=environment(KEYQUEUE_URL=url, KEYQUEUE_USER="shop", KEYQUEUE_PASSWORD="pw-1"))
        try:
            await worker.wait_for(r"queue closing: hold")
            producer = keyqueue.App("closing", url=f"nats://shop:pw-1@127.0.0.1:{port}", set_as_default=False,
                                    autoload_plugins=False)

            @producer.task(key="{k}")
            async def hold(k: str) -> None: ...

            try:
                await hold.enqueue(k="a")
                await worker.wait_for(r"holding a")  # a key held, its lease renewed
            finally:
                await producer.close()
            reload_config(tmp_path / "server", port, USERS.format(password="pw-2"))
            code = await worker.wait(timeout=60)  # on its own: nobody signalled it
        finally:
            await worker.stop()
    assert code == 1, worker.output
    [line] = [line for line in worker.lines if " ERROR " in line and "closed for good" in line]
    assert "AuthorizationError" in line and "credentials" in line
    assert "pw-1" not in worker.output  # no secret in the log


async def test_an_in_process_worker_stops_by_itself_and_raises_connection_closed(tmp_path: Path) -> None:
    async with secured_server(tmp_path / "server", USERS.format(password="pw-1")) as port:
        app = keyqueue.App("closing", url=f"nats://shop:pw-1@127.0.0.1:{port}", set_as_default=False,
                           autoload_plugins=False)
        held = asyncio.Event()

        @app.task(key="{k}")
        async def hold(k: str) -> None:
            held.set()
            await asyncio.sleep(300)

        try:
            worker = app.worker(ack_wait=3, concurrency=2)
            await worker.start()
            await hold.enqueue(k="a")
            await held.wait()
            reload_config(tmp_path / "server", port, USERS.format(password="pw-2"))
            assert worker._runner is not None
            async with asyncio.timeout(60):  # it ends by itself: no loop spins on the closed connection
                await asyncio.wait([worker._runner])
            with pytest.raises(ConnectionClosed, match="closed for good") as caught:
                await worker.stop()
            assert type(caught.value.cause).__name__ == "AuthorizationError"
        finally:
            await app.close()


class Hold(BaseProcessor):
    """Holds its key's first request until cancelled."""

    def __init__(self, arrived: asyncio.Event) -> None:
        self.arrived = arrived

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.arrived.set()
        await asyncio.sleep(300)
        return None


@pytest.mark.timeout(90)  # a loop that spins without yielding can only be stopped by this
async def test_no_loop_of_a_queue_worker_spins_on_a_closed_connection(
    nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connect(nats_server.url)
    config = QueueConfig("spin", ack_wait=3)
    await Topology(JetStreamApi(nc), config).ensure()
    arrived = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Hold(arrived), concurrency=2,
                         settings=SessionSettings(ack_wait=3, linger=0.05))
    caplog.set_level(logging.WARNING, "keyqueue.worker")
    async with running(worker):
        await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: "r1"}, b"", "r1"))
        await arrived.wait()
        session = worker.sessions["k"]
        await nc.close()
        # A release the connection cut short: the worker re-checks the key "once connected".
        worker.recheck_later(worker._held["k"].token, 1)
        # The lease cannot be renewed: its renewal waits it out (it does not retry at once), and
        # the work is cut when it ends; meanwhile the loop runs freely (its lag monitor says so).
        assert await session == Outcome.LEASE_LOST
    assert not [r for r in caplog.records if "event loop blocked" in r.getMessage()]
