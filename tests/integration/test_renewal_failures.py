"""Why a lease was lost is said where a user looks (the lease-lost warning), against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import pytest
from nats.aio.client import Client
from queue_workers import running

from keyqueue.core.observer import Outcome
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import KeyqueueTimeout
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
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


class Note(BaseProcessor):
    def __init__(self, done: asyncio.Event) -> None:
        self.done = done

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.done.set()
        return None


async def lease_worker(url: str, queue: str, processor: Callable[[], BaseProcessor]
                       ) -> tuple[Client, QueueConfig, QueueWorker]:
    """A worker of a fresh queue (a 3 s lease, 0.05 s linger) on a connection of its own."""
    nc = await connect(url)
    config = QueueConfig(queue, ack_wait=3)
    await Topology(JetStreamApi(nc), config).ensure()
    return nc, config, QueueWorker(nc, config, lambda key: processor(), concurrency=2,
                                   settings=SessionSettings(ack_wait=3, linger=0.05))


async def enqueue_one(nc: Client, config: QueueConfig) -> None:
    await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: "r1"}, b"", "r1"))


def kept_60s(body: bytes) -> bytes:
    """A lease record's body saying a TTL of 60 s (written with that TTL: what a waiter's rules read too)."""
    return json.dumps({**json.loads(body), "ttl": 60}).encode()


def keep_records_60s(worker: QueueWorker) -> None:
    """Make ``worker`` write its lease records with a 60 s TTL (its lease stays 3 s): a record left
    behind would hold the key far longer than any test waits."""
    real_write = worker.io.compare_and_set

    async def kept_long(subject: str, expected: int, body: bytes, ttl: int, timeout: float | None = None) -> int:
        return await real_write(subject, expected, kept_60s(body), 60, timeout)

    worker.io.compare_and_set = kept_long  # type: ignore[method-assign]


async def test_a_lease_lost_to_failed_renewals_is_logged_with_why_they_failed(
    nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    arrived = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "renewals", lambda: Hold(arrived))
    caplog.set_level(logging.INFO, "keyqueue")
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            await arrived.wait()
            session = worker.sessions["k"]
            # The lease records' stream is gone: every renewal gets "no responders" until the lease ends.
            await JetStreamApi(nc).delete_stream(config.names.lease_stream)
            assert await session == Outcome.LEASE_LOST
    finally:
        await nc.close()
    [lost] = [r for r in caplog.records if "lease lost" in r.getMessage()]
    assert lost.levelno == logging.WARNING
    assert "the last renewal failed: ConnectionFailed" in lost.getMessage(), lost.getMessage()


async def test_a_lost_lease_s_record_is_removed_by_its_holder_once_its_work_ended(nats_server: EmbeddedServer) -> None:
    """nats-server does not always expire a lease record by its TTL after a kill -9 and restart; a
    waiter then deletes it only once it has watched it for twice the TTL. Its former holder knows
    better: once its session ended with the lease lost (its work over), it removes its own record.
    Here the server keeps the record for 60 s (its TTL, where the lease is 3 s), and a waiter (the
    same worker, once the token comes back) would wait 120 s: only the former holder removes it sooner."""
    arrived = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "leftover", lambda: Hold(arrived))
    real_write = worker.io.compare_and_set
    failing = False

    async def kept_long_then_unrenewable(subject: str, expected: int, body: bytes, ttl: int,
                                         timeout: float | None = None) -> int:
        if failing:
            raise KeyqueueTimeout("the renewal is not answered")
        return await real_write(subject, expected, kept_60s(body), 60, timeout)

    worker.io.compare_and_set = kept_long_then_unrenewable  # type: ignore[method-assign]
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            await arrived.wait()
            session = worker.sessions["k"]
            record = await worker.io.last_record(config.names.lease("k"))
            assert record is not None
            failing = True
            assert await session == Outcome.LEASE_LOST
            async with asyncio.timeout(30):  # well inside the record's 60 s TTL
                while await worker.io.last_record(config.names.lease("k")) is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def test_a_record_whose_delete_the_server_lost_is_removed_again_after_the_reconnect(
        nats_server: EmbeddedServer) -> None:
    """A worker gives a key back, the server answers the record's delete, and is killed before its
    store wrote it: after the restart the record is back, and nats-server does not always expire it
    by its TTL then, so the next holder would wait until it had watched it for twice the TTL. The
    worker removes the records it removed just before a connection drop again once reconnected.
    Here the delete is answered and not done (the lost write), the record is kept 60 s (its TTL,
    where the lease is 3 s), and a server restart drops the connection. On one server the delete
    is sent unanswered (``QueueIO.forget_record``): the same covers one lost on the way."""
    nc, config, worker = await lease_worker(nats_server.url, "lostdelete", lambda: Note(asyncio.Event()))
    real_remove = worker.io.remove_record
    lost: list[int] = []
    async def first_delete_lost(seq: int, ttl: float = 0) -> None:
        if not lost:
            lost.append(seq)  # answered (or, on one server, sent unanswered), never written
            return
        await real_remove(seq)

    keep_records_60s(worker)
    worker.io.remove_record = first_delete_lost  # type: ignore[method-assign]
    worker.io.forget_record = first_delete_lost  # type: ignore[method-assign]
    subject = config.names.lease("k")
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            async with asyncio.timeout(10):  # until the session gave the key back
                while not lost or "k" in worker.sessions:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            record = await worker.io.last_record(subject)
            assert record is not None and lost == [record.seq], "the released record's delete was not the lost one"

            await nats_server.stop()
            await nats_server.start()
            assert await worker.io.wait_connected(10)
            async with asyncio.timeout(30):  # well inside the record's 60 s TTL
                while await worker.io.last_record(subject) is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def test_on_one_server_a_key_given_back_removes_its_record_without_waiting_for_the_answer(
        nats_server: EmbeddedServer) -> None:
    """The last step of a quiet release is the record's delete: on one server nobody waits for its
    answer (a round trip less per cold key; the answer is only looked for, and a delete left
    unanswered is sent again), so the key's next request starts at once, not after the record's
    60 s TTL."""
    done = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "unanswered", lambda: Note(done))
    assert worker.io.unanswered_removals
    real_remove, real_forget = worker.io.remove_record, worker.io.forget_record
    answered: list[int] = []
    unanswered: list[int] = []
    async def remove(seq: int) -> None:
        answered.append(seq)
        await real_remove(seq)

    async def forget(seq: int, ttl: float) -> None:
        unanswered.append(seq)
        await real_forget(seq, ttl)

    keep_records_60s(worker)
    worker.io.remove_record = remove  # type: ignore[method-assign]
    worker.io.forget_record = forget  # type: ignore[method-assign]
    subject = config.names.lease("k")
    try:
        async with running(worker):
            for n in range(1, 4):
                done.clear()
                await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: f"r{n}"}, b"", f"r{n}"))
                async with asyncio.timeout(10):  # far inside the 60 s TTL a record left behind would hold the key
                    await done.wait()
                    while len(unanswered) < n or "k" in worker.sessions:  # noqa: ASYNC110
                        await asyncio.sleep(0.005)
                async with asyncio.timeout(5):
                    while await worker.io.last_record(subject) is not None:  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
        assert answered == [] and len(set(unanswered)) == 3
    finally:
        await nc.close()


async def test_a_key_whose_unawaited_record_delete_was_dropped_is_free_again_in_seconds(
        nats_server: EmbeddedServer) -> None:
    """nats-server may drop a delete nobody waits for (a full API queue:
    tests/integration/test_unawaited_deletes.py). Here the first one is never sent, as if dropped:
    no answer comes, the delete is sent again, and the key's next request starts in seconds, not
    after the record's 60 s TTL."""
    done = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "dropped", lambda: Note(done))
    keep_records_60s(worker)
    deletes = worker.io.forgotten
    real_publish = deletes._publish
    dropped: list[int] = []

    async def first_dropped(seq: int) -> None:
        if not dropped:
            dropped.append(seq)
            return
        await real_publish(seq)

    deletes._publish = first_dropped  # type: ignore[method-assign]
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            async with asyncio.timeout(10):
                await done.wait()
                while not dropped or "k" in worker.sessions:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            done.clear()
            await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {H.MSG_ID: "r2"}, b"", "r2"))
            async with asyncio.timeout(15):  # far inside the 60 s a record left behind would hold the key
                await done.wait()
        assert deletes.sent_again >= 1
    finally:
        await nc.close()


