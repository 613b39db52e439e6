"""The DLQ against a real nats-server: every dead request gets its copy, and a replay always ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

import keyqueue
from keyqueue.admin.dead_letters import REPLAY_OF, DeadLetter, dead_letters, get_dead_letter, replay
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, dumps, header_block_size
from keyqueue.wire import headers as H

NAMES = QueueNames("shop")


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)
    try:
        yield app
    finally:
        await app.close()


def request_headers(task: str, request_id: str) -> dict[str, str]:
    return {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: task, H.MESSAGE_VERSION: "1", H.MSG_ID: request_id}


async def publish_raw(url: str, subject: str, header_lines: bytes, body: bytes) -> dict[str, Any]:
    """JetStream-publish a header block nats-py refuses to write (other clients write it, the server
    stores it); returns the publish acknowledgement."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    block = b"NATS/1.0\r\n" + header_lines + b"\r\n"
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\nSUB ack 1\r\n')
        writer.write(b"HPUB %s ack %d %d\r\n%s%s\r\n" % (subject.encode(), len(block), len(block) + len(body),
                                                        block, body))
        await writer.drain()
        while not (line := await asyncio.wait_for(reader.readline(), 10)).startswith(b"MSG "):
            assert not line.startswith(b"-ERR"), line
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
        size = int(line.split()[-1])
        ack: dict[str, Any] = json.loads((await reader.readexactly(size + 2))[:size])
    finally:
        writer.close()
        await writer.wait_closed()
    return ack


