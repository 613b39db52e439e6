"""The due mover decides by the server's clock, not its host's: movers whose wall clocks run 30 s
slow or fast (the chaos harness's ``skew_wall_clock``, in movers of their own) against a real
nats-server. A due request its key's full backlog refuses is due again a few seconds later by the
server's clock (never in the past, which the server fires at once, again and again), and a later
request of the key never overtakes it, whichever mover's clock reads what."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import nats
import pytest
from command_output import Command
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.due import BACKLOG_FULL_DELAY
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.schedules import DELAYED_REQUEST_ID, DUE, ScheduleStore
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.wire.headers import MSG_ID

QUEUE = "clocks"
KEY = "full"

MOVER = """
import asyncio, signal, sys
import nats
from keyqueue.chaos.clock import skew_wall_clock
from keyqueue.jetstream.due import DueMover

async def main() -> None:
    nc = await nats.connect(sys.argv[1])
    mover = DueMover(nc, sys.argv[2])
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, mover.stop)
    print("moving", flush=True)
    await mover.run()
    await nc.close()

skew_wall_clock(float(sys.argv[3]))
asyncio.run(main())
"""


@dataclass
class Seen:
    """What the movers published, as the server's host saw it arrive (its wall clock is the server's)."""

    again: list[tuple[str, dt.datetime, dt.datetime]] = field(default_factory=list)
    """(request id, when it arrived, its new due time) for each due request scheduled again."""
    parks: int = 0
    tokens: int = 0
    """Token publishes for the key: each follows a request of the key stored (or the key already held)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, done: Callable[[], object], timeout: float = 30) -> None:
        """Wait until ``done()`` holds (the subscriptions' callbacks set ``changed``)."""
        async with asyncio.timeout(timeout):
            while not done():
                self.changed.clear()
                await self.changed.wait()


async def watch(nc: Client, seen: Seen) -> None:
    names = QueueNames(QUEUE)

    async def scheduled(msg: Msg) -> None:
        headers = msg.headers or {}
        if "~again-" in headers.get(MSG_ID, ""):
            seen.again.append((headers[DELAYED_REQUEST_ID], dt.datetime.now(dt.UTC),
                               dt.datetime.fromisoformat(headers[DUE])))
            seen.changed.set()

    async def parked(_: Msg) -> None:
        seen.parks += 1
        seen.changed.set()

    async def token(_: Msg) -> None:
        seen.tokens += 1
        seen.changed.set()

    await nc.subscribe(f"kq.{QUEUE}.at.>", cb=scheduled)
    await nc.subscribe(names.parked(KEY), cb=parked)
    await nc.subscribe(names.token(KEY), cb=token)
    await nc.flush()


@pytest.fixture
async def queue(nats_url: str) -> AsyncIterator[tuple[Client, Seen]]:
    """The queue with a backlog cap of 1, its key ``full`` holding one request nobody runs."""
    nc = await nats.connect(nats_url)
    try:
        await Topology(JetStreamApi(nc), QueueConfig(QUEUE, max_backlog_per_key=1)).ensure()
        store = ScheduleStore(nc, QUEUE)
        await store.ensure()
        await store.ensure_movers()
        seen = Seen()
        await watch(nc, seen)
        publisher = Publisher(nc, QueueNames(QUEUE))
        await publisher.enqueue(OutgoingRequest(KEY, {MSG_ID: "holding"}, b"", "holding"))
        await publisher.close()
        await seen.until(lambda: seen.tokens == 1)
        yield nc, seen
    finally:
        await nc.close()


async def mover(nats_url: str, offset: float) -> Command:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    command = await Command.start(sys.executable, "-c", MOVER, nats_url, QUEUE, str(offset), env=env)
    await command.wait_for("moving")
    return command


async def delay(nc: Client, request_id: str, seconds: float) -> None:
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    await ScheduleStore(nc, QUEUE).delay(KEY, request_id, {}, b"", due)


async def lift_cap(nc: Client) -> None:
    """Room in the key's backlog from now on (as workers running its requests would make)."""
    await Topology(JetStreamApi(nc), QueueConfig(QUEUE)).configure(max_backlog_per_key=0)


async def stored_ids(nc: Client) -> list[str]:
    """The request ids the key's inbox holds, in stream order."""
    found, _ = await JetStreamApi(nc).get_batch(QueueNames(QUEUE).inbox_stream, seq=1,
                                                next_by_subject=QueueNames(QUEUE).inbox(KEY))
    return [m.headers.get(MSG_ID, "") for m in found]


@pytest.mark.parametrize("offset", [-30.0, 30.0], ids=["mover-30s-slow", "mover-30s-fast"])
async def test_a_refused_due_request_is_due_again_seconds_later_by_the_servers_clock(
        nats_url: str, queue: tuple[Client, Seen], offset: float) -> None:
    nc, seen = queue
    skewed = await mover(nats_url, offset)
    try:
        await delay(nc, "first", 0.2)
        await seen.until(lambda: seen.again)
        [(request_id, arrived, due)] = seen.again
        # After the server's now, so it is not fired at once again (and again); no later than the
        # delay after it, as the server counts.
        assert request_id == "first"
        assert arrived < due <= arrived + dt.timedelta(seconds=BACKLOG_FULL_DELAY), (arrived, due)

        await lift_cap(nc)
        await seen.until(lambda: seen.tokens == 2)  # refused, then stored when due again
        assert [r for r, _, _ in seen.again] == ["first"]  # scheduled again once: no churn
        assert await stored_ids(nc) == ["holding", "first"]
    finally:
        assert await skewed.stop() == 0, skewed.output


async def test_a_mover_whose_clock_runs_ahead_lets_no_later_request_overtake_a_parked_one(
        nats_url: str, queue: tuple[Client, Seen]) -> None:
    nc, seen = queue
    # A mover with a true clock parks the key behind its refused request ...
    writer = await mover(nats_url, 0.0)
    try:
        await delay(nc, "first", 0.2)
        await seen.until(lambda: seen.again and seen.parks)
    finally:
        assert await writer.stop() == 0, writer.output
    # ... and one whose clock runs 30 s ahead moves the key's next request, due before the first is
    # due again, when the backlog has room: it must go behind the first.
    await lift_cap(nc)
    reader = await mover(nats_url, 30.0)
    try:
        await delay(nc, "second", 0.2)
        await seen.until(lambda: seen.tokens == 3)  # both stored
    finally:
        assert await reader.stop() == 0, reader.output
    assert await stored_ids(nc) == ["holding", "first", "second"]
