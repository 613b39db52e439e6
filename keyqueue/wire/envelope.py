"""A message with its headers: encode for publishing, peek and decode on receipt.

``peek`` reads the headers alone and rejects what this process cannot handle before the body is
touched; ``decode`` then reads the body as the received version's class and upgrades it to the
latest version. Header names are matched exactly first, then in any letter case.

Strictness: ``X-CONTENT-TYPE``, ``X-MESSAGE-TYPE``, ``X-MESSAGE-VERSION`` and ``Nats-Msg-Id``
are all required (``MissingHeader``); a missing content type is not taken to mean CBOR, since
keyqueue always writes it and guessing would turn a foreign message into a ``MalformedBody``.
Media-type parameters and letter case are ignored (``application/json; charset=utf-8`` is JSON).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from keyqueue.errors import (
    ConfigError,
    MissingHeader,
    PayloadTooLarge,
    UnsupportedContentType,
    UnsupportedVersion,
)
from keyqueue.wire.codec import CONTENT_TYPES, dumps, loads_map
from keyqueue.wire.fields import from_fields, to_fields
from keyqueue.wire.headers import (
    CBOR,
    CONTENT_TYPE,
    MESSAGE_TYPE,
    MESSAGE_VERSION,
    MSG_ID,
    REPLY_INBOX,
    TRACEPARENT,
)
from keyqueue.wire.message import Message, Registry, new_request_id

__all__ = [
    "Encoded",
    "Envelope",
    "decode",
    "decode_envelope_fields",
    "encode",
    "header_block_size",
    "peek",
]

_VERSION: Final = re.compile(r"[1-9][0-9]{0,17}")
# Header names as nats-py accepts them (RFC 7230 tokens).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE: Final = re.compile(r"[^\x00-\x1f\x7f]*")
_CORE_HEADERS: Final = frozenset(
    name.lower() for name in (CONTENT_TYPE, MESSAGE_TYPE, MESSAGE_VERSION, MSG_ID, REPLY_INBOX, TRACEPARENT)
)
_NATS_HEADER_LINE: Final = len(b"NATS/1.0\r\n")
_CONTENT_TYPE_FOLDED: Final = CONTENT_TYPE.lower()
_MESSAGE_TYPE_FOLDED: Final = MESSAGE_TYPE.lower()
_MESSAGE_VERSION_FOLDED: Final = MESSAGE_VERSION.lower()
_MSG_ID_FOLDED: Final = MSG_ID.lower()
_REPLY_INBOX_FOLDED: Final = REPLY_INBOX.lower()
_TRACEPARENT_FOLDED: Final = TRACEPARENT.lower()


@dataclass(frozen=True)
class Encoded:
    """A message ready to publish: pass ``headers`` and ``body`` to the publish call as they are."""

    headers: dict[str, str]
    body: bytes
    request_id: str

    @property
    def size(self) -> int:
        """Bytes this message counts against the server's ``max_payload``: headers plus body."""
        return header_block_size(self.headers) + len(self.body)


@dataclass(frozen=True)
class Envelope:
    """What the headers of a received message say, checked; the body is not read."""

    content_type: str
    message_type: str
    version: int
    request_id: str
    reply_inbox: str | None = None
    traceparent: str | None = None


def encode(
    msg: Message,
    *,
    content_type: str = CBOR,
    request_id: str | None = None,
    reply_inbox: str | None = None,
    traceparent: str | None = None,
    extra_headers: Mapping[str, str] | None = None,
    max_payload: int | None = None,
) -> Encoded:
    """Encode ``msg`` with every header of the wire format.

    ``request_id`` becomes ``Nats-Msg-Id`` (a new ULID if not given). ``extra_headers`` may not
    repeat a header ``encode`` sets. With ``max_payload`` (the server's limit, e.g.
    ``nc.max_payload``), a message whose headers plus body exceed it raises ``PayloadTooLarge``
    here, before anything is published. A bad header name or value is a ``ConfigError``; a
    field value that does not fit its annotation is a ``MalformedBody``.
    """
    cls = type(msg)
    if not isinstance(msg, Message) or not hasattr(cls, "TYPE") or not hasattr(cls, "VERSION"):
        raise ConfigError(f"encode needs a Message subclass with TYPE and VERSION, got {cls.__qualname__}")
    if content_type not in CONTENT_TYPES:
        raise UnsupportedContentType(content_type, CONTENT_TYPES)
    request_id = new_request_id() if request_id is None else request_id
    headers = {
        CONTENT_TYPE: content_type,
        MESSAGE_TYPE: cls.TYPE,
        MESSAGE_VERSION: str(cls.VERSION),
        MSG_ID: request_id,
    }
    if reply_inbox is not None:
        headers[REPLY_INBOX] = reply_inbox
    if traceparent is not None:
        headers[TRACEPARENT] = traceparent
    for name, value in (extra_headers or {}).items():
        if name.lower() in _CORE_HEADERS:
            raise ConfigError(f"extra_headers may not set {name}: encode sets it from its own arguments")
        headers[name] = value
    for name, value in headers.items():
        _check_header(name, value)
    for name in (MSG_ID, REPLY_INBOX, TRACEPARENT):
        if headers.get(name) == "":
            raise ConfigError(f"{name} may not be empty: leave the argument out instead")
    body = dumps(to_fields(msg, content_type=content_type), content_type)
    encoded = Encoded(headers, body, request_id)
    if max_payload is not None and encoded.size > max_payload:
        raise PayloadTooLarge(encoded.size, max_payload)
    return encoded