async def test_a_request_near_max_payload_with_a_long_error_lands_in_the_dlq_cut_to_fit(
    app: keyqueue.App,
) -> None:
    @app.task(key="{k}", max_attempts=1)
    async def ingest(k: str, blob: str) -> None:
        raise ValueError("this error message is long: " + "e" * 1000)

    @app.task(key="{k}")
    async def echo(k: str) -> str:
        return k

    nc = await app.connection()
    await echo.enqueue(k="warm-up")  # creates the queue's streams
    headers = request_headers("ingest", "big-1")
    room = nc.max_payload - header_block_size(headers) - len(dumps({"k": "k", "blob": ""}, CBOR))
    body = dumps({"k": "k", "blob": "b" * (room - 64)}, CBOR)
    assert nc.max_payload - 64 <= header_block_size(headers) + len(body) < nc.max_payload  # the request fits
    await Publisher(nc, NAMES).enqueue(OutgoingRequest("k", headers, body, "big-1"))
    async with app.worker():
        assert await echo.options(timeout=15).call(k="k") == "k"  # behind it on the same key
    [letter] = await dead_letters(JetStreamApi(nc), "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_type) == ("big-1", "max-attempts", "ValueError")
    assert letter.error_message.startswith("this error message is long: eee")
    assert letter.truncated_from == len(body) and body.startswith(letter.data) and len(letter.data) > room // 2
    assert header_block_size(letter.headers) + len(letter.data) <= nc.max_payload
    assert letter.headers[H.MESSAGE_TYPE] == "ingest"
    skipped: list[DeadLetter] = []
    assert await replay(JetStreamApi(nc), Publisher(nc, NAMES), "shop", on_skipped=skipped.append) == 0
    assert [d.seq for d in skipped] == [letter.seq]  # a cut body is not replayed: it stays in the DLQ
    assert [d.seq for d in await dead_letters(JetStreamApi(nc), "shop")] == [letter.seq]


async def test_a_request_with_a_header_nats_py_refuses_lands_in_the_dlq_with_the_header_escaped(
    app: keyqueue.App, nats_url: str
) -> None:
    @app.task(key="{k}")
    async def check(k: str, ok: bool) -> bool:
        if not ok:
            raise keyqueue.Reject("not ok")
        return ok

    nc = await app.connection()
    await check.enqueue(k="warm-up", ok=True)  # creates the queue's streams
    lines = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode())
                     for name, value in request_headers("check", "odd-1").items())
    ack = await publish_raw(nats_url, NAMES.inbox("k"), lines + b"X-Odd(name): kept\r\n",
                            dumps({"k": "k", "ok": False}, CBOR))
    assert ack["stream"] == NAMES.inbox_stream
    await Publisher(nc, NAMES).schedule("k")
    async with app.worker():
        assert await check.options(timeout=15).call(k="k", ok=True) is True  # behind it on the same key
    [letter] = await dead_letters(JetStreamApi(nc), "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_message) == ("odd-1", "rejected", "not ok")
    assert json.loads(letter.headers[H.DLQ_ESCAPED_HEADERS]) == {"X-Odd(name)": "kept"}
    assert letter.body() == {"k": "k", "ok": False}


async def test_a_copy_the_dlq_refuses_is_stored_minimal_and_the_key_goes_on(app: keyqueue.App) -> None:
    @app.task(key="{k}")
    async def check(k: str, note: str) -> str:
        if note:
            raise keyqueue.Reject("notes are not accepted")
        return k

    nc = await app.connection()
    await check.enqueue(k="warm-up", note="")  # creates the queue's streams
    api = JetStreamApi(nc)
    config = (await api.stream_info(NAMES.dlq_stream))["config"]
    await api.request(f"STREAM.UPDATE.{NAMES.dlq_stream}", {**config, "max_msg_size": 2048})
    await check.options(request_id="long-note").enqueue(k="k", note="n" * 4096)
    async with app.worker():
        assert await check.options(timeout=15).call(k="k", note="") == "k"  # behind it on the same key
    [letter] = await dead_letters(api, "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_message) == ("long-note", "rejected",
                                                                        "notes are not accepted")
    assert letter.data == b"" and letter.truncated_from is not None and letter.truncated_from > 4096
    assert H.MESSAGE_TYPE not in letter.headers  # only keyqueue's own headers


async def test_two_requests_with_one_request_id_both_land_in_the_dlq_and_replay_under_it(
    app: keyqueue.App,
) -> None:
    app.configure_queue(keyqueue.QueueConfig("shop", duplicate_window=0.5))

    @app.task(key="{k}", max_attempts=1)
    async def fail(k: str, n: int) -> None:
        raise ValueError(f"fail {n}")

    @app.task(key="{k}")
    async def echo(k: str) -> str:
        return k

    same = fail.options(request_id="same")
    await same.enqueue(k="k", n=1)
    # Enqueued again once the inbox has forgotten the id: no event says so, only its window passing
    # (the server drops ids on a timer, so up to about twice the window).
    for _ in range(100):
        if not (await same.enqueue(k="k", n=2)).duplicate:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the inbox still knew the request id 5 s after its 0.5 s duplicate window")
    async with app.worker():
        assert await echo.options(timeout=15).call(k="k") == "k"  # both are dead-lettered by now
    nc = await app.connection()
    api = JetStreamApi(nc)
    letters = await dead_letters(api, "shop")
    assert [(d.request_id, d.error_message) for d in letters] == [("same", "fail 1"), ("same", "fail 2")]
    assert (await get_dead_letter(api, "shop", letters[1].seq)).request_id == "same"  # what `dlq show` prints
    assert await replay(api, Publisher(nc, NAMES), "shop") == 2
    inbox = [await api.get_msg(NAMES.inbox_stream, seq=1, next_by_subject=NAMES.inbox("k"))]
    assert inbox[0] is not None
    inbox.append(await api.get_msg(NAMES.inbox_stream, seq=inbox[0].seq + 1, next_by_subject=NAMES.inbox("k")))
    assert [(m.headers[H.MSG_ID], m.headers[REPLAY_OF]) for m in inbox if m] == [
        (f"same.replay-{letters[0].seq}", "same"), (f"same.replay-{letters[1].seq}", "same")]


async def test_a_replay_ends_at_the_last_dead_request_there_when_it_began(app: keyqueue.App) -> None:
    @app.task(key="{k}", max_attempts=1)
    async def fail(k: str) -> None:
        raise ValueError("still failing")

    nc = await app.connection()
    await fail.enqueue(k="warm-up")  # creates the queue's streams
    arrivals = await nc.subscribe(NAMES.dlq_prefix + ">")
    replayed: list[str] = []

    class DeadAgainAtOnce(Publisher):
        """Returns only once the running worker has dead-lettered the replayed request again."""

        async def enqueue(self, request: OutgoingRequest) -> Enqueued:
            replayed.append(request.request_id)
            assert len(replayed) <= 4, f"replayed a request dead-lettered during the replay: {replayed}"
            stored = await super().enqueue(request)
            await arrivals.next_msg(timeout=10)
            return stored

    async with app.worker():
        for key in ("a", "b", "c"):
            await fail.enqueue(k=key)
        for _ in range(4):
            await arrivals.next_msg(timeout=10)
        api = JetStreamApi(nc)
        assert await asyncio.wait_for(replay(api, DeadAgainAtOnce(nc, NAMES), "shop"), 30) == 4
    letters = await dead_letters(api, "shop")
    assert [d.seq for d in letters] == [5, 6, 7, 8]  # the four replays, dead again, wait for the next replay
    assert all(d.request_id.startswith(d.headers[REPLAY_OF] + ".replay-") for d in letters)
