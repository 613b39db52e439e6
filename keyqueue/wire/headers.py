"""Header names and values of keyqueue's wire format (docs/architecture.md, "Wire format").

Every request and reply carries ``X-CONTENT-TYPE``, ``X-MESSAGE-TYPE``, ``X-MESSAGE-VERSION`` and
``Nats-Msg-Id``; a receiver decides from these alone whether it can read the body. Names are
written exactly as below; readers also accept them in another letter case.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from keyqueue.errors import ConfigError

__all__ = [
    "ATTEMPT",
    "CBOR",
    "CONTENT_TYPE",
    "DLQ_ATTEMPTS",
    "DLQ_ERROR_TYPE",
    "DLQ_ESCAPED_HEADERS",
    "DLQ_ORIGINAL_SEQ",
    "DLQ_ORIGINAL_SUBJECT",
    "DLQ_REASON",
    "DLQ_REQUEST_ID",
    "DLQ_TIME",
    "DLQ_TRACEBACK",
    "DLQ_TRUNCATED",
    "ERROR_MESSAGE",
    "ERROR_TYPE",
    "EXPIRES",
    "JSON",
    "KEY",
    "MESSAGE_TYPE",
    "MESSAGE_VERSION",
    "MSG_ID",
    "RELEASED",
    "REPLAY_OF",
    "REPLY_INBOX",
    "REQUEST_ID",
    "STATUS",
    "STATUS_DEAD_LETTERED",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_SUPERSEDED",
    "SUPERSEDED_BY",
    "TASK",
    "TRACEPARENT",
    "TRACESTATE",
    "WORKFLOW_ID",
    "WORKFLOW_QUEUE",
    "WORKFLOW_STEP",
    "header_safe",
    "is_release_marker",
    "message_type_of",
]

# --- every request and reply -------------------------------------------------------------------

CONTENT_TYPE: Final = "X-CONTENT-TYPE"
"""Media type of the body: ``application/cbor`` or ``application/json``."""

MESSAGE_TYPE: Final = "X-MESSAGE-TYPE"
"""Name of the message type (a task name or e.g. ``EnqueueUpdatesRequest``)."""

MESSAGE_VERSION: Final = "X-MESSAGE-VERSION"
"""Version of the message type the body was written as: a positive decimal integer."""

MSG_ID: Final = "Nats-Msg-Id"
"""Request id (a ULID); JetStream also deduplicates publishes on it."""

REPLY_INBOX: Final = "X-Reply-Inbox"
"""Optional core-NATS subject the caller waits on for the result."""

EXPIRES: Final = "X-KQ-Expires"
"""Optional: when a request that has not started by then is dropped instead of run (RFC 3339, UTC,
computed by the producer: ``options(expires=...)``)."""

REPLAY_OF: Final = "X-KQ-Replay-Of"
"""On a request replayed from the dead-letter queue: the request id it was dead-lettered under."""

WORKFLOW_ID: Final = "X-KQ-Workflow-Id"
"""On a workflow step's request: the workflow's id (``wf-...``; ``keyqueue.tasks.canvas``)."""

WORKFLOW_STEP: Final = "X-KQ-Workflow-Step"
"""On a workflow step's request: the step's number in the workflow's plan."""

WORKFLOW_QUEUE: Final = "X-KQ-Workflow-Queue"
"""On a workflow step's request: the queue whose ``KQ_<queue>_WORKFLOWS`` stream holds the workflow's records."""

TRACEPARENT: Final = "traceparent"
"""Optional W3C trace context: the caller's span."""

TRACESTATE: Final = "tracestate"
"""Optional W3C trace context: vendor-specific trace state."""

# --- content types -----------------------------------------------------------------------------

CBOR: Final = "application/cbor"
"""The default body encoding (RFC 8949), limited to plain values."""

JSON: Final = "application/json"
"""The alternative body encoding (RFC 8259), UTF-8, without NaN or Infinity."""

# --- replies -----------------------------------------------------------------------------------

STATUS: Final = "X-KQ-Status"
"""Outcome of a request, on its reply: one of the ``STATUS_*`` values."""

STATUS_OK: Final = "ok"
"""``X-KQ-Status``: the handler returned; the body is its result."""

STATUS_ERROR: Final = "error"
"""``X-KQ-Status``: the handler raised; see ``X-KQ-Error-Type`` and ``X-KQ-Error-Message``."""

STATUS_DEAD_LETTERED: Final = "dead-lettered"
"""``X-KQ-Status``: the request was moved to the dead-letter queue."""

STATUS_SUPERSEDED: Final = "superseded"
"""``X-KQ-Status``: a newer request for the key replaced this one; see ``X-KQ-Superseded-By``."""

ERROR_TYPE: Final = "X-KQ-Error-Type"
"""Class name of the exception a handler raised."""

ERROR_MESSAGE: Final = "X-KQ-Error-Message"
"""The exception's message, made single-line and bounded by ``header_safe``."""

