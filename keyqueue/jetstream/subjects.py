"""Names of a queue's streams, consumer and subjects, and the rules for keys and queue names."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError, InvalidKey, InvalidRequestId, InvalidSubject

MAX_KEY_LENGTH: Final = 256
"""Longest key accepted, in bytes of UTF-8 (subjects travel in every message's protocol line)."""

CONSUMER_NAME: Final = "workers"
"""The one durable pull consumer on a queue's token stream (and on its work stream), shared by every worker."""

UNKEYED: Final = "~"
"""The key of every request of an unkeyed task (``@app.task()`` without ``key=``): such a request is
stored in the queue's work stream, not in a key's inbox, and runs beside any other. Where a key
names a subject (the dead-letter queue, events, progress) an unkeyed request uses this one; it is
not a key a task may compute (``InvalidKey``)."""

MAX_REQUEST_ID_LENGTH: Final = 256
"""Longest request id accepted, in characters (it travels as ``Nats-Msg-Id`` on every copy of a request)."""

MAX_CONTROL_LINE: Final = 4096
"""nats-server's default ``max_control_line``, in bytes: a ``PUB``/``HPUB`` line (verb, subject,
reply subject, sizes) longer than this makes the server answer ``-ERR`` and close the connection,
and nats-py then closes the client for good (it does not reconnect after a protocol error)."""

PUB_LINE_OVERHEAD: Final = 64
"""Bytes of a publish line besides its subject and reply subject: ``HPUB``, three spaces, two
sizes of up to 20 digits, CRLF (rounded up)."""

MAX_SUBJECT_LENGTH: Final = 3840
"""Longest subject taken from a message that keyqueue publishes to (a reply inbox), in bytes of
UTF-8: the server's control line less room for the rest of the publish line (its verb, sizes and
a reply subject of up to 192 bytes)."""

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
    if key == UNKEYED:
        raise InvalidKey(f"key {UNKEYED!r} is reserved for the requests of unkeyed tasks; a task without "
                         "exclusivity is declared without key=")
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


def validate_request_key(key: str) -> str:
    """Return ``key`` if a stored request can have it: a key (:func:`validate_key`), or :data:`UNKEYED`."""
    return key if key == UNKEYED else validate_key(key)


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


def validate_subject(subject: str, what: str) -> str:
    """Return ``subject`` if keyqueue may publish to it, else raise :class:`~keyqueue.errors.InvalidSubject`.

    For subjects read from the wire (a request's ``X-Reply-Inbox``): at most
    :data:`MAX_SUBJECT_LENGTH` bytes, tokens not empty, no whitespace, control characters or
    wildcards. ``what`` says where it came from, for the error (``"the reply inbox of request X"``).
    """
    if not isinstance(subject, str) or not subject:
        raise InvalidSubject(what, "it is empty")
    size = len(subject.encode("utf-8", "surrogatepass"))
    if size > MAX_SUBJECT_LENGTH:
        raise InvalidSubject(what, f"it is {size} bytes long, over the {MAX_SUBJECT_LENGTH} a subject may be (a "
                                   "publish line longer than the server's max_control_line closes the connection)")
    for token in subject.split("."):
        if not token:
            raise InvalidSubject(what, f"{_shown(subject)} has an empty token (leading, trailing or doubled '.')")
        bad = _FORBIDDEN_IN_TOKEN.search(token)
        if bad:
            raise InvalidSubject(what, f"{_shown(subject)} contains {bad.group()!r} (no whitespace, control "
                                       "characters or wildcards)")
    return subject


def check_publish_line(subject: str, reply: str = "") -> None:
    """Raise :class:`~keyqueue.errors.InvalidSubject` if a publish to ``subject`` (with ``reply``)
    would exceed the server's :data:`MAX_CONTROL_LINE`, which would close the connection for good.

    Every publish of a keyqueue connection passes here (``KeyqueueClient.publish`` and the
    pre-encoded publishes): whatever a bug or a message slips past :func:`validate_subject`
    fails alone, and the connection never sees it. nats-py itself refuses whitespace.
    """
    if len(subject) + len(reply) <= (MAX_CONTROL_LINE - PUB_LINE_OVERHEAD) // 4:
        return  # even four bytes of UTF-8 per character fit: the common case, without encoding
    size = len(subject.encode("utf-8", "surrogatepass")) + len(reply.encode("utf-8", "surrogatepass"))
    if size + PUB_LINE_OVERHEAD > MAX_CONTROL_LINE:
        raise InvalidSubject(f"a publish to {_shown(subject)}",
                             f"its subject and reply subject take {size} bytes, over the server's max_control_line "
                             f"({MAX_CONTROL_LINE} bytes, less {PUB_LINE_OVERHEAD} for the rest of the line): the "
                             "server would close the connection; nothing was sent")


def _shown(subject: str, limit: int = 64) -> str:
    """``subject`` for an error message: quoted, cut to ``limit`` characters."""
    return repr(subject if len(subject) <= limit else subject[:limit] + "...")


def request_id_token(request_id: str) -> str:
    """``request_id`` as one subject token: itself when it is letters, digits, '-' and '_' (ULIDs
    are), else ``~`` and its unpadded base64url form (so ``.``, ``*`` and ``>`` cannot split or widen a subject)."""
    if _TOKEN_SAFE_ID.match(request_id):
        return request_id
    return "~" + base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


def name_token(name: str) -> str:
    """A task's name as one subject token (as :func:`request_id_token` makes one of a request id;
    ``~`` for no name)."""
    return request_id_token(name) if name else UNKEYED


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
    def work_stream(self) -> str:
        """Unkeyed requests (a work-queue stream: a request is removed when its run is acked)."""
        return f"KQ_{self.queue}_WORK"

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
    def work_prefix(self) -> str:
        return f"kq.{self.queue}.work."

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

    def work(self, task: str) -> str:
        """Where the unkeyed requests of ``task`` (its name, the request's ``X-MESSAGE-TYPE``) are stored."""
        return self.work_prefix + name_token(task)

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
