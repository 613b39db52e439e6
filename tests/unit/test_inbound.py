"""The lean read path hands keyqueue's subscriptions exactly what nats-py's own path would, and
the nats-py internals it relies on are still there (an upgrade that changes them fails here)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import random
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import Parser

from keyqueue.jetstream.connect import KeyqueueClient
from keyqueue.jetstream.inbound import LeanParser, read_headers, readable_subject
from keyqueue.jetstream.mux import SyncDispatch

DIRECT_GET = (b"NATS/1.0\r\nNats-Stream: KQ_q_INBOX\r\nNats-Subject: kq.q.in.c1\r\nNats-Sequence: 12\r\n"
              b"Nats-Time-Stamp: 2026-11-27T22:41:44.136123456Z\r\nNats-Msg-Id: 01J\r\nX-KQ-Task: note\r\n\r\n")
BLOCKS = [
    DIRECT_GET,
    b"NATS/1.0 404 No Messages\r\n\r\n",
    b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 3\r\nNats-Last-Sequence: 12\r\n\r\n",
    b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1016\r\nNats-Last-Stream: 1024\r\n\r\n",
    b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nNats-Pending-Bytes: 0\r\n\r\n",
    b"NATS/1.0 503\r\n\r\n",
    b"NATS/1.0\r\n\r\n",
    b"NATS/1.0\r\nPadded :  value \r\nBad Name: x\r\nCaf\xc3\xa9: y\r\nUtf8: caf\xc3\xa9\r\n\r\n",
]


@pytest.mark.parametrize("block", BLOCKS)
def test_headers_are_read_as_nats_py_reads_them(block: bytes) -> None:
    theirs = asyncio.run(Client()._process_headers(block))
    assert read_headers(block) == theirs


def frames() -> list[bytes]:
    """A stream from the server: replies with and without headers, statuses, a message for an
    ordinary subscription, a token delivery with its ack subject, and the other protocol lines."""
    out: list[bytes] = []
    for block in BLOCKS:
        body = b"" if b" 4" in block[:12] or b" 2" in block[:12] else b"\xa2ak\x62c1ai\x01"
        out.append(b"HMSG _INBOX.mux.%d 5 %d %d\r\n%s%s\r\n" % (len(out), len(block), len(block) + len(body),
                                                                block, body))
    out.append(b'MSG _INBOX.mux.90 5 35\r\n{"stream":"KQ_q_LEASES","seq":4567}\r\n')
    out.append(b"MSG kq.q.tok.c1 6 $JS.ACK.KQ_q_TOKENS.workers.1.100.90.1732747304136123456.3 0\r\n\r\n")
    out.append(b"MSG kq.q.plain 7 11\r\nhello world\r\n")
    out.append(b"HMSG kq.q.plain 7 _INBOX.r.1 %d %d\r\n%sbody\r\n" % (len(DIRECT_GET), len(DIRECT_GET) + 4,
                                                                        DIRECT_GET))
    out.append(b"PING\r\n")
    out.append(b"PONG\r\n")
    out.append(b"+OK\r\n")
    out.append(b"MSG  kq.q.tok.c2   6   $JS.ACK.KQ_q_TOKENS.workers.1.101.91.1.3   0\r\n\r\n")  # odd spacing
    out.append(b"MSG kq.q.tok.gone 99 0\r\n\r\n")  # a subscription that is gone
    return out


def _hand(seen: list[Any], sid: int, msg: Msg) -> None:
    seen.append(("handed", sid, msg))


def client(parser: type[Parser], seen: list[Any]) -> KeyqueueClient:
    nc = KeyqueueClient()
    nc._ps = parser(nc)
    for sid, fast in ((5, True), (6, True), (7, False)):
        sub = Subscription(nc, sid, "x")
        if fast:
            SyncDispatch.install(sub, functools.partial(_hand, seen, sid))
        else:
            sub._pending_queue = asyncio.Queue()
        nc._subs[sid] = sub

    async def ping() -> None:
        seen.append(("ping",))

    async def pong() -> None:
        seen.append(("pong",))

    nc._process_ping = ping  # type: ignore[method-assign]
    nc._process_pong = pong  # type: ignore[method-assign]
    return nc


def fields(msg: Msg) -> tuple[Any, ...]:
    return msg.subject, msg.reply, msg.data, msg.headers, msg.sid


def delivered(parser: type[Parser], chunks: list[bytes]) -> tuple[list[Any], dict[str, int], list[int]]:
    seen: list[Any] = []
    nc = client(parser, seen)

    async def feed() -> list[Any]:
        for chunk in chunks:
            await nc._ps.parse(chunk)
        queued = []
        queue = nc._subs[7]._pending_queue
        while not queue.empty():
            queued.append(("queued", 7, queue.get_nowait()))
        return queued

    queued = asyncio.run(feed())
    out = [(e[0], e[1], fields(e[2])) if len(e) == 3 else e for e in seen + queued]
    return out, dict(nc.stats), [nc._subs[s]._received for s in (5, 6, 7)]


def test_the_lean_parser_delivers_what_nats_py_delivers_however_the_bytes_are_cut() -> None:
    stream = b"".join(frames())
    expected = delivered(Parser, [stream])
    handed = [e for e in expected[0] if e[0] == "handed"]
    assert len(handed) == len(BLOCKS) + 3 and ("ping",) in expected[0]
    rng = random.Random(7)
    cuts = [[stream], [stream[i:i + 1] for i in range(len(stream))]]
    for _ in range(40):
        points = sorted(rng.sample(range(1, len(stream)), rng.randrange(1, 30)))
        cuts.append([stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)])
    for chunks in cuts:
        assert delivered(LeanParser, chunks) == expected


def test_a_malformed_message_line_is_a_protocol_error_as_in_nats_py() -> None:
    async def parse(parser: type[Parser], line: bytes) -> None:
        nc = KeyqueueClient()
        nc._ps = parser(nc)
        await nc._ps.parse(line)

    from nats.errors import ProtocolError
    for line in (b"MSG a b 5\r\n", b"HMSG a 1 x y\r\n"):
        with pytest.raises(ProtocolError):
            asyncio.run(parse(LeanParser, line))
        with pytest.raises(ProtocolError):
            asyncio.run(parse(Parser, line))


def test_keyqueue_connections_read_with_the_lean_parser() -> None:
    assert isinstance(KeyqueueClient()._ps, LeanParser)


def test_the_nats_py_internals_the_lean_path_relies_on_are_there() -> None:
    # The parser's state, as nats-py's own parse() keeps it (LeanParser shares it with that method).
    parser = Parser(None)
    for name in ("buf", "state", "needed", "header_needed", "msg_arg"):
        assert hasattr(parser, name), name
    source = inspect.getsource(Parser.parse)
    assert "self.nc._process_msg(sid, subject, reply, payload, hdr)" in source
    assert "del self.buf[: self.needed + CRLF_SIZE]" in source
    # The client: its parser, subscriptions by sid, statistics, and what _process_msg looks at
    # before it queues a message (LeanParser hands on only what that path would simply queue).
    client = Client()
    assert isinstance(client._ps, Parser) and isinstance(client._subs, dict)
    assert {"in_msgs", "in_bytes"} <= set(client.stats)
    process = inspect.getsource(Client._process_msg)
    for needed in ('self.stats["in_msgs"] += 1', "sub._received += 1", "sub._max_msgs", "if sub._jsi:",
                   "if sub._future:", "sub._pending_queue.put_nowait(msg)",
                   "msg = self._build_message(sid, subject, reply, data, hdr)"):
        assert needed in process, needed
    assert "self._ps.parse(" in inspect.getsource(Client._read_loop)
    # The server's INFO, as QueueIO.unanswered_removals reads it (its "cluster": the server is in one).
    assert isinstance(client._server_info, dict)
    assert "self._server_info = srv_info" in inspect.getsource(Client)
    sub = Subscription(client, 1, "x")
    for name in ("_pending_queue", "_jsi", "_future", "_max_msgs", "_received"):
        assert hasattr(sub, name), name
    # Msg, built with its fields in this order.
    assert client.msg_class is Msg and KeyqueueClient.msg_class is Msg
    assert [f.name for f in dataclasses.fields(Msg)][:5] == ["_client", "subject", "reply", "data", "headers"]
    assert "_sid" in {f.name for f in dataclasses.fields(Msg)}
    build = inspect.getsource(Client._build_message)
    assert "subject=subject.decode()" in build and "reply=reply.decode()" in build


def test_a_status_line_that_is_not_utf8_is_read_with_replacements_not_a_dropped_connection() -> None:
    # A stored message's own header block reaches a pull subscription as it was published: a
    # producer can write a status-like first line. nats-py raises on one that is not UTF-8, and its
    # read loop then drops the connection; this reads it.
    block = b"NATS/1.0 4\xff4 Bad \xfe\r\nName: v\r\n\r\n"
    with pytest.raises(UnicodeDecodeError):
        asyncio.run(Client()._process_headers(block))
    assert read_headers(block) == {"Description": "Bad \ufffd", "Name": "v"}


def test_a_subject_that_is_not_utf8_is_read_with_escapes_on_every_path_not_a_dropped_connection() -> None:
    # nats-server takes any bytes but spaces in a subject; nats-py raises on one that is not UTF-8
    # while building the message (in its read loop: the connection drops). keyqueue's connections
    # read it with escapes, on the lean path (sid 5), on nats-py's (sid 7), and after a PING, where
    # nats-py's own parser reads the rest of the chunk.
    stream = (b"MSG kq.q.tok.\xff\xfe 5 $JS.ACK.KQ_q_TOKENS.workers.1.7.7.1.0 0\r\n\r\n"
              b"MSG kq.q.cancel.\xff 7 2\r\nhi\r\n"
              b"PING\r\n"
              b"MSG kq.q.ask.r 7 _INBOX.\xc3\x28 0\r\n\r\n"
              b"MSG kq.q.caf\xc3\xa9 7 0\r\n\r\n")  # UTF-8 that is not ASCII: kept as it is
    with pytest.raises(UnicodeDecodeError):
        Client()._build_message(1, b"kq.q.cancel.\xff", b"", b"", None)  # nats-py's own
    for parser in (LeanParser, Parser):
        seen, _, received = delivered(parser, [stream])
        assert [(e[0], e[1], e[2][0], e[2][1]) for e in seen if e[0] != "ping"] == [
            ("handed", 5, "kq.q.tok.\\xff\\xfe", "$JS.ACK.KQ_q_TOKENS.workers.1.7.7.1.0"),
            ("queued", 7, "kq.q.cancel.\\xff", ""),
            ("queued", 7, "kq.q.ask.r", "_INBOX.\\xc3("),
            ("queued", 7, "kq.q.caf\u00e9", ""),
        ], parser
        assert received == [1, 0, 3]
    assert readable_subject(b"kq.q.in.plain") == b"kq.q.in.plain"


def test_keyqueue_connections_read_every_header_block_as_the_lean_path_does() -> None:
    # nats-py's _process_msg reads headers through the client's _process_headers, which
    # KeyqueueClient makes read_headers: a status line that is not UTF-8 drops no connection there.
    assert "hdr = await self._process_headers(headers)" in inspect.getsource(Client._process_msg)
    block = b"NATS/1.0 \xff\xfe\xfd\r\n\r\n"
    assert asyncio.run(KeyqueueClient()._process_headers(block)) == read_headers(block)
