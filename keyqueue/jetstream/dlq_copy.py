"""The dead-letter copy of a request: what ``QueueIO.dead_letter`` stores in the DLQ.

A copy that cannot be stored would leave its request neither dead-lettered nor deleted, and its
key stuck behind it. So the copy is built to what nats-py sends and the server accepts:

- *Headers.* The request's own, less those a copy cannot carry as they were, which travel in
  ``X-KQ-DLQ-Escaped-Headers`` (one ASCII JSON object, name to value): a name outside RFC 7230's
  token characters (nats-py raises ``BadHeaderError`` on it, yet the server stores it from other
  clients), a value with CR or LF (nats-py would turn them into spaces) or that is not UTF-8 text,
  a request header named like one of the copy's own, and JetStream's ``Nats-*`` instructions (an
  expected sequence or a TTL meant for the inbox would make the DLQ refuse or expire the copy).
  Then keyqueue's ``X-KQ-DLQ-*`` headers saying why.
- *Ids.* The request id moves to ``X-KQ-DLQ-Request-Id``. The copy's ``Nats-Msg-Id`` is
  ``dlq:<inbox sequence>`` (an unkeyed request's, ``dlq:work-<work stream sequence>``): a copy
  re-sent after a crash is stored once, while two stored requests that share a request id
  (enqueued outside the duplicate window) each get their own copy.
- *Size.* Headers and body together must fit the server's ``max_payload`` (nats-py checks the
  body alone; the server closes the connection of a client that sends more). Producers leave
  :data:`DLQ_HEADROOM` bytes free for the copy's own headers (a larger request is refused at
  enqueue), and a copy that would not fit gives up its diagnostics first (the traceback, then all
  but the start of the error message), so every request keyqueue accepted has a whole, replayable
  copy. Only a request stored by other means can still need its body cut: the copy then keeps as
  much of the body as fits and says ``X-KQ-DLQ-Truncated: <original size>``.
  The body is cut rather than replaced by a reference to the original because the original is
  deleted right after the copy is stored.
- *Last resort.* A minimal copy, keyqueue's own headers and an empty body, when the request's
  headers alone do not fit, or when the server refuses the fuller copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import PayloadTooLarge
from keyqueue.jetstream.api import StoredMsg
from keyqueue.wire import header_block_size
from keyqueue.wire import headers as H

__all__ = ["DEDUPE_PREFIX", "DLQ_HEADROOM", "DeadLetterCopy", "copy_id", "dead_letter_copy", "minimal_dead_letter_copy",
           "work_copy_id"]

DLQ_HEADROOM: Final = 2048
"""Bytes below the server's ``max_payload`` that a request leaves for its dead-letter copy's own
headers (reason, error type, the start of the error message, attempts, original subject and
sequence, time, request id), so that its copy keeps the whole body and can be replayed."""

_SHORT_ERROR: Final = 200
"""Characters of the error message a copy keeps when its diagnostics must make room for the body."""

DEDUPE_PREFIX: Final = "dlq:"
"""Start of a copy's ``Nats-Msg-Id``; the inbox sequence of the request follows."""

JETSTREAM_PREFIX: Final = "nats-"
"""Headers whose names start so (in any letter case) are instructions to JetStream."""

_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name nats-py publishes (RFC 7230 token characters); it raises on any other."""

_KEPT_WHOLE: Final = frozenset({H.MSG_ID})
"""Headers a minimal copy never shortens: the dedupe id must stay exact."""


@dataclass(frozen=True, slots=True)
class DeadLetterCopy:
    """Headers and body to publish to the DLQ: always within ``max_payload``, always sendable."""

    headers: dict[str, str]
    data: bytes
    minimal: bool = False
    """Only keyqueue's own headers and an empty body."""


def copy_id(seq: int) -> str:
    """The ``Nats-Msg-Id`` of the copy of the request at inbox sequence ``seq``."""
    return f"{DEDUPE_PREFIX}{seq}"


def work_copy_id(seq: int) -> str:
    """The ``Nats-Msg-Id`` of the copy of the unkeyed request at work stream sequence ``seq`` (apart
    from the inbox's: the two streams number their messages each on its own)."""
    return f"{DEDUPE_PREFIX}work-{seq}"


