"""Defects a review found in the key session and worker, each against a real nats-server.

Each test failed on the main before the lease-record change (noted per test) and passes after it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client

from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext, SessionContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import ConfigError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queue_workers import running as running_worker
from test_core_basic import Recorder, request, running, wait_until


async def setup(nc: Client, name: str, ack_wait: float) -> tuple[QueueConfig, Publisher]:
    config = QueueConfig(name, ack_wait=ack_wait)
    await Topology(JetStreamApi(nc), config).ensure()
    return config, Publisher(nc, config.names)


class Slow(BaseProcessor):
    def __init__(self, log: list[str], seconds: float) -> None:
        self.log = log
        self.seconds = seconds

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.log.append(f"start {request.data.decode()} {ctx.fencing[0]}")
        await asyncio.sleep(self.seconds)
        self.log.append(f"end {request.data.decode()}")
        return None


async def test_a_token_redelivered_to_its_holder_is_adopted(nc: Client) -> None:
    """Before: the session was declared lost and the token nak'ed, cutting the handler off and
    running the request again. Now the session keeps its lease record and finishes once."""
    config, pub = await setup(nc, "adopt", ack_wait=1)
    await pub.enqueue(request("k", b"long"))
    log: list[str] = []
    settings = SessionSettings(ack_wait=1, linger=0.05)
    worker = QueueWorker(nc, config, lambda key: Slow(log, 2.5), settings=settings)

    async def no_token_keepalive(token: object) -> None:
        return None  # the token's +WPI never arrives: the server redelivers it after ack_wait

    worker.io.keepalive = no_token_keepalive  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(worker.run())
    await worker.started()
    await wait_until(lambda: "end long" in log and worker.counts.get("released", 0) > 0, timeout=15)
    worker.stop()
    await task
    assert [e for e in log if e.startswith("start")] == [log[0]], f"the request ran again: {log}"
    assert "lease_lost" not in worker.counts
    assert worker.counts["acquired"] == 1


async def test_a_failed_session_gives_the_key_back_at_once(nc: Client) -> None:
    """Before: nothing was acked or nak'ed, so the key waited ack_wait (30 s here)."""
    config, pub = await setup(nc, "fails", ack_wait=30)
    await pub.enqueue(request("k", b"x"))
    opened: list[int] = []
    log: list[tuple[str, bytes]] = []

    class OpenFailsOnce(Recorder):
        async def open(self, ctx: SessionContext) -> None:
            opened.append(1)
            if len(opened) == 1:
                raise RuntimeError("the processor's store is down")

    async with running(nc, config, lambda key: OpenFailsOnce(log),
                       settings=SessionSettings(ack_wait=30, linger=0.05)):
        await wait_until(lambda: log == [("k", b"x")], timeout=10)
    assert len(opened) == 2


async def test_drain_naks_do_not_count_as_crashes(nc: Client) -> None:
    """Before: a token delivered more than crash_loop_limit times dead-lettered the key's head
    request, however the deliveries ended (drain naks, late keepalives)."""
    config, pub = await setup(nc, "naks", ack_wait=5)
    await pub.enqueue(request("k", b"innocent"))
    names = config.names
    for _ in range(3):  # three graceful hand-offs: delivered and nak'ed
        msg = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{names.token_stream}.{names.consumer}",
                               json.dumps({"batch": 1, "expires": 2_000_000_000}).encode(), timeout=3,
                               old_style=True)
        await msg.respond(b"-NAK")
    log: list[tuple[str, bytes]] = []
    async with running(nc, config, lambda key: Recorder(log),
                       settings=SessionSettings(ack_wait=5, linger=0.05, crash_loop_limit=1)) as worker:
        await wait_until(lambda: bool(log), timeout=10)
    assert log == [("k", b"innocent")]
    assert "dead_lettered" not in worker.counts


