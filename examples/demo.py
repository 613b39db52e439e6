"""keyqueue's demo, on the embedded nats-server: versioned messages, then exclusive ordered work per key.

Run it from the repository root with ``make demo`` (or ``python -m examples.demo``).

Part 1 stores three versions of one message type in a JetStream stream (an old v1 in CBOR, a
v3 in CBOR, a v2 in JSON), reads them back, and upgrades each to the latest version through the
declared chain v1 -> v2 -> v3. A v4 from a newer producer is rejected from its headers alone.

Part 2 runs a worker of keyqueue's core on a queue and enqueues interleaved requests for three
keys: each key's requests run one at a time and in order, while different keys run in parallel.

The demo exits 0 only if every check holds.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Self

from nats.js.api import StorageType, StreamConfig

from keyqueue.core.observer import KeyHold, NullObserver, SessionEnd
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import UnsupportedVersion
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import CBOR, JSON, Message, Registry, decode, encode, from_fields, loads_map, peek
from keyqueue.wire import headers as H

# --- message types: one registry, owned by this app --------------------------------------------

REGISTRY = Registry()


@REGISTRY.register
@dataclass(frozen=True)
class OrderPlacedV1(Message):
    """The first version: which order, and how much (in cents)."""

    TYPE = "OrderPlaced"
    VERSION = 1

    order_id: str
    amount: int


@REGISTRY.register
@dataclass(frozen=True)
class OrderPlacedV2(Message):
    """Adds the currency; every v1 producer sold in euros."""

    TYPE = "OrderPlaced"
    VERSION = 2

    order_id: str
    amount: int
    currency: str

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, OrderPlacedV1)
        return cls(order_id=previous.order_id, amount=previous.amount, currency="EUR")


@REGISTRY.register
@dataclass(frozen=True)
class OrderPlacedV3(Message):
    """Adds when the order was placed; older producers did not record it."""

    TYPE = "OrderPlaced"
    VERSION = 3

    order_id: str
    amount: int
    currency: str
    placed_at: datetime | None

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, OrderPlacedV2)
        return cls(order_id=previous.order_id, amount=previous.amount, currency=previous.currency, placed_at=None)


@REGISTRY.register
@dataclass(frozen=True)
class ChargeV1(Message):
    """One step of work for an order (part 2): steps of one order must run in order."""

    TYPE = "Charge"
    VERSION = 1

    order_id: str
    step: int


# A newer producer's registry: it knows an OrderPlaced v4 that this process has never heard of.
NEWER = Registry()
for _cls in (OrderPlacedV1, OrderPlacedV2, OrderPlacedV3):
    NEWER.register(_cls)


@NEWER.register
@dataclass(frozen=True)
class OrderPlacedV4(Message):
    TYPE = "OrderPlaced"
    VERSION = 4

    order_id: str
    amount: int
    currency: str
    placed_at: datetime | None
    coupon: str | None

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, OrderPlacedV3)
        return cls(previous.order_id, previous.amount, previous.currency, previous.placed_at, coupon=None)


# --- checks ------------------------------------------------------------------------------------


class Checks:
    """Named checks; the demo's exit status is whether all of them held."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
        if not ok:
            self.failed.append(what)


# --- part 1: the wire format -------------------------------------------------------------------


def show(message: Message) -> str:
    """``OrderPlaced v3 {order_id: 'o-1', ...}``, with datetimes in ISO 8601."""
    fields = ", ".join(
        f"{name}: {value.isoformat() if isinstance(value, datetime) else repr(value)}"
        for name, value in vars(message).items()
    )
    return f"{message.TYPE} v{message.VERSION} {{{fields}}}"


