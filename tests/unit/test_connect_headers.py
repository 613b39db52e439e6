"""keyqueue's header parser reads every NATS header block exactly as nats-py's own does, only faster."""

from __future__ import annotations

import asyncio
import inspect
import random

import pytest
from nats.aio.client import Client

from keyqueue.jetstream.connect import KeyqueueClient
from keyqueue.jetstream.inbound import parse_header_lines

TRICKY = [
    b"",
    b"\r\n",
    b"Name: value\r\n\r\n",
    b"Nats-Stream: KQ_shop_INBOX\r\nNats-Sequence: 12\r\nX-MESSAGE-TYPE: charge\r\n\r\n",
    b"Name:value\r\nOther:\tvalue with tab \r\n",
    b"  Padded-Name  :   padded value   \r\n",
    b"No colon here\r\nName: v\r\n",
    b"Bad Name: has a space\r\nGood: yes\r\n",
    b"Tab\tName: v\r\nFS\x1cName: v\r\nUS\x1fName: v\r\nEnd\x1f: v\r\n",
    b"Edge: \x1cvalue\x1f\r\n",  # \x1c-\x1f are str whitespace but not bytes whitespace
    b"VT: \x0bvalue\x0c\r\n",
    b"Dup: first\r\nDup: second\r\n",
    b"Colon: a: b: c\r\n",
    b": empty name\r\n",
    b"Empty:\r\n",
    b"Bare\nLF: v\r\n",
    b"Caf\xc3\xa9: non-ASCII name\r\nOk: v\r\n",
    b"Utf8: caf\xc3\xa9 \xe2\x82\xac\r\n",
    b"Broken: \xff\xfe bytes\r\nNext: \xc3\r\n",
    b"\xff: bad name\r\nGood: v\r\n",
    b"Nbsp: \xc2\xa0value\xc2\xa0\r\n",
]


@pytest.mark.parametrize("raw", TRICKY)
def test_the_parser_reads_tricky_blocks_as_nats_py_does(raw: bytes) -> None:
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_the_parser_reads_random_blocks_as_nats_py_does() -> None:
    rng = random.Random(14)
    alphabet = [b"a", b"Z", b"-", b"_", b":", b" ", b"\t", b"\r\n", b"\r", b"\n", b"\x0b", b"\x0c", b"\x1c",
                b"\x1f", b"\x00", b"\x7f", b"\xc3\xa9", b"\xc3", b"\xff", b"\xc2\xa0", b"\xe2\x80\x83"]
    for _ in range(5000):
        raw = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        assert parse_header_lines(raw) == Client._parse_header_lines(raw), raw


@pytest.mark.parametrize("block", [
    b"NATS/1.0\r\nNats-Msg-Id: 01J\r\nX-CONTENT-TYPE: application/cbor\r\n\r\n",
    b"NATS/1.0 404 No Messages\r\n\r\n",
    b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1016\r\nNats-Last-Stream: 1024\r\n\r\n",
    b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 3\r\nNats-Last-Sequence: 12\r\n\r\n",
])
def test_the_client_reads_whole_header_blocks_as_nats_py_does(block: bytes) -> None:
    async def both() -> tuple[object, object]:
        return await KeyqueueClient()._process_headers(block), await Client()._process_headers(block)

    ours, theirs = asyncio.run(both())
    assert ours == theirs


def test_nats_py_still_parses_headers_through_the_overridden_method() -> None:
    # If nats-py renames or stops calling it, the override would silently stop applying.
    assert "self._parse_header_lines(" in inspect.getsource(Client._process_headers)
    assert KeyqueueClient._parse_header_lines is not Client._parse_header_lines
