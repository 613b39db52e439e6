"""``header_block``: the header block keyqueue hands nats-py is byte for byte the one nats-py builds."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.client import Client
from nats.protocol import command as prot_command

from keyqueue.jetstream.fastpub import header_block


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


def test_what_nats_py_should_judge_is_left_to_it() -> None:
    assert header_block({"X-Bad": "two\r\nlines"}) is None
    assert header_block({"Bad Name": "x"}) is None
    assert header_block({"Colon:Name": "x"}) is None
