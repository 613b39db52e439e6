"""Requests no keyqueue producer writes, fed to a worker on a real nats-server: each is dead-lettered
(or done) with a reason, and none can close the worker's connection or stop the worker.

A subject longer than the server's max control line closes the connection for good (nats-py does
not reconnect after a protocol error): a worker that replied to such a ``X-Reply-Inbox`` lost its
connection, and the request's token went to the next worker, which lost its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

import keyqueue
from keyqueue.admin.dead_letters import dead_letters
from keyqueue.jetstream import inbound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.fastpub import StaticHeaders, publish_static
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.plugins.manager import hookimpl
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H

NAMES = QueueNames("hostile")


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("hostile", url=nats_url, set_as_default=False, autoload_plugins=False)
    try:
        yield app
    finally:
        await app.close()


def request_headers(task: str, request_id: str, **extra: str) -> dict[str, str]:
    return {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: task, H.MESSAGE_VERSION: "1", H.MSG_ID: request_id, **extra}


async def test_a_reply_inbox_too_long_for_a_subject_is_dead_lettered_and_the_connection_stays_open(
    app: keyqueue.App,
) -> None:
    ran: list[int] = []

    @app.task(key="{k}")
    async def step(k: str, n: int) -> int:
        ran.append(n)
        return n

    nc = await app.connection()
    await step.enqueue(k="warm-up", n=0)  # creates the queue's streams
    inbox = "_INBOX." + "x" * 5120  # over the server's 4 KiB max_control_line
    await Publisher(nc, NAMES).enqueue(OutgoingRequest("k", request_headers("step", "long-inbox", **{
        H.REPLY_INBOX: inbox}), dumps({"k": "k", "n": 1}, CBOR), "long-inbox"))
    async with app.worker():
        # Behind it on the same key, through the worker's own connection (the app's): answered.
        assert await step.options(timeout=20).call(k="k", n=2) == 2
    assert not nc.is_closed and nc.last_error is None
    [letter] = await dead_letters(JetStreamApi(nc), "hostile", key="k")
    assert (letter.request_id, letter.reason, letter.error_type) == ("long-inbox", "rejected", "InvalidSubject")
    assert "max_control_line" in letter.error_message and letter.attempts == 0
    assert ran == [0, 2]  # it never ran: nobody could be told its outcome



async def test_a_publish_line_too_long_for_the_server_is_refused_before_it_is_sent(app: keyqueue.App) -> None:
    nc = await app.connection()
    with pytest.raises(keyqueue.InvalidSubject, match="max_control_line"):
        await nc.publish("kq.hostile." + "s" * 4090, b"")
    with pytest.raises(keyqueue.InvalidSubject, match="max_control_line"):
        await nc.publish("kq.hostile.ask", b"", reply="_INBOX." + "r" * 4050)
    with pytest.raises(keyqueue.InvalidSubject, match="max_control_line"):
        await publish_static(nc, "kq.hostile." + "s" * 4090, b"", StaticHeaders({"X-Kind": "event"}))
    await nc.flush(timeout=5)  # the server still answers: nothing reached it
    assert nc.is_connected and nc.last_error is None


async def raw_publisher(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A bare NATS connection, for bytes no NATS client library writes (a subject that is not UTF-8)."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    assert (await reader.readline()).startswith(b"INFO ")
    writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n')
    return reader, writer


async def test_subjects_and_status_lines_that_are_not_utf8_close_no_worker_connection(
        app: keyqueue.App, nats_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # nats-server takes any bytes but spaces in a subject; nats-py raised on a subject (or a status
    # line) that is not UTF-8 while building the message, in its read loop, and the connection
    # dropped. Every worker subscribes to kq.<queue>.cancel.* and .ask.*: one core publish there
    # dropped them all; a token on such a subject did so to each worker it was delivered to.
    @app.task(key="{k}", result_ttl=60)
    async def step(k: str, n: int) -> int:
        return n

    released: dict[str, asyncio.Event] = {"\\xff\\xfe": asyncio.Event()}

    class Released:
        @hookimpl
        def keyqueue_key_released(self, key: str) -> None:
            if key in released:
                released[key].set()

    app.plugins.register(Released())
    monkeypatch.setattr(inbound, "_unreadable", {"count": 0, "logged": -inbound.UNREADABLE_LOG_INTERVAL})
    nc = await app.connection()
    async with app.worker():
        assert await step.options(timeout=20).call(k="warm-up", n=1) == 1  # the cancel watch is open
        reader, writer = await raw_publisher(nats_url)
        writer.write(b"PUB kq.hostile.cancel.\xff\xfe 0\r\n\r\n")  # a core message to every worker
        writer.write(b"PUB kq.hostile.ask.r2 _INBOX.\xff 0\r\n\r\n")  # a reply subject that is not UTF-8
        status = b"NATS/1.0 \xff\xfe\xfd\r\n\r\n"  # a status line that is not UTF-8
        writer.write(b"HPUB kq.hostile.ask.r1 %d %d\r\n%s\r\n" % (len(status), len(status), status))
        writer.write(b"PUB kq.hostile.tok.\xff\xfe 0\r\n\r\n")  # a token, stored and delivered by a pull
        writer.write(b"PING\r\n")
        await writer.drain()
        assert (await reader.readline()).strip() == b"PONG"
        writer.close()
        assert await step.options(timeout=20).call(k="k2", n=2) == 2
        # The token was delivered, read as kq.hostile.tok.\xff\xfe (escaped), its key given back.
        await asyncio.wait_for(released["\\xff\\xfe"].wait(), 20)
    assert (await JetStreamApi(nc).stream_info(NAMES.token_stream))["state"]["messages"] == 0
    assert nc.stats["reconnects"] == 0 and nc.last_error is None and not nc.is_closed
    assert any("not UTF-8" in r.getMessage() and "\\xff\\xfe" in r.getMessage() for r in caplog.records)
