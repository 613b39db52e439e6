"""Names of a queue's streams, consumer and subjects, and the rules for keys and queue names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError, InvalidKey

MAX_KEY_LENGTH: Final = 256
"""Longest key accepted, in bytes of UTF-8 (subjects travel in every message's protocol line)."""

CONSUMER_NAME: Final = "workers"
"""The one durable pull consumer on a queue's token stream, shared by every worker."""

_QUEUE_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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

    def progress(self, key: str) -> str:
        return self.progress_prefix + key

    def key_of(self, subject: str) -> str:
        """The key of any of this queue's per-key subjects."""
        parts = subject.split(".", 3)
        if len(parts) < 4 or parts[0] != "kq" or parts[1] != self.queue:
            raise ValueError(f"subject {subject!r} does not belong to queue {self.queue!r}")
        return parts[3]