def dead_letter_copy(msg: StoredMsg, why: Mapping[str, str], max_payload: int, *,
                     dedupe: str | None = None) -> DeadLetterCopy:
    """The copy of ``msg`` to store in the DLQ, with the ``why`` headers (``X-KQ-DLQ-*``); ``dedupe``
    is its ``Nats-Msg-Id`` (default :func:`copy_id` of its sequence)."""
    own = _own_headers(msg, why, dedupe)
    reserved = {name.lower() for name in (*own, H.DLQ_TRUNCATED, H.DLQ_ESCAPED_HEADERS)}
    id_header = _request_id_header(msg)
    headers: dict[str, str] = {}
    escaped: dict[str, str] = {}
    for name, value in msg.headers.items():
        if name == id_header:
            continue  # in X-KQ-DLQ-Request-Id
        if name.lower() in reserved or name.lower().startswith(JETSTREAM_PREFIX) or not _sendable(name, value):
            escaped[name] = value
        else:
            headers[name] = value
    headers.update(own)
    if escaped:
        headers[H.DLQ_ESCAPED_HEADERS] = json.dumps(escaped, ensure_ascii=True, separators=(",", ":"))
    if header_block_size(headers) + len(msg.data) <= max_payload:
        return DeadLetterCopy(headers, msg.data)
    # The body is what a replay needs: the diagnostics make room for it first.
    headers.pop(H.DLQ_TRACEBACK, None)
    if H.ERROR_MESSAGE in headers:
        headers[H.ERROR_MESSAGE] = H.header_safe(headers[H.ERROR_MESSAGE], _SHORT_ERROR)
    if header_block_size(headers) + len(msg.data) <= max_payload:
        return DeadLetterCopy(headers, msg.data)
    headers[H.DLQ_TRUNCATED] = str(len(msg.data))
    room = max_payload - header_block_size(headers)
    if room < 0:
        return minimal_dead_letter_copy(msg, why, max_payload, dedupe=dedupe)
    return DeadLetterCopy(headers, msg.data[:room])


def minimal_dead_letter_copy(msg: StoredMsg, why: Mapping[str, str], max_payload: int, *,
                             dedupe: str | None = None) -> DeadLetterCopy:
    """A copy of ``msg`` with keyqueue's own headers only (shortened to fit) and an empty body."""
    headers = _own_headers(msg, why, dedupe)
    headers[H.DLQ_TRUNCATED] = str(len(msg.data))
    while (over := header_block_size(headers) - max_payload) > 0:
        name = max((n for n in headers if n not in _KEPT_WHOLE), key=lambda n: len(headers[n].encode()))
        size = len(headers[name].encode())
        if size <= len("..."):
            raise PayloadTooLarge(header_block_size(headers), max_payload)
        headers[name] = H.header_safe(headers[name], max(len("..."), size - over))
    return DeadLetterCopy(headers, b"", minimal=True)


def _own_headers(msg: StoredMsg, why: Mapping[str, str], dedupe: str | None) -> dict[str, str]:
    """The copy's dedupe id, the request id, and the ``why`` headers, each made sendable."""
    id_header = _request_id_header(msg)
    own = {H.MSG_ID: dedupe or copy_id(msg.seq)}
    if id_header is not None and msg.headers[id_header]:
        own[H.DLQ_REQUEST_ID] = msg.headers[id_header]
    own.update(why)
    # keyqueue's own names are tokens; a value it built from an error message may still need care.
    return {name: value if _sendable(name, value) else H.header_safe(value) for name, value in own.items()}


def _request_id_header(msg: StoredMsg) -> str | None:
    """The name under which ``msg`` carries its request id (``Nats-Msg-Id`` in any letter case)."""
    if H.MSG_ID in msg.headers:
        return H.MSG_ID
    return next((name for name in msg.headers if name.lower() == H.MSG_ID.lower()), None)


def _sendable(name: str, value: str) -> bool:
    """Whether nats-py publishes this header as it is (no error, no change but trimming)."""
    if not _TOKEN.fullmatch(name) or "\r" in value or "\n" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
