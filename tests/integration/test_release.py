"""``keyqueue release``: hand on the keys of a gone worker now, not a lease later, refusing while it looks alive.

Each test makes a holder by hand, as a worker that died right after taking its key would leave it:
its token delivered and never acked, its lease record live, a request waiting behind it. Before,
nothing could move such a key before its lease ran out (here 30 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

from command_output import Command
from nats.aio.client import Client

from keyqueue.admin.release import HolderAlive, release_keys
from keyqueue.app.heartbeat import Heartbeat
from keyqueue.core.lock import KeyLock
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))
ACK_WAIT = 30.0


async def gone_holder(nc: Client, queue: str, key: str, worker: str, *, pid: int = 4242,
                      host: str = "elsewhere") -> tuple[QueueConfig, KeyLock]:
    """A request on ``key`` whose token was delivered to ``worker`` (process ``pid`` on ``host``), which
    wrote its lease record and died."""
    config = QueueConfig(queue, ack_wait=ACK_WAIT)
    await Topology(JetStreamApi(nc), config).ensure_worker(ACK_WAIT)
    await Publisher(nc, config.names).enqueue(OutgoingRequest(key, {"Nats-Msg-Id": f"r-{key}"}, b"x", f"r-{key}"))
    names = config.names
    msg = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{names.token_stream}.{names.consumer}",
                           b'{"batch":1,"expires":2000000000}', timeout=5, old_style=True)
    lock = KeyLock(QueueIO(nc, config), names.lease(key), ACK_WAIT,
                   holder={"worker": worker, "host": host, "pid": pid, "token": msg.metadata.sequence.stream,
                           "ack": msg.reply})
    assert await lock.try_acquire()
    return config, lock


class Log(BaseProcessor):
    def __init__(self, ran: asyncio.Event) -> None:
        self.ran = ran

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.ran.set()
        return None


def environment(url: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}, "KEYQUEUE_URL": url}


async def test_release_refuses_a_fresh_record_then_force_hands_the_key_on_at_once(nc: Client, nats_url: str) -> None:
    config, _ = await gone_holder(nc, "rel", "k1", "gone:1")
    refused = await Command.start(KEYQUEUE, "release", "rel", "k1", env=environment(nats_url))
    assert await refused.wait() == 1
    assert "looks alive" in refused.output and "renewed" in refused.output and "--force" in refused.output
    assert await QueueIO(nc, config).last_record(config.names.lease("k1")) is not None

    forced = await Command.start(KEYQUEUE, "release", "rel", "k1", "--force", env=environment(nats_url))
    assert await forced.wait() == 0, forced.output
    assert "released k1 (held by gone:1 pid 4242, record" in forced.output
    assert "forced): requests waiting, its token handed to the next worker" in forced.output

    ran = asyncio.Event()
    began = time.monotonic()
    worker = QueueWorker(nc, config, lambda key: Log(ran), settings=SessionSettings(ack_wait=ACK_WAIT))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(ran.wait(), ACK_WAIT / 2)  # not after the gone worker's lease
    finally:
        worker.stop()
        await task
    print(f"the released key ran {time.monotonic() - began:.2f}s after a worker started")


async def test_a_live_heartbeat_refuses_and_a_stopped_one_lets_the_release_through(nc: Client) -> None:
    api = JetStreamApi(nc)
    # The holder is this very process (the heartbeat's pid and host), so its heartbeat speaks for it.
    config, _ = await gone_holder(nc, "beat", "k2", "host:7", pid=os.getpid(), host=socket.gethostname())
    beat = Heartbeat(nc, "host:7", {"beat": 1}, used=lambda q: 1)
    await beat.write()
    try:
        await release_keys(api, "beat", worker="host:7")
        raise AssertionError("released a key whose holder's heartbeat is live")
    except HolderAlive as e:
        assert "heartbeat is live" in str(e) and e.released == [] and [s.key for s in e.skipped] == ["k2"]
    await beat.write("stopped")  # the worker said it stopped: gone, whatever its record says
    [released] = await release_keys(api, "beat", worker="host:7")
    assert (released.key, released.worker, released.waiting, released.redelivered) == ("k2", "host:7", True, True)
    assert await QueueIO(nc, config).last_record(config.names.lease("k2")) is None
    assert await release_keys(api, "beat", worker="host:7") == []  # nothing left to release


async def test_a_stopped_process_of_the_same_name_does_not_release_a_live_holder(nc: Client,
                                                                                 nats_url: str) -> None:
    """One heartbeat record per worker name: the process of that name that just stopped wrote the
    last one. Before, its ``stopped`` released every key of the name, among them those of another
    process of that name which renewed its lease record moments ago (here: the holder of k-live)."""
    config, _ = await gone_holder(nc, "twins", "k-gone", "twin", pid=os.getpid(), host=socket.gethostname())
    await gone_holder(nc, "twins", "k-live", "twin", pid=4242, host=socket.gethostname())
    beat = Heartbeat(nc, "twin", {"twins": 1}, used=lambda q: 1)
    await beat.write("stopped")  # the process that held k-gone stopped

    run = await Command.start(KEYQUEUE, "release", "twins", "--worker", "twin", env=environment(nats_url))
    assert await run.wait() == 1, run.output
    assert "released k-gone (held by twin pid" in run.output
    assert "skipped k-live: worker twin (pid 4242 on" in run.output and "renewed its lease record" in run.output
    assert "another process's" in run.output and "--force" in run.output
    io = QueueIO(nc, config)
    assert await io.last_record(config.names.lease("k-live")) is not None  # the live holder keeps its key
    assert await io.last_record(config.names.lease("k-gone")) is None


async def test_a_supervisor_releases_only_the_records_of_the_process_that_died(nc: Client) -> None:
    api = JetStreamApi(nc)
    config, lock = await gone_holder(nc, "pids", "k3", "parent/1")
    assert await release_keys(api, "pids", worker="parent/1", pid=9999, force=True) == []  # another process
    [released] = await release_keys(api, "pids", worker="parent/1", pid=4242, force=True)
    assert released.key == "k3" and released.forced and released.redelivered
    # The handed-back token comes again at once, its delivery count one up (the next holder counts
    # the request the dead one had in hand toward its crash loop, as after any crash).
    msg = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{config.names.token_stream}.{config.names.consumer}",
                           b'{"batch":1,"expires":2000000000}', timeout=5, old_style=True)
    assert msg.metadata.sequence.stream == lock.holder["token"] and msg.metadata.num_delivered == 2


async def test_a_record_without_an_ack_subject_has_its_token_replaced(nc: Client) -> None:
    api = JetStreamApi(nc)
    config, lock = await gone_holder(nc, "old", "k4", "old-worker")
    record = await QueueIO(nc, config).last_record(config.names.lease("k4"))
    assert record is not None
    body = json.loads(record.data)
    del body["ack"]  # written by a worker before the records named their ack subject
    await QueueIO(nc, config).remove_record(record.seq)
    await QueueIO(nc, config).compare_and_set(config.names.lease("k4"), 0, json.dumps(body).encode(), 30)
    [released] = await release_keys(api, "old", key="k4", force=True)
    assert not released.redelivered and released.rescheduled
    token = await api.get_msg(config.names.token_stream, last_by_subject=config.names.token("k4"), direct=False)
    assert token is not None and token.seq != lock.holder["token"]
