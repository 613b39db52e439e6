"""The connection's read path for keyqueue's own subscriptions: parsed and handed on at once.

nats-py reads every message the same way: a regular expression per protocol line (two for a
message with headers, which the plain pattern is tried on first), a dict of the line's fields, a
coroutine for the message and another for its headers, then the subscription's checks (JetStream
flow control, old-style request futures, the slow-consumer limit) before the message is queued. A
cold key brings its worker eight or so messages (its token, the replies to its acquire, its first
read, its release marker and its record's delete): that path cost as much per message as
keyqueue's own handling of it.

:class:`LeanParser` takes nats-py's place on keyqueue's connections (``KeyqueueClient``). It reads
``MSG`` and ``HMSG`` lines by splitting them, and a message for a subscription whose queue is a
:class:`~keyqueue.jetstream.mux.SyncDispatch` (the request muxes' replies, the token pulls) is
built and handed to it right there, headers read once (:func:`read_headers`), with no coroutine.
Every other message goes through nats-py's own ``_process_msg``, and every other protocol line
(``PING``, ``PONG``, ``INFO``, ``+OK``, ``-ERR``) through nats-py's own parser, unchanged.

**Anything read from the wire is hostile.** A publisher that is not keyqueue can write a subject
or a reply subject that is not UTF-8 (nats-server takes any bytes but spaces), and a header block
whose status line is not UTF-8. nats-py raises on either while building the message, in its read
loop, and the connection drops: one core publish on ``kq.<queue>.cancel.<bytes>`` (every worker
subscribes to that wildcard) dropped every worker's connection, and a token on such a subject did
so to worker after worker as it was redelivered. Here such a subject is read with its bad bytes
written as ``\\xNN`` escapes (:func:`readable_subject`), logged at WARNING, and the message is
delivered as any other: a token names a key nobody writes (its session finds nothing and gives
the key back), a request or a record is dead-lettered or ignored by the rules that already apply
to what it says. ``KeyqueueClient`` reads every header block with :func:`read_headers`, and
passes every message nats-py builds through :func:`readable_subject` first.

What it relies on in nats-py 2.x (``nats/protocol/parser.py``, ``nats/aio/client.py``): the
client's ``_ps`` parser with ``buf``, ``state``, ``needed``, ``header_needed`` and ``msg_arg``; its
``_subs`` by sid; a subscription's ``_pending_queue``, ``_jsi``, ``_future``, ``_max_msgs`` and
``_received``; the client's ``stats`` and ``msg_class`` (``Msg``, its fields in order); how
``_process_headers`` reads a status line. ``tests/unit/test_inbound.py`` checks each against the
installed nats-py, so an upgrade that changes them fails loudly rather than misreading messages.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Final

from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, MAX_CONTROL_LINE_SIZE, Parser

__all__ = ["LeanParser", "parse_header_lines", "read_headers", "readable_subject"]

log = logging.getLogger("keyqueue.connection")

_HEADER_LINE: Final = b"NATS/1.0"
_STATUS: Final = "Status"
_DESCRIPTION: Final = "Description"

_ASCII_SPACE: Final = " \t\n\r\x0b\x0c"
"""What ``bytes.strip()`` strips."""

_SPACE_IN_NAME: Final = re.compile("[\t\n\x0b\x0c\r\x1c-\x1f ]")
"""The ASCII characters for which ``str.isspace()`` is true."""


UNREADABLE_LOG_INTERVAL: Final = 10.0
"""Seconds between two warnings about subjects that are not UTF-8 (the ones between are counted)."""

_unreadable = {"count": 0, "logged": -UNREADABLE_LOG_INTERVAL}


def readable_subject(raw: bytes) -> bytes:
    """``raw`` if it is UTF-8 (any subject keyqueue or a NATS client library writes), else the same
    bytes with each one that is not part of a UTF-8 character written as a ``\\xNN`` escape, so
    that nats-py can decode it; logged at WARNING (at most every :data:`UNREADABLE_LOG_INTERVAL`
    seconds). Callers test ``raw.isascii()`` first: the usual subject costs nothing more."""
    try:
        raw.decode()
    except UnicodeDecodeError:
        readable = raw.decode(errors="backslashreplace").encode()
        _unreadable["count"] += 1
        now = time.monotonic()
        if now - _unreadable["logged"] >= UNREADABLE_LOG_INTERVAL:
            log.warning("received a message on a subject that is not UTF-8 (%d since the last warning), read as "
                        "%s: a publisher other than keyqueue wrote it; it is handled under that name",
                        _unreadable["count"], readable[:200].decode())
            _unreadable["count"], _unreadable["logged"] = 0, now
        return readable
    return raw


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """The ``Name: value`` lines of a NATS header block as a dict, exactly as nats-py 2.16 reads them.

    nats-py skips lines without a colon and names that are not ASCII or hold whitespace, strips
    names and values, decodes values as UTF-8 with replacement, and keeps the last of repeated
    names. It does so line by line in bytes, testing each character of each name; this decodes an
    ASCII block (every block keyqueue writes) once and tests a name with one regular expression.
    (Two regular expressions over the whole block, one to check it and one to pick its names and
    values, took longer than this loop for a direct get's nine lines.)
    ``tests/unit/test_connect_headers.py`` checks both give the same on tricky input.
    """
    if not raw.isascii():
        return _parse_header_lines_bytes(raw)
    out: dict[str, str] = {}
    for line in raw.decode("ascii").split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name = name.strip(_ASCII_SPACE)
        # A printable name holds no whitespace but the space (the usual case, tested without the
        # regular expression); any other is tested with it.
        if (" " not in name) if name.isprintable() else _SPACE_IN_NAME.search(name) is None:
            out[name] = value.strip(_ASCII_SPACE)
    return out


def _parse_header_lines_bytes(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _SPACE_IN_NAME.search(key) is None:
            out[key] = value.strip().decode("utf-8", "replace")
    return out


def read_headers(block: bytes) -> dict[str, str] | None:
    """A message's header block as nats-py's ``Client._process_headers`` reads it (with keyqueue's
    :func:`~keyqueue.jetstream.connect.parse_header_lines`): an inline status (``NATS/1.0 404 No
    Messages``) becomes ``Status`` and ``Description``, the ``Name: value`` lines after it the rest;
    None for a block with neither. One difference: a status line that is not UTF-8 (the server
    writes ASCII; a stored message's own header block can say anything) is read with replacement
    characters, where nats-py raises and its read loop drops the connection."""
    rest = block[len(_HEADER_LINE):]
    if not rest:
        return None
    headers: dict[str, str] | None = None
    if rest[0] == 0x20:  # an inline status, perhaps with a description and headers after it
        line = block[len(_HEADER_LINE) + 1:]
        status = line[:3].strip().decode(errors="replace")
        description = line[4:len(line) - 4]
        headers = {}
        if status.isdigit():
            headers[_STATUS] = status
        end = rest.find(b"\r\n")
        rest = rest[end + 2:]
        if description:
            end = description.find(b"\r\n")
            if end > 0:
                headers[_DESCRIPTION] = description[:end].decode(errors="replace")
                headers.update(parse_header_lines(description[end + 2:]))
            else:
                headers[_DESCRIPTION] = description.decode(errors="replace")
    if len(rest) <= 2:
        return headers
    lines = parse_header_lines(block[len(_HEADER_LINE) + 2:])
    if headers:
        headers.update(lines)
        return headers
    return lines or None


class LeanParser(Parser):
    """nats-py's protocol parser, with messages read without regular expressions and those of
    keyqueue's synchronously dispatched subscriptions handed on at once (see the module docstring)."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        while buf:
            if self.state == AWAITING_MSG_PAYLOAD:
                needed = self.needed
                if len(buf) < needed + 2:
                    return
                header_size = self.header_needed
                if header_size:
                    block: bytes | None = bytes(buf[:header_size])
                    payload = bytes(buf[header_size:needed])
                    self.header_needed = 0
                else:
                    block = None
                    payload = bytes(buf[:needed])
                del buf[:needed + 2]
                self.state = AWAITING_CONTROL_LINE
                arg = self.msg_arg
                subject, reply = arg["subject"], arg["reply"]
                if not (subject.isascii() and reply.isascii()):
                    subject, reply = readable_subject(subject), readable_subject(reply)
                if not self._hand_on(arg["sid"], subject, reply, payload, block):
                    await self.nc._process_msg(arg["sid"], subject, reply, payload, block)
                continue
            if not (buf.startswith(b"HMSG ") or buf.startswith(b"MSG ")):
                await Parser.parse(self)  # another protocol line: nats-py's own parser reads on
                return
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) >= MAX_CONTROL_LINE_SIZE:
                    await Parser.parse(self)
                return
            fields = bytes(buf[:end]).split()
            self._message_line(fields)
            del buf[:end + 2]
            self.state = AWAITING_MSG_PAYLOAD

    def _message_line(self, fields: list[bytes]) -> None:
        """``MSG <subject> <sid> [reply] <size>`` or ``HMSG <subject> <sid> [reply] <header size> <size>``."""
        sized = 2 if fields[0] == b"HMSG" else 1
        if len(fields) not in (3 + sized, 4 + sized):
            raise ProtocolError("nats: malformed MSG")
        arg = self.msg_arg
        try:
            arg["subject"] = fields[1]
            arg["sid"] = int(fields[2])
            arg["reply"] = fields[3] if len(fields) == 4 + sized else b""
            self.needed = int(fields[-1])
            if sized == 2:
                self.header_needed = int(fields[-2])
        except ValueError:
            raise ProtocolError("nats: malformed MSG") from None

    def _hand_on(self, sid: int, subject: bytes, reply: bytes, payload: bytes, block: bytes | None) -> bool:
        """Hand a message to its subscription's :class:`~keyqueue.jetstream.mux.SyncDispatch`, if it
        has one and nothing else of nats-py's applies to it; False: nats-py must process it."""
        nc: Any = self.nc
        sub = nc._subs.get(sid)
        if sub is None:
            return False
        queue = sub._pending_queue
        handle = getattr(queue, "handle", None)
        if handle is None or sub._jsi is not None or sub._future is not None or sub._max_msgs:
            return False
        stats = nc.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(payload)
        sub._received += 1
        msg = nc.msg_class(nc, subject.decode(), reply.decode(), payload, read_headers(block) if block else None,
                           _sid=sid)
        try:
            handle(msg)
        except Exception:  # a bug: it must not reach nats-py's read loop (the connection would end)
            log.exception("a message on %s could not be handled", msg.subject)
        return True