SUPERSEDED_BY: Final = "X-KQ-Superseded-By"
"""Request id of the request that replaced this one."""

REQUEST_ID: Final = "X-KQ-Request-Id"
"""On a reply: the request id (``Nats-Msg-Id``) of the request it answers."""

# --- the key's inbox -----------------------------------------------------------------------------

RELEASED: Final = "X-KQ-Released"
"""On a *release marker*, not a request: the message a worker stores on a key's inbox subject when it
gives the key back with nothing left to do (docs/architecture.md, "Giving a key back"). It rolls up
(removes) the key's handled requests, is stored only if no request arrived after the last one the
worker handled, and expires a second later. Every reader of the inbox skips it."""


def message_type_of(headers: Mapping[str, str]) -> str:
    """A request's ``X-MESSAGE-TYPE``, the header's name in any case (as the wire layer reads it); "" if none."""
    found = headers.get(MESSAGE_TYPE)
    if found is None:
        wanted = MESSAGE_TYPE.lower()
        found = next((v for k, v in headers.items() if k.lower() == wanted), "")
    return found


def is_release_marker(headers: Mapping[str, str] | None) -> bool:
    """Whether a message read from a key's inbox is a release marker (see :data:`RELEASED`). A marker
    carries no request id: a message that has one is a request, whatever else a producer put on it
    (it runs, or is dead-lettered as bad input; it is never skipped)."""
    return headers is not None and RELEASED in headers and MSG_ID not in headers


# --- progress ----------------------------------------------------------------------------------

TASK: Final = "X-KQ-Task"
"""On a progress message and a kept progress record: the task that reported it."""

ATTEMPT: Final = "X-KQ-Attempt"
"""On a progress message and a kept progress record: the attempt that reported it (1 for the first)."""

KEY: Final = "X-KQ-Key"
"""On a kept progress record: the key of the request it belongs to."""

# --- dead-letter queue -------------------------------------------------------------------------

DLQ_REASON: Final = "X-KQ-DLQ-Reason"
"""Why the request was dead-lettered (e.g. retries exhausted, rejected, malformed)."""

DLQ_ERROR_TYPE: Final = "X-KQ-DLQ-Error-Type"
"""Class name of the last error before dead-lettering."""

DLQ_ATTEMPTS: Final = "X-KQ-DLQ-Attempts"
"""How many times the request was delivered before it was dead-lettered."""

DLQ_ORIGINAL_SUBJECT: Final = "X-KQ-DLQ-Subject"
"""Subject the request was stored under before it was dead-lettered."""

DLQ_ORIGINAL_SEQ: Final = "X-KQ-DLQ-Seq"
"""Stream sequence of the request before it was dead-lettered."""

DLQ_TIME: Final = "X-KQ-DLQ-Time"
"""When the request was dead-lettered (RFC 3339, UTC)."""

DLQ_TRACEBACK: Final = "X-KQ-DLQ-Traceback"
"""The last error's traceback, as one ASCII JSON string (a header value is one line); its end is
kept when it is long. Absent for errors that are expected input (``rejected``)."""

DLQ_REQUEST_ID: Final = "X-KQ-DLQ-Request-Id"
"""The request id (``Nats-Msg-Id``) the request was stored under; the copy's own ``Nats-Msg-Id``
is ``dlq:<inbox sequence>``, so two stored requests with one id each get their copy."""

DLQ_TRUNCATED: Final = "X-KQ-DLQ-Truncated"
"""On a copy that is not the whole request: the original body's size in bytes. The body is cut
to fit the server's ``max_payload`` (a minimal copy has none, nor the request's own headers)."""

DLQ_ESCAPED_HEADERS: Final = "X-KQ-DLQ-Escaped-Headers"
"""The request's headers that could not be copied as they were (a name NATS clients refuse, a
value with CR/LF, a JetStream ``Nats-*`` instruction), as one ASCII JSON object."""

# --- values ------------------------------------------------------------------------------------

_CONTROL_RUNS: Final = re.compile(r"[\x00-\x1f\x7f]+")
_ELLIPSIS: Final = "..."


def header_safe(text: str, limit: int = 512) -> str:
    """``text`` as a header value: one line, trimmed, at most ``limit`` bytes of UTF-8.

    Each run of CR, LF or other control characters becomes one space (a raw CR/LF would end
    the header). Longer text is cut at a character boundary and ends with ``...``. Characters
    that cannot be UTF-8 (lone surrogates) become ``?``.
    """
    if limit < len(_ELLIPSIS):
        raise ConfigError(f"header_safe limit must be at least {len(_ELLIPSIS)} bytes, got {limit}")
    line = _CONTROL_RUNS.sub(" ", text).strip()
    encoded = line.encode("utf-8", "replace")
    if len(encoded) <= limit:
        return encoded.decode("utf-8")
    # Cutting bytes may split a character; "ignore" drops the partial one.
    cut = encoded[: limit - len(_ELLIPSIS)].decode("utf-8", "ignore").rstrip()
    return cut + _ELLIPSIS
