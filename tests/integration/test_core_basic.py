"""The key session end to end in one process: order, delete, reply, DLQ, retries, reconciler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from queue_workers import running as running_worker
from queue_workers import stored_requests

from keyqueue.core.observer import KeyHold, NullObserver, RequestAttempt, SessionEnd
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import SessionSettings
from keyqueue.core.turns import Turns
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.wire import headers as H


def request(key: str, body: bytes, **headers: str) -> OutgoingRequest:
    from ulid import ULID
    rid = str(ULID())
    return OutgoingRequest(key, {H.MSG_ID: rid, **headers}, body, rid)


class Recorder(BaseProcessor):
    def __init__(self, log: list[tuple[str, bytes]], fail: dict[bytes, int] | None = None) -> None:
        self.log = log
        self.fail = fail or {}

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        if self.fail.get(request.data, 0) > 0:
            self.fail[request.data] -= 1
            raise RuntimeError(f"boom {request.data!r}")
        self.log.append((request.key, request.data))
        return Reply(b"done:" + request.data)


@contextlib.asynccontextmanager
async def running(nc: Client, config: QueueConfig, factory, **kw) -> AsyncIterator[QueueWorker]:  # type: ignore[no-untyped-def]
    worker = QueueWorker(nc, config, factory, **kw)
    async with running_worker(worker):
        yield worker


async def wait_until(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_requests_run_in_order_and_are_deleted(nats_url: str) -> None:
    nc = await connect(nats_url)
    config = QueueConfig("t1", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    pub = Publisher(nc, config.names)
    for i in range(20):
        await pub.enqueue(request("a", b"%d" % i))
        await pub.enqueue(request("b.c", b"%d" % i))
    log: list[tuple[str, bytes]] = []
    async with running(nc, config, lambda key: Recorder(log), concurrency=4,
                       settings=SessionSettings(ack_wait=2, linger=0.05)) as worker:
        await wait_until(lambda: len(log) == 40)
        await wait_until(lambda: not worker.sessions)
    assert [d for k, d in log if k == "a"] == [b"%d" % i for i in range(20)]
    assert [d for k, d in log if k == "b.c"] == [b"%d" % i for i in range(20)]
    assert await stored_requests(nc, config.names) == []
    tokens = await JetStreamApi(nc).stream_info(config.names.token_stream)
    assert tokens["state"]["messages"] == 0
    await nc.close()


async def test_a_request_done_before_a_slow_one_is_removed_while_the_slow_one_runs(nats_url: str) -> None:
    # Requests done one after another are removed by one purge of the key's subject; a slow
    # request after fast ones must not keep them stored (a crash meanwhile would run them again).
    nc = await connect(nats_url)
    config = QueueConfig("coalesced", ack_wait=5)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    pub = Publisher(nc, config.names)
    await pub.enqueue_many([request("k", b"fast%d" % i) for i in range(3)] + [request("k", b"slow")])
    slow_started, finish = asyncio.Event(), asyncio.Event()

    class SlowLast(BaseProcessor):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            if request.data == b"slow":
                slow_started.set()
                await finish.wait()
            return None

    settings = SessionSettings(ack_wait=5, linger=0.05)
    async with running(nc, config, lambda key: SlowLast(), settings=settings) as worker:
        async with asyncio.timeout(20):
            await slow_started.wait()
            while True:  # the three fast ones go while the slow one runs
                if (await api.stream_info(config.names.inbox_stream))["state"]["messages"] == 1:
                    break
                await asyncio.sleep(0.01)
        left = await api.get_msg(config.names.inbox_stream, seq=1, next_by_subject=config.names.inbox("k"))
        assert left is not None and left.data == b"slow"
        finish.set()
        await wait_until(lambda: worker.counts.get("released", 0) >= 1)
    assert await stored_requests(nc, config.names) == []
    await nc.close()


async def test_a_failing_observer_is_logged_and_never_breaks_a_session(nats_url: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    class Broken(NullObserver):
        def key_acquired(self, hold: KeyHold) -> None:
            raise RuntimeError("observer bug")

        def request_started(self, attempt: RequestAttempt) -> None:
            raise RuntimeError("observer bug")

        def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
            raise RuntimeError("observer bug")

        def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
            raise RuntimeError("observer bug")

        async def wait_for_room(self) -> None:
            raise RuntimeError("observer bug")

    nc = await connect(nats_url)
    config = QueueConfig("observed", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    pub = Publisher(nc, config.names)
    for i in range(3):
        await pub.enqueue(request("k", b"%d" % i))
    log: list[tuple[str, bytes]] = []
    with caplog.at_level(logging.ERROR, logger="keyqueue.worker"):
        async with running(nc, config, lambda key: Recorder(log), observer=Broken(),
                           settings=SessionSettings(ack_wait=2, linger=0.05)) as worker:
            await wait_until(lambda: len(log) == 3 and worker.counts.get("released", 0) >= 1)
    assert log == [("k", b"0"), ("k", b"1"), ("k", b"2")]
    assert await stored_requests(nc, config.names) == []
    for step in ("key_acquired", "wait_for_room", "request_started", "request_succeeded", "key_released"):
        assert f"session observer failed in {step}" in caplog.text
    await nc.close()


async def test_reply_retry_and_dead_letter(nats_url: str) -> None:
    nc = await connect(nats_url)
    config = QueueConfig("t2", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    pub = Publisher(nc, config.names)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await pub.enqueue(request("k", b"flaky", **{H.REPLY_INBOX: inbox}))
    await pub.enqueue(request("k", b"poison", **{H.REPLY_INBOX: inbox}))
    await pub.enqueue(request("k", b"after", **{H.REPLY_INBOX: inbox}))
    log: list[tuple[str, bytes]] = []
    fail = {b"flaky": 1, b"poison": 99}
    settings = SessionSettings(ack_wait=2, linger=0.05, retry=RetryPolicy(max_attempts=3, base_delay=0.01))
    async with running(nc, config, lambda key: Recorder(log, fail), settings=settings):
        replies = [await sub.next_msg(timeout=10) for _ in range(3)]
    assert [r.headers[H.STATUS] for r in replies] == ["ok", "dead-lettered", "ok"]
    assert replies[0].data == b"done:flaky"
    assert log == [("k", b"flaky"), ("k", b"after")]
    dlq = await JetStreamApi(nc).get_msg(config.names.dlq_stream, seq=1)
    assert dlq is not None and dlq.data == b"poison"
    assert dlq.headers[H.DLQ_REASON] == "max-attempts"
    assert dlq.headers[H.DLQ_ATTEMPTS] == "3"
    await nc.close()


async def test_reconciler_schedules_a_request_without_token(nats_url: str) -> None:
    nc = await connect(nats_url)
    config = QueueConfig("t3", ack_wait=2)
    await Topology(JetStreamApi(nc), config).ensure()
    pub = Publisher(nc, config.names)
    await pub.store(request("orphan", b"x"))  # a producer that died before the token publish
    log: list[tuple[str, bytes]] = []
    async with running(nc, config, lambda key: Recorder(log)) as worker:
        await wait_until(lambda: len(log) == 1)
    assert worker.reconciler.scheduled_total == 1
    await nc.close()


async def test_connect_to_an_unreachable_server_fails_fast() -> None:
    import socket

    from keyqueue.errors import ConnectionFailed

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionFailed, match="keyqueue dev-server"):
        await asyncio.wait_for(connect(f"nats://127.0.0.1:{port}"), 15)


class PrefixBatches(BaseProcessor):
    """Takes at most two requests per call and rejects the one whose body is b"bad"."""

    batch_size = 10

    def __init__(self, calls: list[list[bytes]]) -> None:
        self.calls = calls

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> list[Reply | BaseException | None]:
        taken = requests[:2]
        self.calls.append([r.data for r in requests])
        return [ValueError("bad body") if r.data == b"bad" else Reply(r.data) for r in taken]


async def test_batch_processor_handles_a_prefix_and_rejects_one_request(nats_url: str) -> None:
    nc = await connect(nats_url)
    config = QueueConfig("t5", ack_wait=2)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    pub = Publisher(nc, config.names)
    await pub.enqueue_many([request("k", body) for body in (b"1", b"2", b"bad", b"4", b"5")])
    calls: list[list[bytes]] = []
    async with running(nc, config, lambda key: PrefixBatches(calls)) as worker:
        await wait_until(lambda: worker.counts.get("succeeded", 0) == 4)
    assert calls[0] == [b"1", b"2", b"bad", b"4", b"5"]
    assert calls[1] == [b"bad", b"4", b"5"]
    assert calls[2] == [b"5"]
    dead = await api.get_msg(config.names.dlq_stream, seq=1)
    assert dead is not None and dead.data == b"bad" and dead.headers[H.DLQ_REASON] == "rejected"
    assert await stored_requests(nc, config.names) == []
    await nc.close()


class CountedTurns(Turns):
    """The worker's turns, counting those its sessions take."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    async def take(self) -> None:
        self.taken += 1
        await super().take()


