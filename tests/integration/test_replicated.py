"""The key session on a 3-node cluster with R3 streams, as users deploy it.

On a replicated stream the server answers some requests before it has done their work (a double
ack before the token is removed), and a compare-and-set that loses may get 10164 instead of
10071 (docs/architecture.md, "Replicated streams"). Each test here failed on the main before the
change that handles it. One cluster serves the module (it takes seconds to form); each test uses
queues of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.core.lock import KeyLock
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import WrongLastSequence
from keyqueue.jetstream.api import DESCRIPTION, STATUS, JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.pull import LEADERSHIP_CHANGE, Token
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.cluster import EmbeddedCluster

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[EmbeddedCluster]:
    async with EmbeddedCluster(3) as started:
        yield started


@contextlib.asynccontextmanager
async def connections(cluster: EmbeddedCluster, n: int) -> AsyncIterator[list[Client]]:
    """``n`` connections, spread over the nodes (each to one node, as workers on different hosts)."""
    ncs = [await connect(cluster.urls[i % len(cluster.urls)], name=f"c{i}") for i in range(n)]
    try:
        yield ncs
    finally:
        for nc in ncs:
            await nc.close()


async def replicated_queue(nc: Client, name: str, ack_wait: float = 10.0) -> QueueConfig:
    config = QueueConfig(name, ack_wait=ack_wait, replicas=3)
    deadline = time.monotonic() + 30
    while True:  # the streams' interest spreads over the routes a moment after they are created
        try:
            await Topology(JetStreamApi(nc), config).ensure()
            await Publisher(nc, config.names).schedule("warm-up")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    await JetStreamApi(nc).purge(config.names.token_stream)
    return config


def request(key: str, body: bytes) -> OutgoingRequest:
    rid = f"{key}-{body.decode()}"
    return OutgoingRequest(key, {"Nats-Msg-Id": rid}, body, rid)


class EnqueuesItsSuccessor(BaseProcessor):
    """Runs ``first`` and, as its key is being released, enqueues ``second`` on the same key: a
    few milliseconds after the handler returns, the moment a linger-0 session acks its token."""

    def __init__(self, producer: Publisher, started: dict[str, float], stored: dict[str, float],
                 pending: set[asyncio.Task[None]], failed: dict[str, list[str]]) -> None:
        self.producer = producer
        self.started = started
        self.stored = stored
        self.pending = pending
        self.failed = failed

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.started[f"{request.key}/{request.data.decode()}"] = time.monotonic()
        if request.data == b"first":
            task = asyncio.create_task(self._successor(request.key))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        return None

    async def _successor(self, key: str) -> None:
        """Enqueues ``second``, again while the cluster refuses it (its message id makes a repeat
        harmless): a producer's failure is the test's own, and is recorded so that it cannot pass
        for a request that waited with its key free."""
        await asyncio.sleep(random.uniform(0, 0.004))
        for _ in range(5):
            try:
                await self.producer.enqueue(request(key, b"second"))
            except Exception as e:  # recorded, and shown by the test's assertion
                self.failed.setdefault(key, []).append(repr(e))
                continue
            self.stored[f"{key}/second"] = time.monotonic()
            return


async def test_no_request_is_left_without_a_token_when_its_key_is_released_as_it_lands(
        cluster: EmbeddedCluster) -> None:
    """The quiescence race on R3, with no reconciler to rescue a stranded request: every second
    request must run because the release (or its producer) gave its key a token. Before, a
    release's re-check or a producer's token landed while the acked token was still stored, was
    refused with 10077, and its request waited for a reconciler sweep (here: for ever)."""
    keys = [f"k{i}" for i in range(300)]
    async with connections(cluster, 3) as (producer_nc, nc1, nc2):
        config = await replicated_queue(producer_nc, "race")
        producer = Publisher(producer_nc, config.names)
        started: dict[str, float] = {}
        stored: dict[str, float] = {}
        pending: set[asyncio.Task[None]] = set()
        failed: dict[str, list[str]] = {}
        settings = SessionSettings(ack_wait=10, linger=0)
        workers = [QueueWorker(nc, config,
                               lambda key: EnqueuesItsSuccessor(producer, started, stored, pending, failed),
                               settings=settings, reconcile_interval=3600, name=f"w{i}", concurrency=64)
                   for i, nc in enumerate((nc1, nc2))]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            for w in workers:
                await w.started()
            await producer.enqueue_many([request(k, b"first") for k in keys])
            deadline = time.monotonic() + 90
            while len([k for k in keys if f"{k}/second" in started]) < len(keys):
                stranded = [k for k in keys if f"{k}/second" in stored and f"{k}/second" not in started]
                unsent = [k for k in keys if f"{k}/first" in started and f"{k}/second" not in stored]
                assert time.monotonic() < deadline, (
                    f"second requests stored but never started: {stranded[:10]}; "
                    f"never stored by the test's producer: {unsent[:10]} ({dict(list(failed.items())[:3])})")
                await asyncio.sleep(0.05)
        finally:
            for w in workers:
                w.stop()
            await asyncio.gather(*tasks)
            await asyncio.gather(*pending, return_exceptions=True)
    waits = sorted(started[f"{k}/second"] - stored[f"{k}/second"] for k in keys)
    print(f"R3 quiescence race: second request waited p50 {waits[len(waits) // 2] * 1000:.0f} ms, "
          f"max {waits[-1] * 1000:.0f} ms")


async def test_four_workers_racing_for_one_key_on_r3_lose_quietly(cluster: EmbeddedCluster) -> None:
    """A compare-and-set that loses on R3 may get 10164: it is a lost race (False), never an error."""
    async with connections(cluster, 4) as ncs:
        config = await replicated_queue(ncs[0], "cas")
        ios = [QueueIO(nc, config) for nc in ncs]
        outcomes: dict[str, int] = {}
        for round_ in range(40):
            locks = [KeyLock(io, config.names.lease(f"k{round_}"), 5.0) for io in ios]
            results = await asyncio.gather(*(lock.try_acquire() for lock in locks), return_exceptions=True)
            for result in results:
                name = type(result).__name__ if isinstance(result, BaseException) else str(result)
                outcomes[name] = outcomes.get(name, 0) + 1
            assert [r for r in results if isinstance(r, BaseException)] == []
            assert results.count(True) <= 1
            for lock in locks:
                await lock.release()
        assert outcomes.get("True", 0) >= 30, outcomes


async def test_in_a_cluster_every_record_delete_waits_for_its_answer(cluster: EmbeddedCluster) -> None:
    """A record's delete goes unanswered only on one server (``QueueIO.unanswered_removals``): in a
    cluster a stream's leader can move, or an R1 stream's server restart, while a worker's own
    connection stays up, and the worker would never learn that its delete was lost."""
    async with connections(cluster, 1) as [nc]:
        config = await replicated_queue(nc, "answered")
        assert not QueueIO(nc, config).unanswered_removals
        assert not QueueIO(nc, dataclasses.replace(config, replicas=1)).unanswered_removals


async def test_a_10164_is_a_wrong_last_sequence(cluster: EmbeddedCluster) -> None:
    async with connections(cluster, 4) as ncs:
        config = await replicated_queue(ncs[0], "codes")
        ios = [QueueIO(nc, config) for nc in ncs]
        codes: set[int] = set()
        for round_ in range(60):
            subject = config.names.lease(f"c{round_}")
            results = await asyncio.gather(*(io.compare_and_set(subject, 0, b"{}", 5) for io in ios),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    assert isinstance(result, WrongLastSequence), repr(result)
                    codes.add(result.err_code)
        assert codes <= {10071, 10164}


class Done(BaseProcessor):
    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        return None


async def test_a_release_re_checks_the_inbox_only_once_its_token_is_gone(cluster: EmbeddedCluster) -> None:
    """The release's re-check (the release marker, or the read after it) must come after its token
    is removed, or a request stored just before it has its token publish refused (10077) by the
    token being released. On R3 the double ack's reply comes before the removal (fact 7): before,
    at the re-check the released token was often still stored."""
    keys = [f"k{i}" for i in range(200)]
    async with connections(cluster, 2) as (producer_nc, worker_nc):
        config = await replicated_queue(producer_nc, "recheck")
        producer = Publisher(producer_nc, config.names)
        api = JetStreamApi(worker_nc)
        still_there: list[str] = []
        rechecked: list[str] = []
        worker = QueueWorker(worker_nc, config, lambda key: Done(), settings=SessionSettings(ack_wait=10, linger=0),
                             reconcile_interval=3600, concurrency=32)
        real_next_request, real_mark, real_ack = worker.io.next_request, worker.io.mark_released, worker.io.ack
        acked: dict[str, int] = {}

        async def ack(token: Token, timeout: float = 5.0) -> None:
            await real_ack(token, timeout)
            acked[token.key] = token.stream_seq

        async def token_gone_first(key: str) -> None:
            if key in acked:  # the release's re-check (not one of the session's reads)
                released = acked.pop(key)
                token = await api.get_msg(config.names.token_stream, last_by_subject=config.names.token(key),
                                          direct=False)
                # (a newer token of the key may be there: the worker's start-up reconcile pass
                # schedules each key it finds with requests, and one can land after the release)
                if token is not None and token.seq == released:
                    still_there.append(key)
                rechecked.append(key)

        async def looks_for_the_token_first(key: str, from_seq: int, **options: Any) -> object:
            await token_gone_first(key)
            return await real_next_request(key, from_seq, **options)

        async def marks_after_the_token(key: str, last_seq: int, **options: Any) -> bool:
            await token_gone_first(key)
            return await real_mark(key, last_seq, **options)

        worker.io.ack = ack  # type: ignore[method-assign]
        worker.io.next_request = looks_for_the_token_first  # type: ignore[method-assign,assignment]
        worker.io.mark_released = marks_after_the_token  # type: ignore[method-assign]
        task = asyncio.create_task(worker.run())
        try:
            await worker.started()
            assert worker.io.release_markers
            await producer.enqueue_many([request(k, b"only") for k in keys])
            deadline = time.monotonic() + 60
            while len(set(rechecked)) < len(keys):
                assert time.monotonic() < deadline, f"{len(set(rechecked))} of {len(keys)} keys released"
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
            await task
    assert still_there == [], f"{len(still_there)} of {len(keys)} re-checks ran while the token was still stored"


async def test_a_token_published_right_after_release_token_is_never_refused(cluster: EmbeddedCluster) -> None:
    """The release's token step against nats-server's fact 7: after a double ack alone, a token
    published at once is often refused on R3 (the acked token is still stored; how often depends on
    timing, so it is printed, not asserted); after ``release_token`` never by the released token once
    the session's re-check has deleted it again, and never with the key left without a token.

    (Under load a publish whose reply is late is sent again, and the repeat is refused by the
    token the first one stored: "refused" then means a newer token is there, which is what a
    re-check wants. So this counts keys left with no token, or with the released one.)"""
    async with connections(cluster, 1) as (nc,):
        config = await replicated_queue(nc, "fact7")
        io = QueueIO(nc, config)
        puller_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.names.token_stream}.{config.names.consumer}"
        refused = {"ack": 0, "release_token": 0}
        unscheduled, own = 0, 0
        for how in refused:
            for i in range(100):
                key = f"{how}{i}"
                assert await io.schedule(key)
                msg = await nc.request(puller_subject, b'{"batch":1,"expires":2000000000}', timeout=5, old_style=True)
                token = Token(key, msg.subject, msg.reply, msg.metadata.sequence.stream, 1, time.monotonic())
                await (io.ack(token) if how == "ack" else io.release_token(token))
                if not await io.schedule(key):
                    refused[how] += 1
                    if how == "release_token":
                        if await io.token_stored(token):  # the session's hand-back: our own token, again
                            own += 1
                            await io.delete_token(token)
                            await io.schedule(key)
                        stored = await io.api.get_msg(config.names.token_stream,
                                                      last_by_subject=config.names.token(key), direct=False)
                        unscheduled += stored is None or stored.seq == token.stream_seq
                await JetStreamApi(nc).purge(config.names.token_stream)
        print(f"refused right after: {refused['ack']}/100 after an ack alone, {refused['release_token']}/100 "
              f"after release_token ({own} by the released token itself)")
        assert unscheduled == 0
        assert own <= 3  # an ack alone: 17-43 in 100 on the same machine; release_token: 0, once 1 under load


async def test_every_other_compare_and_set_rides_out_a_lost_race_on_r3(cluster: EmbeddedCluster) -> None:
    """Periodic schedules, cancels, rate-limit windows and fleet roles are written by compare-and-set
    from several workers at once; on R3 a loser may get 10164. Before, that raised (put_periodic
    when workers started together, app.cancel); now each reads again and decides again."""
    from keyqueue.core.reconciler import Reconciler
    from keyqueue.jetstream.records import RequestRecords
    from keyqueue.jetstream.schedules import PeriodicDefinition, ScheduleStore

    async with connections(cluster, 4) as ncs:
        config = await replicated_queue(ncs[0], "cas2")
        # Periodic schedules: four workers starting together store one definition.
        stores = [ScheduleStore(nc, "cas2", replicas=3) for nc in ncs]
        await stores[0].ensure()
        for n in range(10):
            wanted = PeriodicDefinition(f"tick{n}", "k", "@every 60s", None,
                                        {"X-CONTENT-TYPE": "application/json", "X-MESSAGE-TYPE": "t",
                                         "X-MESSAGE-VERSION": "1"}, b"{}")
            stored = await asyncio.gather(*(store.put_periodic(wanted) for store in stores))
            assert stored.count(True) >= 1, stored  # the others found it as wanted
            assert (await stores[1].periodic())[f"tick{n}"].same_as(wanted)
        # Cancels: four cancellers of one request all get its state.
        records = [RequestRecords(nc, "cas2", replicas=3) for nc in ncs]
        await records[0].ensure()
        for n in range(10):
            states = await asyncio.gather(*(r.request_cancel(f"req-{n}") for r in records))
            assert {state for state, _ in states} == {"requested"}, states
            assert len({seq for _, seq in states}) == 1  # one record, written once
        # Rate-limit windows: one writer of a window wins, the others lose the race quietly.
        for n in range(10):
            results = await asyncio.gather(*(r.put_runs("t", f"k{n}", [1.0], 0, 60) for r in records),
                                           return_exceptions=True)
            assert sum(isinstance(x, int) for x in results) == 1, results
            assert all(isinstance(x, int | WrongLastSequence) for x in results), results
        # Fleet roles: of four workers that ask at once, one is the reconciler.
        reconcilers = [Reconciler(QueueIO(nc, config), interval=30.0, worker=f"w{i}") for i, nc in enumerate(ncs)]
        elected = await asyncio.gather(*(r.elected() for r in reconcilers))
        assert elected.count(True) == 1, elected


async def test_the_release_marker_on_r3_is_refused_after_an_arrival_alone_otherwise(cluster: EmbeddedCluster) -> None:
    """The release marker's server facts on R3 (one server: test_release_marker.py): refused, with every
    request kept, when a request arrived after the last one handled; otherwise stored alone."""
    async with connections(cluster, 1) as (nc,):
        config = await replicated_queue(nc, "marker")
        io = QueueIO(nc, config)
        producer = Publisher(nc, config.names)
        for n in range(3):
            await producer.enqueue(request("k", b"%d" % n))
        stored = [await io.next_request("k", 1)]
        for _ in range(2):
            last = stored[-1]
            assert last is not None
            stored.append(await io.next_request("k", last.seq + 1))
        seqs = [m.seq for m in stored if m is not None]
        assert await io.mark_released("k", seqs[1]) is False
        assert await io.next_request("k", 1) == stored[0]
        assert await io.mark_released("k", seqs[2]) is True
        assert await io.next_request("k", 1, requests_only=True) is None
        assert await io.request_remains("k", 1) is False


async def test_a_delete_sent_again_finds_its_message_gone_and_says_nothing(cluster: EmbeddedCluster) -> None:
    """A request's or a lease record's delete sent again (its first reply lost to a leader move or a
    reconnect) finds the message gone. The server says so in two ways: 10057 where the sequence
    is below the stream's first, 10043 ("sequence N not found") where messages after and before it
    are still stored. Both are a done delete; a 10043 once failed the session of a restart soak."""
    async with connections(cluster, 1) as [nc]:
        config = await replicated_queue(nc, "gone")
        io = QueueIO(nc, config)
        api = JetStreamApi(nc)
        publisher = Publisher(nc, config.names)
        seqs = [(await publisher.enqueue(request("k", f"r{i}".encode()))).seq for i in range(3)]
        for seq in (seqs[1], seqs[1], seqs[0], seqs[0]):  # between stored messages, then the first
            await io.delete(seq)
        assert not await api.delete_msg(config.names.inbox_stream, seqs[1])  # there was none to delete
        assert [m.seq for m in (await io.read("k", 0, 10))[0]] == [seqs[2]]
        records = [await io.compare_and_set(config.names.lease(f"k{i}"), 0, b"{}", 5) for i in range(3)]
        for seq in (records[1], records[1], records[0], records[0]):
            await io.remove_record(seq)
        assert await io.last_record(config.names.lease("k2")) is not None
        assert await io.last_record(config.names.lease("k1")) is None


async def test_a_consumer_stepdown_ends_each_waiting_pull_with_a_409_leadership_change(
        cluster: EmbeddedCluster) -> None:
    """The server fact the puller's handling of 409 Leadership Change rests on: the new leader of a
    replicated consumer answers every pull request that waited at the old one, each with its own
    409 (the puller asks the new leader at once rather than backing off once per 409)."""
    async with connections(cluster, 1) as [nc]:
        config = await replicated_queue(nc, "stepdown")
        names = config.names
        statuses: asyncio.Queue[Msg] = asyncio.Queue()
        inbox = nc.new_inbox()
        sub = await nc.subscribe(f"{inbox}.*", cb=statuses.put)
        for n in (1, 2, 3):
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{names.token_stream}.{names.consumer}",
                             json.dumps({"batch": 1, "expires": 30 * 10**9}).encode(), reply=f"{inbox}.{n}")
        await nc.flush()
        api = JetStreamApi(nc)
        deadline = time.monotonic() + 10
        while (await api.request(f"CONSUMER.INFO.{names.token_stream}.{names.consumer}")).get("num_waiting") != 3:
            assert time.monotonic() < deadline, "the pull requests never reached the consumer's leader"
            await asyncio.sleep(0.05)
        await api.request(f"CONSUMER.LEADER.STEPDOWN.{names.token_stream}.{names.consumer}")
        answered = []
        with contextlib.suppress(TimeoutError):
            while len(answered) < 3:
                answered.append(await asyncio.wait_for(statuses.get(), 10))
        await sub.unsubscribe()
        assert sorted(msg.subject for msg in answered) == [f"{inbox}.{n}" for n in (1, 2, 3)]
        assert {(msg.headers or {}).get(STATUS) for msg in answered} == {"409"}
        assert {(msg.headers or {}).get(DESCRIPTION) for msg in answered} == {LEADERSHIP_CHANGE}