async def test_a_waiter_removes_a_record_the_server_kept_past_its_ttl_by_the_servers_clock(
        nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    """A record the server should have expired (here it keeps it 60 s, where its body says 1 s, as a
    server that lost track of its TTL after a kill -9 and restart) is removed by the waiter once
    the server's clock, as the tokens' stamps tell it, is past the record's TTL: not after watching it
    for twice the TTL, which is what the log would say otherwise."""
    done = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "kept", lambda: Note(done))
    body = {"worker": "gone", "host": "elsewhere", "pid": 1, "nonce": "not-ours", "ttl": 1, "sent": 0}
    await worker.io.compare_and_set(config.names.lease("k"), 0, json.dumps(body).encode(), 60)
    caplog.set_level(logging.WARNING, "keyqueue")
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            async with asyncio.timeout(30):  # well inside the record's 60 s
                await done.wait()
    finally:
        await nc.close()
    [removed] = [r.getMessage() for r in caplog.records if "removed lease record" in r.getMessage()]
    assert "past its TTL by the server's own clock" in removed, removed
    assert "worker gone, pid 1" in removed, removed


async def test_a_record_an_ended_session_of_the_worker_left_is_removed_by_its_next_session_at_once(
        nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    """A session's acquire goes unanswered; its release looks for a record of its claim and finds
    none; the write is stored after all (a slow or electing stream applies it late). The key's next
    session on the same worker removes that record as soon as it is refused: nothing of the ended
    session runs any more. Here the record is kept 60 s (its TTL), so only that removal frees the key."""
    done = asyncio.Event()
    nc, config, worker = await lease_worker(nats_server.url, "orphan", lambda: Note(done))
    real_write = worker.io.compare_and_set
    unanswered: list[bytes] = []

    async def first_acquire_unanswered(subject: str, expected: int, body: bytes, ttl: int,
                                       timeout: float | None = None) -> int:
        if subject == config.names.lease("k") and not unanswered:
            unanswered.append(kept_60s(body))
            raise KeyqueueTimeout("no reply to the acquire")
        return await real_write(subject, expected, body, ttl, timeout)

    real_look = worker.io.last_record
    looks: list[str] = []

    async def first_look_fails(subject: str) -> StoredMsg | None:
        if subject == config.names.lease("k") and not looks:
            looks.append(subject)  # the session ends there (failed), without the key
            raise RuntimeError("the stream could not be read")
        return await real_look(subject)

    worker.io.compare_and_set = first_acquire_unanswered  # type: ignore[method-assign]
    worker.io.last_record = first_look_fails  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, "keyqueue")
    try:
        async with running(worker):
            await enqueue_one(nc, config)
            # The first session fails on its look (logged below) and gives the token back for a
            # second later: wait until it is over.
            async with asyncio.timeout(10):
                while not looks or "k" in worker.sessions:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            # The unanswered acquire lands now, after the failed session's release looked for it.
            await real_write(config.names.lease("k"), 0, unanswered[0], 60)
            async with asyncio.timeout(30):  # well inside the record's 60 s
                await done.wait()
    finally:
        await nc.close()
    [removed] = [r.getMessage() for r in caplog.records if "removed lease record" in r.getMessage()]
    assert "a claim of this worker's whose session is over" in removed, removed
    assert "could not acquire the key's lease record: RuntimeError" in caplog.text
