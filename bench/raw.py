"""Raw JetStream through nats-py, no exclusivity: the ceiling keyqueue's ratios are taken against.

A work-queue stream on file storage (as keyqueue's own streams are), one pull consumer, subjects
spread over the same keys as the keyed workloads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import nats
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from bench import server_counters
from bench.records import body
from bench.server_counters import PerUnit


@dataclass(frozen=True, slots=True)
class RawRates:
    publish_async: float
    """Pipelined ``publish_async`` to a work-queue stream, msg/s (all acks awaited)."""
    publish_sequential: float
    """One awaited ``js.publish`` at a time, msg/s."""
    fetch_ack: float
    """``fetch(200)`` + ``ack`` per message on a pull consumer, msg/s."""
    server: PerUnit | None = None
    """What the server saw per message, publish and fetch+ack (with a monitoring URL)."""


async def measure(url: str, n: int, keys: int = 100, sequential: int = 2000, *,
                  monitoring: str | Sequence[str] = (), replicas: int = 1) -> RawRates:
    """The raw rates on ``url``; with ``monitoring`` also the server's counters per message (the
    publish and the fetch+ack of it: ``bench.server_counters``), on ``replicas`` replicas."""
    nc = await nats.connect(url.split(","), name="bench-raw")
    js = nc.jetstream(timeout=10)
    server = None
    try:
        await js.add_stream(StreamConfig(name="RAW_WQ", subjects=["raw.>"], retention=RetentionPolicy.WORK_QUEUE,
                                         storage=StorageType.FILE, num_replicas=replicas))
        await _led(js, "RAW_WQ")
        await _accepting(js, "RAW_WQ", "raw.probe")
        subjects = [f"raw.k{i % keys}" for i in range(n)]
        before = await server_counters.snapshot(monitoring) if monitoring else None
        t0 = time.perf_counter()
        acks = [await js.publish_async(subject, body(i)) for i, subject in enumerate(subjects)]
        await js.publish_async_completed()
        publish_async = n / (time.perf_counter() - t0)
        failed = [e for e in (ack.exception() for ack in acks) if e is not None]
        if failed:  # else the fetch below would wait for messages never stored
            raise RuntimeError(f"raw publish_async: {len(failed)} of {n} not stored (first: {failed[0]!r})")

        psub = await js.pull_subscribe("raw.>", durable="raw",
                                       config=ConsumerConfig(max_ack_pending=-1, ack_wait=30))
        await _led(js, "RAW_WQ", "raw")
        got = 0
        t0 = time.perf_counter()
        while got < n:
            try:
                batch = await psub.fetch(200, timeout=5)
            except ServiceUnavailableError:  # the consumer's leader moved: a new one is elected in a moment
                await asyncio.sleep(0.05)
                continue
            for msg in batch:
                await msg.ack()
                got += 1
        await nc.flush()
        fetch_ack = n / (time.perf_counter() - t0)
        if before is not None:
            server = (await server_counters.snapshot(monitoring) - before).per(n)

        sequential = min(sequential, n)
        t0 = time.perf_counter()
        for i in range(sequential):
            await js.publish(subjects[i], body(i))
        publish_sequential = sequential / (time.perf_counter() - t0)
        await js.delete_stream("RAW_WQ")
    finally:
        await nc.close()
    return RawRates(publish_async, publish_sequential, fetch_ack, server)


async def _accepting(js: JetStreamContext, stream: str, subject: str, timeout: float = 30.0) -> None:
    """Return once a publish to ``subject`` is stored (then purge the stream, so the timed loops find
    it empty). On a cluster a stream with a leader can still have no responder for a while on the
    server the client is connected to: the leader's interest in its subjects reaches the other
    servers a moment later (a smoke run in the suite met it: 100 of 100 publishes without one)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.publish(subject, b"", timeout=2)
            break
        except (NoStreamResponseError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    await js.purge_stream(stream)


async def _led(js: JetStreamContext, stream: str, durable: str | None = None, timeout: float = 30.0) -> None:
    """Return once the stream (or its consumer ``durable``) has a leader. On a cluster each replicated
    stream and consumer elects its own leader once created; until then a publish or a pull request
    has no responder (503), which the timed loops must not meet: a fresh cluster in CI took longer
    than the first publish."""
    deadline = time.monotonic() + timeout
    while True:
        info = await (js.consumer_info(stream, durable) if durable else js.stream_info(stream))
        if info.cluster is None or info.cluster.leader:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stream}{'/' + durable if durable else ''} elected no leader in {timeout:g}s")
        await asyncio.sleep(0.05)
