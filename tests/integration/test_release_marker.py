"""Giving a key back with one write, the release marker (docs/architecture.md, "Giving a key back").

The server facts it rests on are checked first, on the server the tests run (one server here; the
same checks on a 3-node R3 cluster are in test_replicated.py): a rollup with a compare-and-set is
refused when a message arrived after the expected one and leaves every message, and is otherwise
stored alone; a marker with ``Nats-TTL: 1`` goes by itself; an inbox made by an older keyqueue is
given both settings in place. Then the worker: a cold key costs one JetStream API call (the lease
record's removal), not the purge and the re-check of before, and nothing is stranded or run twice; the
tokens released in one turn of the loop are acked with one reply.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from nats.aio.client import Client
from queue_workers import running

from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.jetstream.acks import AckBarrier
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H


async def api_calls(server: EmbeddedServer) -> int:
    """The JetStream API requests the server has handled (``/jsz`` ``api.total``)."""
    def read() -> int:
        with urllib.request.urlopen(f"{server.monitoring_url}/jsz", timeout=5) as reply:
            return int(json.load(reply)["api"]["total"])
    return await asyncio.to_thread(read)


async def subject_messages(nc: Client, config: QueueConfig) -> dict[str, Any]:
    info = await JetStreamApi(nc).request(f"STREAM.INFO.{config.names.inbox_stream}",
                                          {"subjects_filter": config.names.inbox_prefix + ">"})
    return dict(info["state"].get("subjects") or {})


async def enqueue(nc: Client, config: QueueConfig, key: str, tag: str) -> None:
    await Publisher(nc, config.names).enqueue(OutgoingRequest(key, {"Nats-Msg-Id": tag}, tag.encode(), tag))


class Record(BaseProcessor):
    def __init__(self, ran: list[tuple[str, bytes]], wanted: int, done: asyncio.Event) -> None:
        self.ran, self.wanted, self.done = ran, wanted, done

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        self.ran.append((request.key, request.data))
        if len(self.ran) >= self.wanted:
            self.done.set()
        return None


async def until(condition: Any, what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` (a server's state: nothing to await) until it holds."""
    async with asyncio.timeout(timeout):
        while not await condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_the_marker_is_a_purge_and_a_quiescence_check_in_one_write(nc: Client) -> None:
    config = QueueConfig("mark", ack_wait=10)
    await Topology(JetStreamApi(nc), config).ensure()
    io = QueueIO(nc, config)
    for n in range(3):
        await enqueue(nc, config, "k", f"r{n}")
    [first, second, third] = (await io.read("k", 1, 10))[0]
    # A request arrived after the last one handled (here: the second): refused, nothing removed.
    assert await io.mark_released("k", second.seq) is False
    assert [m.seq for m in (await io.read("k", 1, 10))[0]] == [first.seq, second.seq, third.seq]
    # Nothing after the last one handled: stored alone, every request before it removed.
    assert await io.mark_released("k", third.seq) is True
    [marker] = (await io.read("k", 1, 10))[0]
    assert H.is_release_marker(marker.headers)
    # Readers of requests skip it; the key's next request comes after it and is read.
    assert await io.next_request("k", 1, requests_only=True) is None
    assert await io.request_remains("k", 1) is False
    assert await io.last_sequences(["k"]) == {}
    await enqueue(nc, config, "k", "r3")
    assert await io.request_remains("k", 1) is True
    after = await io.next_request("k", 1, requests_only=True)
    assert after is not None and after.data == b"r3" and after.seq > marker.seq
    # The marker goes by itself a second after it was stored (the server's per-message TTL).
    assert await io.mark_released("k2", 0) is True
    await until(lambda: _gone(nc, config, "k2"), "the marker's expiry", timeout=10)


async def _gone(nc: Client, config: QueueConfig, key: str) -> bool:
    return config.names.inbox(key) not in await subject_messages(nc, config)


async def test_an_inbox_made_by_an_older_keyqueue_is_given_the_marker_settings_in_place(
        nc: Client, nats_server: EmbeddedServer) -> None:
    config = QueueConfig("older", ack_wait=10)
    older = {k: v for k, v in config.inbox_config().items() if k not in ("allow_rollup_hdrs", "allow_msg_ttl")}
    await JetStreamApi(nc).add_stream(older)
    await Topology(JetStreamApi(nc), config).ensure()  # a producer does not change it
    inbox = (await JetStreamApi(nc).stream_info(config.names.inbox_stream))["config"]
    assert not inbox.get("allow_rollup_hdrs") and not inbox.get("allow_msg_ttl")

    ran: list[tuple[str, bytes]] = []
    done = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Record(ran, 5, done), settings=SessionSettings(ack_wait=10))
    async with running(worker):
        for n in range(5):
            await enqueue(nc, config, f"k{n}", f"r{n}")
        await asyncio.wait_for(done.wait(), 20)
        assert worker.io.release_markers
    inbox = (await JetStreamApi(nc).stream_info(config.names.inbox_stream))["config"]
    assert inbox["allow_rollup_hdrs"] and inbox["allow_msg_ttl"]
    assert sorted(ran) == [(f"k{n}", f"r{n}".encode()) for n in range(5)]


