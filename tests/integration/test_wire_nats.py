"""Encoded messages through a real JetStream stream: headers and bodies survive, old versions upgrade."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Self

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from keyqueue.errors import PayloadTooLarge
from keyqueue.wire import (
    CBOR,
    JSON,
    Message,
    Registry,
    decode,
    encode,
    header_block_size,
    header_safe,
    peek,
)
from keyqueue.wire import headers as h

REGISTRY = Registry()


@REGISTRY.register
@dataclass(frozen=True)
class JobV1(Message):
    TYPE = "Job"
    VERSION = 1

    name: str


@REGISTRY.register
@dataclass(frozen=True)
class JobV2(Message):
    TYPE = "Job"
    VERSION = 2

    name: str
    payload: bytes

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, JobV1)
        return cls(name=previous.name, payload=b"")


@REGISTRY.register
@dataclass(frozen=True)
class JobV3(Message):
    TYPE = "Job"
    VERSION = 3

    name: str
    payload: bytes
    priority: int

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, JobV2)
        return cls(name=previous.name, payload=previous.payload, priority=5)


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_messages_of_each_version_and_encoding_survive_jetstream(nats_client: NATS) -> None:
    js = nats_client.jetstream()
    await js.add_stream(StreamConfig(name="WIRE", subjects=["wire.>"]))
    sent = [
        encode(JobV1("old"), reply_inbox="_INBOX.caller.1", traceparent=TRACEPARENT),
        encode(JobV3("cbor", b"\x00\x01\xff", 1), content_type=CBOR),
        encode(JobV2("json", "ünïcode".encode()), content_type=JSON, extra_headers={h.TRACESTATE: "k=v"}),
    ]
    for encoded in sent:
        ack = await js.publish("wire.jobs", encoded.body, headers=encoded.headers)
        assert not ack.duplicate
    # Nats-Msg-Id is the request id, so JetStream deduplicates a re-publish of the same request.
    again = await js.publish("wire.jobs", sent[0].body, headers=sent[0].headers)
    assert again.duplicate

    sub = await js.pull_subscribe("wire.jobs", durable="reader")
    received = await sub.fetch(3, timeout=5)
    for encoded, msg in zip(sent, received, strict=True):
        assert encoded.headers.items() <= (msg.headers or {}).items()
    envelopes = [peek(msg.headers) for msg in received]
    assert [e.request_id for e in envelopes] == [encoded.request_id for encoded in sent]
    assert [(e.content_type, e.version) for e in envelopes] == [(CBOR, 1), (CBOR, 3), (JSON, 2)]
    assert (envelopes[0].reply_inbox, envelopes[0].traceparent) == ("_INBOX.caller.1", TRACEPARENT)
    assert [decode(msg.headers, msg.data, REGISTRY) for msg in received] == [
        JobV3("old", b"", 5),
        JobV3("cbor", b"\x00\x01\xff", 1),
        JobV3("json", "ünïcode".encode(), 5),
    ]
    for msg in received:
        await msg.ack()


async def test_a_message_of_exactly_max_payload_is_accepted(nats_client: NATS) -> None:
    js = nats_client.jetstream()
    limit = nats_client.max_payload
    await js.add_stream(StreamConfig(name="BIG", subjects=["big.>"], max_msg_size=-1))
    # Past 65535 bytes the CBOR length prefix stops growing, so the overhead is a constant.
    overhead = (
        encode(JobV3("big", b"\x00" * 70_000, 1), request_id="01J00000000000000000000000").size - 70_000
    )
    payload = b"\x07" * (limit - overhead)
    fits = encode(JobV3("big", payload, 1), request_id="01J00000000000000000000000", max_payload=limit)
    assert fits.size == limit
    await js.publish("big.one", fits.body, headers=fits.headers)
    stored = await js.get_msg("BIG", 1)
    assert stored.data is not None
    assert decode(stored.headers, stored.data, REGISTRY) == JobV3("big", payload, 1)
    too_big = JobV3("big", payload + b"\x07", 1)
    try:
        encode(too_big, request_id="01J00000000000000000000000", max_payload=limit)
    except PayloadTooLarge as exc:
        assert (exc.size, exc.limit) == (limit + 1, limit)
    else:
        raise AssertionError("a message one byte over max_payload was encoded")


async def test_the_server_counts_headers_against_max_payload_as_encode_does(nats_url: str) -> None:
    # What encode refuses is exactly what the server refuses: one byte more, headers included,
    # and the server drops the connection ("maximum payload exceeded").
    nc = await nats.connect(nats_url, allow_reconnect=False, error_cb=_ignore)
    try:
        headers = {h.MESSAGE_TYPE: "Probe"}
        await nc.publish("probe", b"x" * (nc.max_payload - header_block_size(headers)), headers=headers)
        await nc.flush(timeout=5)
        assert nc.is_connected
        await nc.publish("probe", b"x" * (nc.max_payload - header_block_size(headers) + 1), headers=headers)
        with contextlib.suppress(Exception):
            await nc.flush(timeout=5)
        for _ in range(50):
            if not nc.is_connected:
                break
            await asyncio.sleep(0.1)
        assert not nc.is_connected
    finally:
        await nc.close()


async def _ignore(error: Exception) -> None:
    pass


async def test_header_safe_values_arrive_unchanged(nats_client: NATS) -> None:
    text = header_safe("Traceback:\r\n  ValueError: ünïcode \x00 boom\n" + "x" * 2000)
    got: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_reply(msg: Msg) -> None:
        got.set_result(msg)

    inbox = nats_client.new_inbox()
    await nats_client.subscribe(inbox, cb=on_reply)
    reply = encode(JobV1("reply"), extra_headers={h.STATUS: h.STATUS_ERROR, h.ERROR_MESSAGE: text})
    await nats_client.publish(inbox, reply.body, headers=reply.headers)
    msg = await asyncio.wait_for(got, timeout=5)
    assert msg.headers is not None
    assert msg.headers[h.ERROR_MESSAGE] == text and len(text.encode()) <= 512
    assert msg.headers[h.STATUS] == "error"
    assert decode(msg.headers, msg.data, REGISTRY) == JobV3("reply", b"", 5)