async def test_a_session_takes_a_turn_only_while_requests_are_left_to_read(nats_url: str) -> None:
    """A busy session yields the loop between requests (core/turns.py); a key with nothing left to
    read goes on to give its key back without one: cold keys, one request each, take no turn."""
    nc = await connect(nats_url)
    config = QueueConfig("turns", ack_wait=5)
    await Topology(JetStreamApi(nc), config).ensure()
    pub = Publisher(nc, config.names)
    for k in range(20):
        await pub.enqueue(request(f"cold{k}", b"x"))
    log: list[tuple[str, bytes]] = []
    worker = QueueWorker(nc, config, lambda key: Recorder(log), concurrency=8,
                         settings=SessionSettings(ack_wait=5, linger=0.0))
    worker.turns = turns = CountedTurns()  # before it runs: every session it starts shares it
    async with running_worker(worker):
        await wait_until(lambda: len(log) == 20)
        await wait_until(lambda: not worker.sessions)
        assert turns.taken == 0
        # Stored before the key's token (enqueue_many schedules keys last): one read finds all five.
        await pub.enqueue_many([request("busy", b"%d" % i) for i in range(5)])
        await wait_until(lambda: len(log) == 25)
        await wait_until(lambda: not worker.sessions)
    # Five requests read at once: a turn after each of the first four, none after the last.
    assert turns.taken == 4
    assert [d for k, d in log if k == "busy"] == [b"%d" % i for i in range(5)]
    await nc.close()