def peek(headers: Mapping[str, str] | None) -> Envelope:
    """Check the headers of a received message, without reading its body.

    Raises ``MissingHeader`` for an absent or empty required header, ``UnsupportedContentType``
    and ``UnsupportedVersion`` (a version that is not a positive integer).
    """
    headers = headers or {}
    # Runs for every request a worker takes: look each name up exactly, and fold the names'
    # letter case (one pass over the headers) only for those not found that way.
    get = headers.get
    raw_content_type = get(CONTENT_TYPE)
    message_type = get(MESSAGE_TYPE)
    raw_version = get(MESSAGE_VERSION)
    request_id = get(MSG_ID)
    reply_inbox = get(REPLY_INBOX)
    traceparent = get(TRACEPARENT)
    if None in (raw_content_type, message_type, raw_version, request_id, reply_inbox, traceparent):
        folded: dict[str, str] = {}
        for name, value in headers.items():
            folded.setdefault(name.lower(), value)
        if raw_content_type is None:
            raw_content_type = folded.get(_CONTENT_TYPE_FOLDED)
        if message_type is None:
            message_type = folded.get(_MESSAGE_TYPE_FOLDED)
        if raw_version is None:
            raw_version = folded.get(_MESSAGE_VERSION_FOLDED)
        if request_id is None:
            request_id = folded.get(_MSG_ID_FOLDED)
        if reply_inbox is None:
            reply_inbox = folded.get(_REPLY_INBOX_FOLDED)
        if traceparent is None:
            traceparent = folded.get(_TRACEPARENT_FOLDED)
    if not raw_content_type:
        raise MissingHeader(CONTENT_TYPE)
    content_type = raw_content_type if raw_content_type in CONTENT_TYPES else (
        raw_content_type.split(";", 1)[0].strip().lower())
    if content_type not in CONTENT_TYPES:
        raise UnsupportedContentType(raw_content_type, CONTENT_TYPES)
    if not message_type:
        raise MissingHeader(MESSAGE_TYPE)
    if not raw_version:
        raise MissingHeader(MESSAGE_VERSION)
    if raw_version != "1" and not _VERSION.fullmatch(raw_version):
        error = UnsupportedVersion(message_type, raw_version, 0)
        # UnsupportedVersion's own message names a supported range, which the headers alone
        # cannot know; for a value that is no version at all, say exactly that.
        error.args = (f"{message_type}: {MESSAGE_VERSION} {raw_version!r} is not a positive integer",)
        raise error
    if not request_id:
        raise MissingHeader(MSG_ID)
    return Envelope(content_type, message_type, 1 if raw_version == "1" else int(raw_version), request_id,
                    reply_inbox or None, traceparent or None)


def decode(headers: Mapping[str, str] | None, body: bytes, registry: Registry) -> Message:
    """Decode a received message into the latest registered version of its type.

    Decided from the headers before the body is read: ``MissingHeader``,
    ``UnsupportedContentType``, ``UnknownMessageType`` (listing the known types) and
    ``UnsupportedVersion`` (a version newer than the latest registered one). Then the body is
    read as the received version's class (``MalformedBody``) and upgraded version by version.
    """
    envelope = peek(headers)
    latest = registry.latest(envelope.message_type)
    if envelope.version > latest.VERSION:
        raise UnsupportedVersion(envelope.message_type, envelope.version, latest.VERSION)
    cls = registry.get(envelope.message_type, envelope.version)
    fields = loads_map(body, envelope.content_type)
    return registry.upgrade(from_fields(cls, fields, content_type=envelope.content_type))


def decode_envelope_fields(headers: Mapping[str, str] | None, body: bytes) -> tuple[Envelope, dict[str, Any]]:
    """The checked headers and the body's raw field map, for callers without a registered class.

    The fields are plain values as the codec decodes them: in JSON, ``bytes`` fields are
    still base64 text and ``datetime`` fields ISO 8601 text.
    """
    envelope = peek(headers)
    return envelope, loads_map(body, envelope.content_type)


def header_block_size(headers: Mapping[str, str]) -> int:
    """Size in bytes of ``headers`` as NATS sends them (``NATS/1.0`` line, ``Name: value`` lines)."""
    if not headers:
        return 0
    lines = sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())
    return _NATS_HEADER_LINE + lines + 2


def _check_header(name: str, value: str) -> None:
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        raise ConfigError(f"{name!r} is not a valid header name")
    if not isinstance(value, str) or not _HEADER_VALUE.fullmatch(value) or value != value.strip():
        raise ConfigError(
            f"header {name} has the value {value!r}; header values are single-line strings without "
            "surrounding spaces (see keyqueue.wire.headers.header_safe)"
        )