async def wire_round(url: str, checks: Checks) -> None:
    print("\n== Part 1: versioned messages through a JetStream stream ==")
    nc = await connect(url)
    try:
        # Plain nats-py here: an encoded message is headers plus a body, for any NATS client.
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="DEMO_WIRE", subjects=["demo.orders.>"], storage=StorageType.MEMORY))
        placed = datetime(2025, 3, 14, 9, 26, 53, tzinfo=UTC)
        sent = [
            encode(OrderPlacedV1("o-1", 1250)),  # an old producer, still running
            encode(OrderPlacedV3("o-2", 4999, "USD", placed), content_type=CBOR),
            encode(OrderPlacedV2("o-3", 300, "GBP"), content_type=JSON),
            encode(OrderPlacedV4("o-4", 80, "EUR", placed, "SPRING"), content_type=CBOR),  # a newer producer
        ]
        for message in sent:
            await js.publish("demo.orders.placed", message.body, headers=message.headers)
        expected = [
            OrderPlacedV3("o-1", 1250, "EUR", None),
            OrderPlacedV3("o-2", 4999, "USD", placed),
            OrderPlacedV3("o-3", 300, "GBP", None),
        ]
        for seq in range(1, len(sent) + 1):
            stored = await js.get_msg("DEMO_WIRE", seq)
            assert stored.data is not None
            envelope = peek(stored.headers)  # the headers alone: can this process read it?
            print(
                f"seq {seq}: {H.MESSAGE_TYPE}={envelope.message_type} {H.MESSAGE_VERSION}={envelope.version} "
                f"{H.CONTENT_TYPE}={envelope.content_type} ({len(stored.data)} byte body)"
            )
            try:
                latest = decode(stored.headers, stored.data, REGISTRY)
            except UnsupportedVersion as exc:
                print(f"        rejected before reading the body: {type(exc).__name__}: {exc}")
                checks.check(seq == 4, f"the v4 message is refused with a typed error (seq {seq})")
                continue
            as_sent = from_fields(
                REGISTRY.get(envelope.message_type, envelope.version),
                loads_map(stored.data, envelope.content_type),
                content_type=envelope.content_type,
            )
            print(f"        as sent:  {show(as_sent)}")
            print(f"        upgraded: {show(latest)}")
            checks.check(latest == expected[seq - 1], f"seq {seq} decodes and upgrades to the expected v3")
        checks.check(
            sent[0].body != sent[2].body and sent[2].body.startswith(b"{"),
            "CBOR and JSON bodies both travel; the JSON one is readable text: " + sent[2].body.decode(),
        )
    finally:
        await nc.close()


# --- part 2: exclusive, ordered work per key ---------------------------------------------------


@dataclass
class Observed:
    """What the processors saw, shared by every key's processor."""

    started: float
    done: list[tuple[str, int, tuple[int, int]]]
    running: set[str]
    max_parallel_keys: int = 0
    overlaps: int = 0


