"""Core publishes handed to nats-py as finished commands.

nats-py encodes a message's headers on every publish (validating and joining each line); for
messages sent by the thousand with the same headers (lifecycle events) that is half their cost.
This builds the header block once and hands nats-py the finished ``HPUB`` command; a plain
publish of the worker's own (a read, a token's ack, a record's delete) goes as a ``PUB`` command
the same way. It relies on three of nats-py's internals (``_send_command``, ``_flush_queue``,
``_status``) and falls back to the public ``publish`` if they are missing or the connection is not
plainly connected (reconnecting, draining, closed: nats-py then buffers or refuses as it does).
``tests/unit/test_header_block.py`` checks the commands are the bytes nats-py sends.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from nats.aio.client import Client
from nats.protocol import command as prot_command

from keyqueue.errors import ConfigError
from keyqueue.jetstream.subjects import check_publish_line

_HEADER_NAME: Final = re.compile(r"^[!-9;-~]+$")
_CONNECTED: Final = getattr(Client, "CONNECTED", 1)


class StaticHeaders:
    """A header set encoded once, for :func:`publish_static`."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        block = bytearray(b"NATS/1.0\r\n")
        for name, value in headers.items():
            if not _HEADER_NAME.match(name) or "\r" in value or "\n" in value:
                raise ConfigError(f"header {name!r}: {value!r} cannot be sent")
            block += f"{name}: {value}\r\n".encode()
        block += b"\r\n"
        self.block = bytes(block)
        self.headers = dict(headers)


_LINES: dict[tuple[str, str], str] = {}
"""(name, value) -> its header line, checked and stripped once: most lines of keyqueue's publishes
repeat (a task's content type, message type and version, a status, a TTL); a request id does not."""

_LINES_KEPT: Final = 4096
"""Lines :data:`_LINES` keeps before it starts over (a request id's line is seldom seen twice)."""

_LINE_KEPT_CHARS: Final = 128
"""The longest line :data:`_LINES` keeps: the lines that repeat are short, and a long value (a
caller's own header, an error message) must not be held 4,096 times over."""


def header_block(headers: Mapping[str, str]) -> bytes | None:
    """The header block nats-py would build for ``headers`` (names and values stripped, values as
    UTF-8), or None if a name or value is one it should judge itself (then publish through it)."""
    parts = ["NATS/1.0\r\n"]
    lines = _LINES
    for item in headers.items():
        line = lines.get(item)
        if line is None:
            name, value = item[0].strip(), item[1].strip()
            if not _HEADER_NAME.match(name) or "\r" in value or "\n" in value:
                return None
            line = f"{name}: {value}\r\n"
            if len(line) <= _LINE_KEPT_CHARS:
                if len(lines) >= _LINES_KEPT:
                    lines.clear()
                lines[item] = line
        parts.append(line)
    parts.append("\r\n")
    return "".join(parts).encode()


async def publish_block(nc: Client, subject: str, payload: bytes, block: bytes, headers: Mapping[str, str], *,
                        reply: str = "") -> None:
    """``nc.publish(subject, payload, reply=reply, headers=headers)`` with ``block`` (what
    :func:`header_block` built for ``headers``) as the header block: nats-py builds one line by line
    for every publish, half the cost of a request's publish."""
    check_publish_line(subject, reply)
    if not await _sent(nc, payload, prot_command.hpub_cmd, subject, reply, block):
        await nc.publish(subject, payload, reply=reply, headers=dict(headers))


async def publish_static(nc: Client, subject: str, payload: bytes, headers: StaticHeaders) -> None:
    """Publish like ``nc.publish(subject, payload, headers=...)`` with a pre-encoded header block."""
    check_publish_line(subject)
    if not await _sent(nc, payload, prot_command.hpub_cmd, subject, "", headers.block):
        await nc.publish(subject, payload, headers=headers.headers)


async def publish_plain(nc: Client, subject: str, payload: bytes, reply: str = "") -> None:
    """``nc.publish(subject, payload, reply=reply)`` for a subject keyqueue built or the server gave
    (a token's ack subject): nats-py's own publish checks both with a regular expression and goes
    through three more calls for each of the worker's reads, acks and record deletes."""
    check_publish_line(subject, reply)
    if not await _sent(nc, payload, prot_command.pub_cmd, subject, reply):
        await nc.publish(subject, payload, reply=reply)


async def _sent(nc: Client, payload: bytes, command: Any, *parts: Any) -> bool:
    """Queue ``command(*parts, payload)`` on a plainly connected client as nats-py's publish does
    (its counters, then its flusher woken); False, sending nothing, where nats-py must decide."""
    send = getattr(nc, "_send_command", None)
    if send is None or getattr(nc, "_status", None) != _CONNECTED or len(payload) > nc.max_payload:
        return False
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    await send(command(*parts, payload))
    flush_queue = getattr(nc, "_flush_queue", None)
    if flush_queue is not None and flush_queue.empty():
        await nc._flush_pending()
    return True
