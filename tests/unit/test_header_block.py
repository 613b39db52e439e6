"""``header_block`` and ``publish_plain``: the commands keyqueue hands nats-py are byte for byte the ones it builds."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.protocol import command as prot_command

from keyqueue.errors import InvalidSubject
from keyqueue.jetstream import fastpub
from keyqueue.jetstream.fastpub import header_block, publish_plain


async def nats_py_command(headers: dict[str, str]) -> bytes:
    """What nats-py 2.16 sends for a publish with ``headers`` (its own builder, on a client never connected)."""
    sent: list[bytes] = []
    nc: Any = Client()

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))

    nc._send_command = capture
    await nc._send_publish("kq.q.result.x", "_INBOX.r", b"body", 4, headers)
    return sent[0]


@pytest.mark.parametrize("headers", [
    {"X-KQ-Status": "ok", "X-KQ-Request-Id": "01M89J066AXNJ8PWMCCH3FKVBG", "Nats-TTL": "600s"},
    {"Nats-Expected-Last-Subject-Sequence": "0", "X-Padded": "  spaced value  ", "X-Unicode": "d\u00e9j\u00e0 vu"},
])
async def test_the_block_is_the_one_nats_py_builds(headers: dict[str, str]) -> None:
    block = header_block(headers)
    assert block is not None
    assert bytes(prot_command.hpub_cmd("kq.q.result.x", "_INBOX.r", block, b"body")) == await nats_py_command(headers)


async def test_lines_seen_before_give_the_same_block_and_a_new_value_is_judged_anew() -> None:
    headers = {"X-KQ-Status": "ok", "X-KQ-Request-Id": "r1", "Nats-TTL": "600s"}
    first = header_block(headers)
    assert first is not None and header_block(headers) == first  # the second from the lines kept
    assert bytes(prot_command.hpub_cmd("kq.q.result.x", "_INBOX.r", first, b"body")) == await nats_py_command(headers)
    assert header_block({"X-Bad": "one line"}) is not None
    assert header_block({"X-Bad": "two\r\nlines"}) is None  # the name was seen, with another value
    long = {"X-Caller": "v" * 1000}
    assert header_block(long) == header_block(long) == b"NATS/1.0\r\nX-Caller: " + b"v" * 1000 + b"\r\n\r\n"
    assert ("X-Caller", "v" * 1000) not in fastpub._LINES  # a long line is built each time, not kept


def test_what_nats_py_should_judge_is_left_to_it() -> None:
    assert header_block({"X-Bad": "two\r\nlines"}) is None
    assert header_block({"Bad Name": "x"}) is None
    assert header_block({"Colon:Name": "x"}) is None


def connected_client(sent: list[bytes]) -> Any:
    """A nats-py client that takes itself for connected and keeps what it would send."""
    nc: Any = Client()

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))

    nc._send_command = capture
    nc._status = Client.CONNECTED
    nc._max_payload = 1024
    return nc


@pytest.mark.parametrize(("subject", "reply", "payload"), [
    ("$JS.ACK.q_tokens.w.1.2.3.4.5", "", b"+ACK"),
    ("$JS.API.DIRECT.GET.KQ_q_inbox", "_KQ.abc.7", b'{"batch":16,"seq":5,"next_by_subject":"kq.q.in.k"}'),
])
async def test_a_plain_publish_sends_what_nats_py_sends(subject: str, reply: str, payload: bytes) -> None:
    ours: list[bytes] = []
    nc = connected_client(ours)
    await publish_plain(nc, subject, payload, reply)
    theirs: list[bytes] = []
    await connected_client(theirs).publish(subject, payload, reply=reply)
    assert ours == theirs
    assert nc.stats["out_msgs"] == 1 and nc.stats["out_bytes"] == len(payload)


async def test_a_plain_publish_leaves_a_client_not_plainly_connected_to_nats_py() -> None:
    sent: list[bytes] = []
    nc = connected_client(sent)
    nc._status = Client.DRAINING_PUBS  # nats-py refuses a publish now; a command queued by hand would go out
    with pytest.raises(nats.errors.ConnectionDrainingError):
        await publish_plain(nc, "kq.q.x", b"x")
    nc._status = Client.CONNECTED
    with pytest.raises(nats.errors.MaxPayloadError):  # nats-py's own refusal of a payload too big
        await publish_plain(nc, "kq.q.x", b"x" * 2048)
    with pytest.raises(InvalidSubject):  # a line the server would close the connection for
        await publish_plain(nc, "kq.q." + "x" * 5000, b"x")
    assert sent == []
