"""Reading a stream back without the plugin's own reader, to check what the plugin wrote."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from keyqueue.wire import loads_map


async def stream_messages(url: str, stream: str) -> list[tuple[int, str, dict[str, str], dict[str, Any]]]:
    """(seq, subject, headers, decoded CBOR body) of every message in ``stream``, in order."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        total = info.state.messages
        sub = await js.pull_subscribe("", stream=stream, config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, mem_storage=True))
        out: list[tuple[int, str, dict[str, str], dict[str, Any]]] = []
        while len(out) < total:
            for msg in await sub.fetch(min(1000, total - len(out)), timeout=5):
                headers = dict(msg.headers or {})
                out.append((msg.metadata.sequence.stream, msg.subject, headers,
                            loads_map(msg.data, headers.get("X-CONTENT-TYPE", "application/cbor"))))
        return out
    finally:
        await nc.close()


async def message_count(url: str, stream: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


def run(coro: Any) -> Any:
    """Run one coroutine to completion from a synchronous test."""
    return asyncio.run(coro)
