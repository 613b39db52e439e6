"""Names of a queue's streams, consumer and subjects, and the rules for keys and queue names."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError, InvalidKey, InvalidRequestId

MAX_KEY_LENGTH: Final = 256
"""Longest key accepted, in bytes of UTF-8 (subjects travel in every message's protocol line)."""

CONSUMER_NAME: Final = "workers"
"""The one durable pull consumer on a queue's token stream, shared by every worker."""

MAX_REQUEST_ID_LENGTH: Final = 256
"""Longest request id accepted, in characters (it travels as ``Nats-Msg-Id`` on every copy of a request)."""

_QUEUE_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_REQUEST_ID: Final = re.compile(r"^[\x21-\x7e]+$")
_TOKEN_SAFE_ID: Final = re.compile(r"^[A-Za-z0-9_-]+$")
_FORBIDDEN_IN_TOKEN: Final = re.compile(r"[\s*>.\x00-\x1f\x7f]")


def validate_queue_name(queue: str) -> str:
    """Return ``queue`` if it can name streams and subjects, else raise ConfigError."""
    if not _QUEUE_NAME.match(queue):
        raise ConfigError(
            f"queue name {queue!r} is not valid: use 1-64 letters, digits, '-' or '_' "
            "(it becomes part of stream names and subjects)"
        )
    return queue


def validate_key(key: str) -> str:
    """Return ``key`` if it is one or more valid NATS subject tokens joined by '.', else raise.

    A token may not be empty and may not contain whitespace, control characters or the
    wildcards ``*`` and ``>``.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a string, got {type(key).__name__}")
    if not key:
        raise InvalidKey("key is empty; a key is one or more subject tokens such as 'order-17' or 'w1.cs9'")
    if len(key.encode()) > MAX_KEY_LENGTH:
        raise InvalidKey(f"key is {len(key.encode())} bytes long; the limit is {MAX_KEY_LENGTH}")
    for token in key.split("."):
        if not token:
            raise InvalidKey(f"key {key!r} has an empty token (leading, trailing or doubled '.')")
        bad = _FORBIDDEN_IN_TOKEN.search(token)
        if bad:
            raise InvalidKey(
                f"key {key!r} contains {bad.group()!r}; keys may not contain whitespace, control "
                "characters or the wildcards '*' and '>'"
            )
    return key


def validate_request_id(request_id: str) -> str:
    """Return ``request_id`` if a ``Nats-Msg-Id`` header can carry it as it is, else raise ``InvalidRequestId``.

    A request id is 1-256 printable ASCII characters without spaces (``charge-o17-1``,
    ``import:2024-05-01/7``): a header value ends at CR/LF, loses surrounding spaces and is not
    reliably UTF-8 across clients, so anything else would be stored under a different id than
    the one given, and a retry would not be recognised as a duplicate.
    """
    if not isinstance(request_id, str):
        raise InvalidRequestId(f"request id must be a string, got {type(request_id).__name__}")
    if not request_id:
        raise InvalidRequestId("request id is empty; leave it out to get a new one (a ULID)")
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequestId(f"request id is {len(request_id)} characters long; the limit is {MAX_REQUEST_ID_LENGTH}")
    if not _REQUEST_ID.match(request_id):
        bad = next(c for c in request_id if not 0x21 <= ord(c) <= 0x7E)
        raise InvalidRequestId(
            f"request id {request_id!r} contains {bad!r}; a request id travels as the Nats-Msg-Id header, "
            "so it must be printable ASCII without spaces or control characters"
        )
    return request_id


def request_id_token(request_id: str) -> str:
    """``request_id`` as one subject token: itself when it is letters, digits, '-' and '_' (ULIDs
    are), else ``~`` and its unpadded base64url form (so ``.``, ``*`` and ``>`` cannot split or widen a subject)."""
    if _TOKEN_SAFE_ID.match(request_id):
        return request_id
    return "~" + base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class QueueNames:
    """Every stream, consumer and subject name of one queue."""

    queue: str

    def __post_init__(self) -> None:
        validate_queue_name(self.queue)

    @property
    def inbox_stream(self) -> str:
        return f"KQ_{self.queue}_INBOX"

    @property
    def token_stream(self) -> str:
        return f"KQ_{self.queue}_TOKENS"

    @property
    def dlq_stream(self) -> str:
        return f"KQ_{self.queue}_DLQ"

    @property
    def lease_stream(self) -> str:
        """Per-key lease records (the lock), crash-loop counters and fleet roles."""
        return f"KQ_{self.queue}_LEASES"

    @property
    def consumer(self) -> str:
        return CONSUMER_NAME

    @property
    def inbox_prefix(self) -> str:
        return f"kq.{self.queue}.in."

    @property
    def token_prefix(self) -> str:
        return f"kq.{self.queue}.tok."

    @property
    def dlq_prefix(self) -> str:
        return f"kq.{self.queue}.dlq."

    @property
    def lease_prefix(self) -> str:
        return f"kq.{self.queue}.lease."

    @property
    def head_prefix(self) -> str:
        return f"kq.{self.queue}.head."

    @property
    def role_prefix(self) -> str:
        return f"kq.{self.queue}.role."

    @property
    def progress_prefix(self) -> str:
        return f"kq.{self.queue}.progress."

    def inbox(self, key: str) -> str:
        return self.inbox_prefix + key

    def token(self, key: str) -> str:
        return self.token_prefix + key

    def dlq(self, key: str) -> str:
        return self.dlq_prefix + key

    def lease(self, key: str) -> str:
        return self.lease_prefix + key

    def head(self, key: str) -> str:
        return self.head_prefix + key

    def role(self, name: str) -> str:
        return self.role_prefix + name

    def parked(self, key: str) -> str:
        """The record of a key whose due requests wait for room in its backlog (``keyqueue.jetstream.due``)."""
        return self.role_prefix + "parked." + key

    def progress(self, key: str) -> str:
        return self.progress_prefix + key

    def key_of(self, subject: str) -> str:
        """The key of any of this queue's per-key subjects."""
        parts = subject.split(".", 3)
        if len(parts) < 4 or parts[0] != "kq" or parts[1] != self.queue:
            raise ValueError(f"subject {subject!r} does not belong to queue {self.queue!r}")
        return parts[3]
