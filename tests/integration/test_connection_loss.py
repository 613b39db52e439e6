"""A lost connection against a real nats-server: nothing is sent late, errors are typed and
logged, and a worker outlives the outage."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import nats.errors
import pytest
from loop_turns import LoopTurns
from nats.aio.client import Client
from nats.aio.msg import Msg
from queue_workers import running, stored_requests

from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import Disconnected
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.pull import PullOptions
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H


def request(key: str, body: bytes) -> OutgoingRequest:
    from ulid import ULID
    rid = str(ULID())
    return OutgoingRequest(key, {H.MSG_ID: rid}, body, rid)


class Watched:
    """A keyqueue connection whose disconnects and reconnects a test can await."""

    def __init__(self) -> None:
        self.nc: Client | None = None
        self.down = asyncio.Event()
        self.up = asyncio.Event()

    async def open(self, url: str) -> Client:
        async def reconnected() -> None:
            self.down.clear()
            self.up.set()

        async def disconnected() -> None:
            self.up.clear()
            self.down.set()

        self.nc = await connect(url, reconnected=reconnected, disconnected=disconnected)
        return self.nc


class LogSignal(logging.Handler):
    """An event set when ``logger`` logs a record whose message contains ``text``."""

    def __init__(self, logger: str, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(logger)
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()

    def __enter__(self) -> LogSignal:
        self.logger.addHandler(self)
        self.level_was = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_was)


class Recorder(BaseProcessor):
    def __init__(self, seen: list[bytes], arrived: asyncio.Event) -> None:
        self.seen = seen
        self.arrived = arrived

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.seen.append(request.data)
        self.arrived.set()
        return None


async def seen_or_died(arrived: asyncio.Event, task: asyncio.Task[None], timeout: float = 20.0) -> None:
    """Wait for ``arrived``; fail at once with the worker's error if the worker ended first."""
    waiter = asyncio.create_task(arrived.wait())
    try:
        await asyncio.wait([waiter, task], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        task.result()
        raise AssertionError("the worker stopped by itself")
    assert arrived.is_set(), "the request was not processed in time"


async def test_a_worker_survives_a_server_restart_and_takes_requests_enqueued_after_it(
        nats_server: EmbeddedServer) -> None:
    watched = Watched()
    nc = await watched.open(nats_server.url)
    config = QueueConfig("restart", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    publisher = Publisher(nc, config.names)
    seen: list[bytes] = []
    arrived = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Recorder(seen, arrived), concurrency=4,
                         settings=SessionSettings(ack_wait=2, linger=0.05),
                         pull=PullOptions(heartbeat=0.5, expires=2.0))
    try:
        async with running(worker) as task:
            await publisher.enqueue(request("k", b"before"))
            await seen_or_died(arrived, task)
            arrived.clear()

            await nats_server.stop()
            await watched.down.wait()
            worker.puller.wake()  # let the puller try while the server is down
            await nats_server.start()
            await watched.up.wait()

            await publisher.enqueue(request("k", b"after"))
            await seen_or_died(arrived, task)
        assert seen == [b"before", b"after"]
    finally:
        await nc.close()


async def test_a_closed_connection_does_not_kill_the_worker(nats_server: EmbeddedServer) -> None:
    nc = await connect(nats_server.url)
    config = QueueConfig("closed", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    seen: list[bytes] = []
    arrived = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Recorder(seen, arrived), concurrency=4,
                         settings=SessionSettings(ack_wait=2, linger=0.05),
                         pull=PullOptions(heartbeat=0.5, expires=2.0))
    with LogSignal("keyqueue.pull", "connection is closed") as closed:
        async with running(worker) as task:
            await Publisher(nc, config.names).enqueue(request("k", b"before"))
            await seen_or_died(arrived, task)
            await nc.close()
            worker.puller.abandon_pulls()  # as after a stalled loop: subscribe afresh for new pulls
            await seen_or_died(closed.seen, task)
    # and stopping it on the closed connection raised nothing either (``running`` awaited it)


async def test_nothing_published_while_disconnected_is_sent_after_the_reconnect(
        nats_server: EmbeddedServer) -> None:
    watched = Watched()
    nc = await watched.open(nats_server.url)
    api = JetStreamApi(nc)
    config = QueueConfig("late", ack_wait=2)
    await Topology(api, config).ensure()
    # Each refused publish first waits out the outage: a short wait proves the same refusals.
    publisher = Publisher(nc, config.names, outage_wait=1.0)
    try:
        await nats_server.stop()
        await watched.down.wait()
        with pytest.raises(Disconnected, match="was not sent"):
            await publisher.enqueue(request("k", b"late"))  # through the request mux
        with pytest.raises(Disconnected, match="was not sent"):
            await publisher.store(request("k", b"late too"))  # through nc.request
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            await nc.publish(config.names.token("k"), b"")  # nats-py itself buffers nothing either
        await nats_server.start()
        await watched.up.wait()
        await nc.flush()  # anything nats-py had kept would be with the server by now
        assert await stored_requests(nc, config.names) == []
        assert (await api.stream_info(config.names.token_stream))["state"]["messages"] == 0
    finally:
        await nc.close()


async def test_a_publish_tried_while_nats_py_starts_reconnecting_yields_to_the_reconnect(
        nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    # nats-py learns of a drop in its read loop: it marks itself reconnecting and starts its reconnect
    # as a task, which tells keyqueue's link (the disconnected callback) only once the loop runs it. A
    # publish between the two failed at once, and its retry loop asked the link, which still said up,
    # and tried again without yielding: the reconnect never ran, and the producer held its event loop
    # for the whole outage wait (15 s; seen in the chaos soak as every worker's traffic frozen).
    watched = Watched()
    nc = await watched.open(nats_server.url)
    config = QueueConfig("spin", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    publisher = Publisher(nc, config.names, outage_wait=15.0)
    try:
        with caplog.at_level(logging.WARNING, logger="keyqueue.connection"):
            await nc._process_op_err(ConnectionResetError("the read loop saw the socket close"))  # type: ignore[attr-defined]
            assert nc.is_reconnecting and nc.link.told_up and not nc.link.is_up
            async with LoopTurns() as turns:
                [result] = await publisher.enqueue_many([request("k", b"across the drop")])
        assert isinstance(result, Enqueued), result  # stored once the reconnect ran
        assert turns.count > 0  # the loop ran other tasks meanwhile
        assert watched.up.is_set() and "lost, reconnecting" in caplog.text  # the drop was still reported
        assert [m.data for m in await stored_requests(nc, config.names)] == [b"across the drop"]
    finally:
        await nc.close()


async def test_bytes_still_buffered_when_the_connection_drops_are_not_sent_after_the_reconnect(
        nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    watched = Watched()
    nc = await watched.open(nats_server.url)
    api = JetStreamApi(nc)
    await api.add_stream({"name": "LATE", "subjects": ["late.>"], "storage": "file"})
    assert nats_server.pid is not None
    # A frozen server reads nothing: once the socket buffers are full, nats-py's flusher waits
    # for the socket and later publishes stay in nats-py's own buffer, as in a network partition.
    os.kill(nats_server.pid, signal.SIGSTOP)
    try:
        filler = b"x" * 256 * 1024
        for _ in range(400):
            await nc.publish("filler", filler)
            await asyncio.sleep(0)  # let the flusher write (no event says when it is stuck)
            if nc.pending_data_size:
                break
        assert nc.pending_data_size, "the socket never filled up"
        await nc.publish("late.ack", b"written just before the connection dropped")
    finally:
        nats_server.kill()  # resets the connection, with the last publish still buffered in nats-py
    with caplog.at_level(logging.WARNING, logger="keyqueue.connection"):
        await watched.down.wait()
    try:
        await nats_server.start()
        await watched.up.wait()
        await nc.flush()
        assert (await api.stream_info("LATE"))["state"]["messages"] == 0
        assert "bytes not yet sent were dropped" in caplog.text
    finally:
        await nc.close()


async def test_a_reconnect_that_fails_in_a_way_nats_py_does_not_expect_is_tried_again(
        nats_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # nats-py's reconnect loop catches OSError, its own errors and timeouts; another exception ended its
    # task, and the client stayed "reconnecting" for good (a soak's worker, alive, did nothing for its
    # last 190 s). keyqueue's client tries again.
    watched = Watched()
    nc = await watched.open(nats_server.url)
    original = Client._process_connect_init
    failures: list[str] = []

    async def unexpected_once(self: Client) -> None:
        if self is nc and not failures:
            failures.append("raised")
            raise ValueError("an exception nats-py's reconnect loop does not expect")
        await original(self)

    monkeypatch.setattr(Client, "_process_connect_init", unexpected_once)
    try:
        with caplog.at_level(logging.ERROR, logger="keyqueue.connection"):
            await nats_server.restart()
            await asyncio.wait_for(watched.down.wait(), 10)
            await asyncio.wait_for(watched.up.wait(), 15)
        assert failures == ["raised"] and nc.is_connected
        assert "reconnecting failed unexpectedly (ValueError" in caplog.text
        # The connection works: a request is answered.
        async def pong(msg: Msg) -> None:
            await msg.respond(b"pong")

        sub = await nc.subscribe("echo", cb=pong)
        assert (await nc.request("echo", b"ping", timeout=5)).data == b"pong"
        await sub.unsubscribe()
    finally:
        await nc.close()