async def test_a_cold_key_costs_one_api_call_and_leaves_nothing_behind(
        nc: Client, nats_server: EmbeddedServer) -> None:
    keys = 60
    config = QueueConfig("cold", ack_wait=10)
    await Topology(JetStreamApi(nc), config).ensure()
    io = QueueIO(nc, config)
    # One key has a live marker of a former holder before its request: it is read past, and the
    # key is still given back with its own marker (the compare-and-set takes the marker into account).
    assert await io.mark_released("k0", 0) is True
    ran: list[tuple[str, bytes]] = []
    done = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Record(ran, keys, done),
                         settings=SessionSettings(ack_wait=10, linger=0.0))
    async with running(worker):
        before = await api_calls(nats_server)
        for n in range(keys):
            await enqueue(nc, config, f"k{n}", f"r{n}")
        await asyncio.wait_for(done.wait(), 30)

        await until(lambda: asyncio.sleep(0, not worker.sessions), "every key given back")
        calls = await api_calls(nats_server) - before
    # Each key ran its request once, and its inbox holds nothing but (for a second) its marker.
    assert sorted(ran) == sorted((f"k{n}", f"r{n}".encode()) for n in range(keys))
    for subject, count in (await subject_messages(nc, config)).items():
        assert count == 1, subject
        stored = await io.next_request(config.names.key_of(subject), 1)
        assert stored is not None and H.is_release_marker(stored.headers), subject
    # The lease record's removal, no purge (before the marker: two per key, a purge and the removal).
    assert calls <= keys * 1.1, calls


async def test_tokens_released_in_one_turn_are_acked_with_one_reply_and_all_gone(nc: Client) -> None:
    """One server handles a consumer's acks in order and removes a token before it answers a double
    ack: plain acks, then one double ack, and its reply says every token is gone (a token published
    next on each key is stored, not refused by the released one)."""
    keys = [f"k{n}" for n in range(200)]
    config = QueueConfig("acks", ack_wait=30)
    await Topology(JetStreamApi(nc), config).ensure()
    io = QueueIO(nc, config)
    for key in keys:
        assert await io.schedule(key)
    pull = f"$JS.API.CONSUMER.MSG.NEXT.{config.names.token_stream}.{config.names.consumer}"
    tokens = []
    sub = await nc.subscribe(nc.new_inbox())
    await nc.publish(pull, json.dumps({"batch": len(keys), "expires": 5_000_000_000}).encode(), reply=sub.subject)
    while len(tokens) < len(keys):
        msg = await sub.next_msg(timeout=5)
        key = config.names.key_of(msg.subject)
        tokens.append(Token(key, msg.subject, msg.reply, msg.metadata.sequence.stream, 1, time.monotonic()))
    await sub.unsubscribe()
    replies = 0
    double_ack = io._double_ack

    async def counted(subject: str, timeout: float) -> None:
        nonlocal replies
        replies += 1
        await double_ack(subject, timeout)
    io._double_ack = counted  # type: ignore[method-assign]
    io.acks = AckBarrier(io._plain_ack, io._double_ack)
    await asyncio.gather(*(io.release_token(token) for token in tokens))
    assert replies == 1
    refused = [key for key in keys if not await io.schedule(key)]
    assert refused == []


async def test_a_queue_with_a_backlog_cap_gives_keys_back_without_markers(nc: Client) -> None:
    """A marker counts toward a per-key backlog cap for its second: with a cap of one, a key given back
    with one would refuse its next request. Such a queue keeps the purge and the re-check."""
    config = QueueConfig("capped", ack_wait=10, max_backlog_per_key=1)
    ran: list[tuple[str, bytes]] = []
    done = asyncio.Event()
    worker = QueueWorker(nc, config, lambda key: Record(ran, 2, done), settings=SessionSettings(ack_wait=10))
    async with running(worker):
        assert not worker.io.release_markers
        await enqueue(nc, config, "k", "r0")
        async with asyncio.timeout(20):
            while worker.counts.get("released", 0) < 1:  # noqa: ASYNC110 (the key given back)
                await asyncio.sleep(0.01)
        await enqueue(nc, config, "k", "r1")  # at once: its one slot is free
        await asyncio.wait_for(done.wait(), 20)
    assert ran == [("k", b"r0"), ("k", b"r1")]


async def test_a_request_that_carries_the_marker_header_is_still_a_request(nc: Client) -> None:
    """Anything on the wire may carry any header: a request (it has a request id) that also says
    ``X-KQ-Released`` is read, re-checked and run as a request, never skipped as a marker."""
    config = QueueConfig("forged", ack_wait=10)
    await Topology(JetStreamApi(nc), config).ensure()
    io = QueueIO(nc, config)
    await Publisher(nc, config.names).enqueue(OutgoingRequest("k", {"Nats-Msg-Id": "r0", H.RELEASED: "1"}, b"x", "r0"))
    stored = await io.next_request("k", 1, requests_only=True)
    assert stored is not None and not H.is_release_marker(stored.headers)
    assert await io.request_remains("k", 1) is True
    assert await io.last_sequences(["k"]) == {"k": stored.seq}