class ChargeProcessor(BaseProcessor):
    """Runs one key's ``Charge`` requests; records order, and any overlap within the key."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        charge = decode(request.headers, request.data, REGISTRY)
        assert isinstance(charge, ChargeV1)
        seen = self.observed
        if request.key in seen.running:
            seen.overlaps += 1  # two processors for one key at once: the promise is broken
        seen.running.add(request.key)
        seen.max_parallel_keys = max(seen.max_parallel_keys, len(seen.running))
        try:
            await asyncio.sleep(0.08 if request.key == "o-1" else 0.03)  # o-1 is a slow key
        finally:
            seen.running.discard(request.key)
        seen.done.append((request.key, charge.step, ctx.fencing))
        print(
            f"  +{time.monotonic() - seen.started:5.2f}s  {request.key} step {charge.step}"
            f"  (inbox seq {request.seq}, fencing {ctx.fencing})"
        )
        return Reply(f"charged {request.key} step {charge.step}".encode())


async def keyed_round(url: str, checks: Checks) -> None:
    print("\n== Part 2: exclusive, ordered work per key ==")
    keys, steps = ["o-1", "o-2", "o-3"], 4
    nc = await connect(url)
    try:
        config = QueueConfig("demo", ack_wait=5)
        await Topology(JetStreamApi(nc), config).ensure()
        observed = Observed(started=time.monotonic(), done=[], running=set())
        events: list[str] = []
        held: set[str] = set()
        all_released = asyncio.Event()

        class HeldKeys(NullObserver):
            """The worker's session steps: track which keys are held, until all work is done."""

            def key_acquired(self, hold: KeyHold) -> None:
                events.append("acquired")
                held.add(hold.key)

            def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
                events.append(end.outcome.value)
                held.discard(hold.key)
                if len(observed.done) == len(keys) * steps and not held:
                    all_released.set()

        worker = QueueWorker(
            nc,
            config,
            lambda key: ChargeProcessor(observed),
            concurrency=4,
            settings=SessionSettings(ack_wait=5, linger=0.2),
            observer=HeldKeys(),
        )
        run = asyncio.create_task(worker.run())
        await worker.started()
        reply_body: bytes | None = None
        try:
            publisher = Publisher(nc, config.names)
            reply_inbox = nc.new_inbox()
            replies = await nc.subscribe(reply_inbox)
            print(f"enqueue {steps} steps for each of {', '.join(keys)}, interleaved; o-2's last step asks for a reply")
            for step in range(1, steps + 1):
                for key in keys:
                    asks = key == "o-2" and step == steps
                    message = encode(ChargeV1(key, step), reply_inbox=reply_inbox if asks else None)
                    await publisher.enqueue(OutgoingRequest(key, message.headers, message.body, message.request_id))
            try:
                reply = await replies.next_msg(timeout=5)
                reply_body = reply.data
                status = reply.headers.get(H.STATUS) if reply.headers else None
                print(f"  reply to o-2 step {steps}: {H.STATUS}={status} body={reply_body.decode()!r}")
            except TimeoutError:
                print(f"  no reply to o-2 step {steps} within 5 s")
            try:
                await asyncio.wait_for(all_released.wait(), timeout=5)
            except TimeoutError:
                print("  timed out waiting for every request to run and every key to be released")
        finally:
            worker.stop()
            await run

        print(
            f"worker events: {events.count('acquired')} key session(s) acquired, "
            f"{events.count('released')} released after {worker.settings.linger}s without new requests"
        )
        checks.check(all_released.is_set(), "every request ran and every key was released in time")
        for key in keys:
            order = [step for k, step, _ in observed.done if k == key]
            checks.check(order == list(range(1, steps + 1)), f"{key} ran its steps in order: {order}")
        fencing_by_key = {key: [f for k, _, f in observed.done if k == key] for key in keys}
        checks.check(
            all(fences == sorted(fences) for fences in fencing_by_key.values()),
            "each key's fencing token (token seq, delivery count) never went backwards",
        )
        checks.check(observed.overlaps == 0, "never two processors for one key at the same time")
        checks.check(
            observed.max_parallel_keys >= 2,
            f"different keys ran in parallel (up to {observed.max_parallel_keys} at once)",
        )
        checks.check(reply_body == f"charged o-2 step {steps}".encode(), "the reply reached its caller")
        # Requests, not messages: a key given back keeps its release marker for a second.
        waiting = await requests_waiting(JetStreamApi(nc), config.names)
        tokens = await JetStreamApi(nc).stream_info(config.names.token_stream)
        checks.check(
            waiting == 0 and tokens["state"]["messages"] == 0,
            "every request was deleted once done, and every key released (inbox and token streams empty)",
        )
    finally:
        await nc.close()


# --- main --------------------------------------------------------------------------------------


async def main() -> int:
    checks = Checks()
    started = time.monotonic()
    async with EmbeddedServer() as server:
        print(f"embedded nats-server with JetStream on {server.url} (store: {server.store_dir})")
        await wire_round(server.url, checks)
        await keyed_round(server.url, checks)
    took = time.monotonic() - started
    if checks.failed:
        print(f"\ndemo FAILED {len(checks.failed)} check(s) in {took:.1f}s: " + "; ".join(checks.failed))
        return 1
    print(f"\ndemo passed every check in {took:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