async def test_one_reconciler_per_queue(nc: Client) -> None:
    """Before: every worker scanned every subject of the queue every interval."""
    config, _ = await setup(nc, "recon", ack_wait=2)
    settings = SessionSettings(ack_wait=2)
    workers = [QueueWorker(nc, config, lambda key: Recorder([]), settings=settings, reconcile_interval=0.2,
                           name=f"w{i}") for i in range(3)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    for w in workers:
        await w.started()
    await wait_until(lambda: sum(w.reconciler.passes for w in workers) >= 5, timeout=10)
    for w in workers:
        w.stop()
    await asyncio.gather(*tasks)
    assert sorted(w.reconciler.passes > 0 for w in workers) == [False, False, True]


def test_a_session_lease_other_than_the_queues_ack_wait_is_refused() -> None:
    """Before: accepted, and a worker could believe it held a key longer than the server did."""
    with pytest.raises(ConfigError, match="ack_wait"):
        QueueWorker(None, QueueConfig("q", ack_wait=30), lambda key: Recorder([]),  # type: ignore[arg-type]
                    settings=SessionSettings(ack_wait=60))


async def test_a_session_cut_off_after_its_ack_still_rechecks(nc: Client) -> None:
    """Before: a session cancelled while its ack was in flight skipped the re-check, stranding a
    request whose token publish had been refused while the old token still existed."""
    config, pub = await setup(nc, "cutoff", ack_wait=5)
    await pub.enqueue(request("k", b"first"))
    log: list[tuple[str, bytes]] = []
    worker = QueueWorker(nc, config, lambda key: Recorder(log), settings=SessionSettings(ack_wait=5, linger=0.01))
    real_release = worker.io.release_token
    at_ack, go, acked = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_ack(token, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        at_ack.set()
        await go.wait()
        await real_release(token, timeout)
        acked.set()
        await asyncio.sleep(1.0)  # the confirmation is slow: the session is cut off meanwhile

    worker.io.release_token = slow_ack  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    await worker.started()
    await asyncio.wait_for(at_ack.wait(), 10)
    second = await pub.enqueue(request("k", b"second"))  # its token publish is refused: ours still exists
    go.set()
    await asyncio.wait_for(acked.wait(), 10)
    worker.stop(now=True)
    await task
    assert log == [("k", b"first")]
    stored = await JetStreamApi(nc).get_msg(config.names.inbox_stream, seq=second.seq)
    assert stored is not None, "the second request should still be waiting"
    tokens = await JetStreamApi(nc).stream_info(config.names.token_stream)
    assert tokens["state"]["messages"] == 1, "the key was left without a token: its request is stranded"


async def _given_back(nc: Client, config: QueueConfig, key: str) -> bool:
    """Whether nothing of the key's session is left: no token, no lease record, and its inbox
    holds at most its release marker."""
    api = JetStreamApi(nc)
    tokens = await api.stream_info(config.names.token_stream)
    record = await QueueIO(nc, config).last_record(config.names.lease(key))
    stored = await QueueIO(nc, config).next_request(key, 1, requests_only=True)
    return tokens["state"]["messages"] == 0 and record is None and stored is None


async def _until_given_back(nc: Client, config: QueueConfig, key: str) -> None:
    """Poll the server (nothing to await) until the key is given back; fails after 10 s."""
    async with asyncio.timeout(10):
        while not await _given_back(nc, config, key):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def _slow_markers(worker: QueueWorker, go: asyncio.Event) -> tuple[list[int], asyncio.Event]:
    """Make the first release marker wait for ``go``; the ``last`` of each marker asked for, and
    an event set once the first is waiting."""
    real = worker.io.mark_released
    asked: list[int] = []
    waiting = asyncio.Event()

    async def mark_released(key: str, last: int, timeout: float | None = None) -> bool:
        asked.append(last)
        if len(asked) == 1:
            waiting.set()
            await go.wait()
        return await real(key, last, timeout)

    worker.io.mark_released = mark_released  # type: ignore[method-assign]
    return asked, waiting


async def _key_with_a_slow_marker(nc: Client, name: str, go: asyncio.Event) -> tuple[
        QueueConfig, Publisher, list[tuple[str, bytes]], QueueWorker, list[int], asyncio.Event]:
    """A queue with one request for key ``k`` and a worker (not started) whose first release marker
    waits for ``go``: the queue, its publisher, what ran, the worker, the markers asked for, and
    an event set once the first waits."""
    config, pub = await setup(nc, name, ack_wait=5)
    await pub.enqueue(request("k", b"first"))
    log: list[tuple[str, bytes]] = []
    worker = QueueWorker(nc, config, lambda key: Recorder(log), settings=SessionSettings(ack_wait=5, linger=0.01))
    asked, waiting = _slow_markers(worker, go)
    return config, pub, log, worker, asked, waiting


async def test_a_stop_now_does_not_cut_off_a_key_being_given_back(nc: Client) -> None:
    """The give-back runs in the session's own task (no task, future and shield per key): a stop
    now or the drain deadline cancels every session but one giving its key back, whose steps are
    each bounded. Before: the session was cancelled and waited for its give-back's own task."""
    go = asyncio.Event()
    config, _, log, worker, asked, waiting = await _key_with_a_slow_marker(nc, "nocut", go)
    task = asyncio.create_task(worker.run())
    await worker.started()
    await asyncio.wait_for(waiting.wait(), 10)
    session = worker.sessions["k"]
    worker.stop(now=True)
    assert session.cancelling() == 0, "a session giving its key back was cancelled"
    go.set()
    await task
    assert log == [("k", b"first")]
    assert len(asked) == 1, f"the give-back began again: {asked}"
    assert await _given_back(nc, config, "k")


async def test_a_session_cut_off_while_giving_its_key_back_gives_it_back_again(nc: Client) -> None:
    """Something other than the worker cancels a session part-way through its give-back (which runs
    in the session's task): the give-back begins again as a task of its own, which the cancel does
    not reach, and the key ends given back (no token, no record left to wait out), then runs its
    next request."""
    config, pub, log, worker, asked, waiting = await _key_with_a_slow_marker(nc, "recut", asyncio.Event())
    async with running_worker(worker):
        await asyncio.wait_for(waiting.wait(), 10)
        session = worker.sessions["k"]
        session.cancel()
        await asyncio.wait([session])
        assert session.cancelled()
        await wait_until(lambda: len(asked) == 2, timeout=10)
        assert asked[0] == asked[1], "the second give-back's marker is not the first's"
        await _until_given_back(nc, config, "k")
        await pub.enqueue(request("k", b"second"))
        await wait_until(lambda: ("k", b"second") in log, timeout=10)
    assert log == [("k", b"first"), ("k", b"second")]


async def test_a_request_its_holders_keep_dying_on_is_dead_lettered(nc: Client) -> None:
    """The other side of the crash-loop count: sessions of redelivered tokens that end without a
    word on the same head request (as a killed worker's do) dead-letter it, and the key goes on."""
    from keyqueue.errors import LeaseLost
    from keyqueue.wire import headers as H

    config, pub = await setup(nc, "dies", ack_wait=1)
    await pub.enqueue(request("k", b"deadly"))
    await pub.enqueue(request("k", b"after"))
    log: list[tuple[str, bytes]] = []

    class DiesOnDeadly(Recorder):
        async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
            if request.data == b"deadly":
                raise LeaseLost("as if the worker died here")  # no ack, no nak, no release
            return await super().handle(ctx, request)

    async with running(nc, config, lambda key: DiesOnDeadly(log),
                       settings=SessionSettings(ack_wait=1, linger=0.05, crash_loop_limit=1)):
        await wait_until(lambda: log == [("k", b"after")], timeout=30)
    dead = await JetStreamApi(nc).get_msg(config.names.dlq_stream, seq=1)
    assert dead is not None and dead.data == b"deadly"
    assert dead.headers[H.DLQ_REASON] == "crash-loop"
