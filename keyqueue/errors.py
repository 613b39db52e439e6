"""Every error keyqueue raises, in one tree.

    KeyqueueError
    ├── ConfigError                      bad settings, bad arguments, a missing binary
    │   ├── InvalidKey                   a key that is not a valid NATS subject token sequence (ValueError)
    │   ├── InvalidSchedule              a bad countdown, eta, cron or every, or a server without schedules (ValueError)
    │   ├── InvalidRequestId             a request id a Nats-Msg-Id header cannot carry (ValueError)
    │   ├── MissingExtra                 an optional part (the dashboard, metrics) is not installed
    │   ├── ServerNotFound               the nats-server binary is not installed
    │   └── TopologyMismatch             a stream/consumer's layout differs from what this process needs
    ├── ConnectionFailed                 the NATS server could not be reached
    │   ├── Disconnected                 the connection is down right now: the message was not sent
    │   ├── ReplyLost                    the connection dropped between a request and its reply
    │   └── ConnectionClosed             the connection was closed for good (a protocol error, revoked credentials)
    ├── KeyqueueTimeout                  an operation took too long (also a TimeoutError)
    │   └── SyncTimeout                  a sync call (delay, call_sync, ...) did not finish within its bound
    ├── WireError                        a message that cannot be decoded or encoded
    │   ├── MissingHeader                a required header is absent
    │   ├── UnsupportedContentType       X-CONTENT-TYPE is not cbor or json
    │   ├── UnknownMessageType           X-MESSAGE-TYPE names no registered type
    │   ├── UnsupportedVersion           X-MESSAGE-VERSION is newer than supported (or not a version)
    │   ├── MalformedBody                the body does not decode, or does not fit the type
    │   ├── InvalidSubject               a subject (a reply inbox, a request id in one) NATS cannot carry
    │   └── PayloadTooLarge              the encoded message exceeds the server's max_payload
    ├── EnqueueError                     a request could not be accepted
    │   ├── BacklogFull                  the key's per-key backlog cap is reached
    │   ├── PartiallyEnqueued            enqueue_many stored some requests and not others (results per item)
    │   ├── TokenPublishFailed           the request is stored, but its key was not scheduled
    │   └── EnqueueTimeout               no acknowledgement, even after a retry (also a KeyqueueTimeout)
    ├── JetStreamError                   a JetStream API error not covered above (code, err_code)
    │   ├── StreamNotFound               10059
    │   ├── ConsumerNotFound             10014
    │   ├── MessageNotFound              10037
    │   ├── WrongLastSequence            10071, or 10164 on a replicated stream (a compare-and-set lost the race)
    │   ├── JetStreamUnavailable         10008, 10167 (a full stream), or 10005 "peer offline": unavailable for now
    │   └── KeyAlreadyScheduled          10077 on a token subject (callers treat it as success)
    ├── LeaseLost                        this worker no longer owns the key; stop without side effects
    ├── RequestNotFound                  no request with this id was found (keyqueue cancel of an unknown id)
    ├── ResultUnavailable                a request's result cannot be had
    │   ├── ResultNotKept                its task keeps no results (no result_ttl)
    │   └── ResultExpired                it was kept, but its result_ttl has passed
    └── TaskFailure                      the outcome of running a request
        ├── Reject                       raised by a handler: do not retry, dead-letter now
        │   └── CallOnOwnKey             a task called a task on the key its own run holds (never retried)
        ├── SoftTimeout                  raised inside a task that passed its soft_timeout (catch it to clean up)
        ├── Retry                        raised by a handler: retry this request, after countdown seconds if given
        ├── RemoteError                  a request failed in a worker; re-raised to the caller
        │   └── DeadLettered             the request went to the DLQ (reply to a caller)
        │       └── WorkflowFailed       a step of a workflow failed for good: the workflow stopped there
        ├── Cancelled                    the request was cancelled before it started
        │   └── WorkflowCancelled        the workflow was cancelled: its steps that had not started never run
        ├── Expired                      its expires= time passed before it started
        └── Superseded                   a newer request for the key replaced this one

Timeouts subclass the built-in ``TimeoutError`` (which ``asyncio.TimeoutError`` aliases) so
ordinary ``except TimeoutError`` code catches them. ``from_api_error`` is the one place where
JetStream error codes become typed errors.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "BacklogFull",
    "CallOnOwnKey",
    "Cancelled",
    "ConfigError",
    "ConnectionClosed",
    "ConnectionFailed",
    "ConsumerNotFound",
    "DeadLettered",
    "Disconnected",
    "EnqueueError",
    "EnqueueTimeout",
    "Expired",
    "InvalidKey",
    "InvalidRequestId",
    "InvalidSchedule",
    "InvalidSubject",
    "JetStreamError",
    "JetStreamUnavailable",
    "KeyAlreadyScheduled",
    "KeyqueueError",
    "KeyqueueTimeout",
    "LeaseLost",
    "MalformedBody",
    "MessageNotFound",
    "MissingExtra",
    "MissingHeader",
    "PartiallyEnqueued",
    "PayloadTooLarge",
    "Reject",
    "RemoteError",
    "ReplyLost",
    "RequestNotFound",
    "ResultExpired",
    "ResultNotKept",
    "ResultUnavailable",
    "Retry",
    "ServerNotFound",
    "SoftTimeout",
    "StreamNotFound",
    "Superseded",
    "SyncTimeout",
    "TaskFailure",
    "TokenPublishFailed",
    "TopologyMismatch",
    "UnknownMessageType",
    "UnsupportedContentType",
    "UnsupportedVersion",
    "WireError",
    "WorkflowCancelled",
    "WorkflowFailed",
    "WrongLastSequence",
    "from_api_error",
]


class KeyqueueError(Exception):
    """Root of every error keyqueue raises."""


# --- configuration -----------------------------------------------------------------------------


class ConfigError(KeyqueueError):
    """Settings, arguments or the environment are not usable as given."""


class InvalidKey(ConfigError, ValueError):
    """A key is not a sequence of valid NATS subject tokens."""


class InvalidRequestId(ConfigError, ValueError):
    """A request id a ``Nats-Msg-Id`` header cannot carry as it is (printable ASCII, no spaces, 1-256 long)."""


class InvalidSchedule(ConfigError, ValueError):
    """A delay or a periodic schedule that cannot be kept: a naive ``eta``, a negative ``countdown``, a due
    time past what the queue's streams keep, a cron expression the server would refuse, ``every <= 0``,
    or a server too old for message schedules (the message names the version needed)."""


class MissingExtra(ConfigError):
    """A feature needs one of keyqueue's optional extras (``pip install 'keyqueue[EXTRA]'``), and a
    module it brings is not installed. The message says how to install it into this Python, from
    the package index and, where keyqueue runs from a clone of its repository, from that checkout
    (``pip install -e 'CHECKOUT[EXTRA]'``: the index has no copy of what the clone holds)."""

    def __init__(self, feature: str, extra: str, missing: str | None) -> None:
        import sys
        from pathlib import Path

        self.extra = extra
        pip = f"{sys.executable} -m pip install"
        index = f"{pip} 'keyqueue[{extra}]'"
        root = Path(__file__).resolve().parent.parent
        pyproject = root / "pyproject.toml"
        try:
            clone = pyproject.is_file() and 'name = "keyqueue"' in pyproject.read_text()
        except OSError:
            clone = False
        lacking = f" ({missing} is missing)" if missing else ""
        if clone:
            how = (f"this keyqueue runs from a clone of its repository, so install it from the checkout: "
                   f"{pip} -e '{root}[{extra}]' (an installed release takes {index})")
        else:
            how = (f"install it: {index} (in a clone of keyqueue's repository, from the checkout: "
                   f"{pip} -e '.[{extra}]')")
        super().__init__(f"{feature} needs keyqueue's {extra!r} extra{lacking}: {how}")


class ServerNotFound(ConfigError):
    """The nats-server binary needed for the embedded server is not installed."""


class TopologyMismatch(ConfigError):
    """A stream or consumer exists with a layout this process cannot use.

    Raised only for what a process depends on and may not change on its own (the queue's
    settings, such as its lease, are followed or changed in place instead): ``field`` names what
    differs, ``existing`` and ``wanted`` are both values, and the one-line message ends with the
    command that fixes it.
    """

    def __init__(self, entity: str, field: str, existing: Any, wanted: Any, hint: str = "") -> None:
        self.entity, self.field, self.existing, self.wanted = entity, field, existing, wanted
        message = f"{entity}: {field} is {existing!r} on the server, {wanted!r} here"
        super().__init__(f"{message}; {hint}" if hint else message)


# --- transport ---------------------------------------------------------------------------------


class ConnectionFailed(KeyqueueError):
    """The NATS server could not be reached, or the connection is down or closed."""


class Disconnected(ConnectionFailed):
    """The connection to NATS is down (reconnecting): the message was not sent, and never will be.

    keyqueue's connections buffer nothing while disconnected, because a message sent late (an
    ack, a delete, a token) may act for a holder whose lease has ended. Retry once reconnected.
    """


class ReplyLost(ConnectionFailed):
    """The connection dropped after a request was sent and before its reply came: the server may
    or may not have acted on it. Retry only what is safe to repeat (keyqueue retries its own
    idempotent steps, and a publish that carries a request id, once reconnected)."""


class ConnectionClosed(ConnectionFailed):
    """The connection to NATS was closed for good by something other than its owner: the server
    refused it (a protocol error, revoked credentials) or reconnecting gave up. nats-py never
    reopens a closed connection, so whatever uses it stops: ``cause`` is what nats-py last reported
    (None if it reported nothing)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        self.cause = cause
        super().__init__(message)


class KeyqueueTimeout(KeyqueueError, TimeoutError):
    """An operation did not finish in time."""


class SyncTimeout(KeyqueueTimeout):
    """A sync call (``delay``, ``call_sync``, ``result_sync``, ...) did not finish within its bound.

    A sync call never waits without a bound: past it the work is cancelled. An enqueue cut off
    this way may still have stored its request: enqueue it again with the same ``request_id``.
    """

    def __init__(self, what: str, bound: float) -> None:
        self.what, self.bound = what, bound
        super().__init__(f"{what} did not finish within {bound:g}s; the server may be unreachable (check "
                         "KEYQUEUE_URL and that it runs), and a request may have been stored: enqueue it again "
                         "with the same request_id to be sure it is stored once")


# --- wire format -------------------------------------------------------------------------------


class WireError(KeyqueueError):
    """A message cannot be decoded (or encoded) under keyqueue's wire format."""


class MissingHeader(WireError):
    """A header the wire format requires is absent."""

    def __init__(self, header: str) -> None:
        self.header = header
        super().__init__(f"message has no {header} header; keyqueue messages carry it on every request")


class UnsupportedContentType(WireError):
    """The content type is not one keyqueue decodes."""

    def __init__(self, received: str, supported: tuple[str, ...]) -> None:
        self.received, self.supported = received, supported
        super().__init__(f"content type {received!r} is not supported; supported: {', '.join(supported)}")


class UnknownMessageType(WireError):
    """No message type with this name is registered."""

    def __init__(self, received: str, known: tuple[str, ...]) -> None:
        self.received, self.known = received, known
        shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
        super().__init__(f"unknown message type {received!r}; registered types: {shown or 'none'}")


class UnsupportedVersion(WireError):
    """The version is newer than this process supports, or is not a positive integer."""

    def __init__(self, message_type: str, received: str | int, supported: int) -> None:
        self.message_type, self.received, self.supported = message_type, received, supported
        super().__init__(
            f"{message_type} version {received} is not supported; this process handles versions "
            f"1..{supported} (upgrade the consumer to read newer messages)"
        )


class MalformedBody(WireError):
    """The body does not decode, or its fields do not fit the declared type."""


class InvalidSubject(WireError):
    """A subject taken from a message (its reply inbox, a request id that becomes part of a record's
    subject) that NATS cannot carry: empty, an empty token, whitespace, control characters or
    wildcards, or too long for the server's protocol line (a publish to it would make the server close
    the connection). Raised before anything is sent; ``what`` names where the subject came from."""

    def __init__(self, what: str, reason: str) -> None:
        self.what, self.reason = what, reason
        super().__init__(f"{what} cannot be a NATS subject: {reason}")


class PayloadTooLarge(WireError):
    """The encoded message is larger than the server accepts."""

    def __init__(self, size: int, limit: int, reserved: int = 0) -> None:
        self.size, self.limit = size, limit - reserved
        kept = f", less {reserved} bytes kept for its dead-letter copy's headers" if reserved else ""
        super().__init__(
            f"message is {size} bytes but the server's max_payload is {limit} bytes{kept}; "
            "store large data elsewhere and enqueue a reference to it"
        )


# --- enqueue -----------------------------------------------------------------------------------


class EnqueueError(KeyqueueError):
    """A request could not be accepted into a queue."""


class BacklogFull(EnqueueError):
    """The key already holds as many pending requests as its queue allows."""

    def __init__(self, queue: str, key: str) -> None:
        self.queue, self.key = queue, key
        super().__init__(
            f"key {key!r} in queue {queue!r} has a full backlog (max_backlog_per_key reached); "
            "the request was not stored, retry later or raise the cap"
        )


class PartiallyEnqueued(EnqueueError):
    """``enqueue_many`` stored some of its requests and not others.

    ``results`` has one entry per item, in order: its ``Receipt`` if it was stored, else its
    ``EnqueueError`` (a full backlog, say). ``receipts`` are the stored ones: enqueue only the
    others again.
    """

    def __init__(self, message: str, results: list[Any]) -> None:
        self.results = results
        self.receipts = [r for r in results if not isinstance(r, EnqueueError)]
        self.errors = {i: r for i, r in enumerate(results) if isinstance(r, EnqueueError)}
        super().__init__(message)


class TokenPublishFailed(EnqueueError):
    """The request is stored but its key's token could not be published.

    The request is not lost: the reconciler of any running worker schedules it. ``seq`` is the
    request's inbox sequence.
    """

    def __init__(self, queue: str, key: str, seq: int, cause: BaseException) -> None:
        self.queue, self.key, self.seq = queue, key, seq
        super().__init__(
            f"request seq {seq} for key {key!r} in queue {queue!r} is stored, but scheduling its key "
            f"failed ({cause}); a worker's reconciler will schedule it"
        )


class EnqueueTimeout(EnqueueError, KeyqueueTimeout):
    """No acknowledgement came for a request, even after one retry: it may or may not be stored.

    Enqueue it again with the same ``request_id`` (``task.options(request_id=...)``) within the
    queue's duplicate window (2 minutes by default): if the first try was stored, the server
    stores nothing new and the receipt says ``duplicate``.
    """

    def __init__(self, queue: str, key: str, request_id: str, timeout: float) -> None:
        self.queue, self.key, self.request_id = queue, key, request_id
        super().__init__(
            f"no acknowledgement for request {request_id} (key {key!r}, queue {queue!r}) within {timeout}s, "
            "twice; it may have been stored. Enqueue it again with request_id="
            f"{request_id!r} within the duplicate window to retry without a duplicate"
        )


# --- JetStream API -----------------------------------------------------------------------------


class JetStreamError(KeyqueueError):
    """A JetStream API call failed; ``code`` is the HTTP-like status, ``err_code`` JetStream's."""

    def __init__(self, description: str, code: int = 0, err_code: int = 0) -> None:
        self.description, self.code, self.err_code = description, code, err_code
        super().__init__(f"{description} (code={code} err_code={err_code})")


class StreamNotFound(JetStreamError):
    """The stream does not exist."""


class ConsumerNotFound(JetStreamError):
    """The consumer does not exist."""


class MessageNotFound(JetStreamError):
    """No message at that sequence or subject."""


class WrongLastSequence(JetStreamError):
    """An expected-last-sequence (optimistic concurrency) check failed: someone else wrote first.

    One server answers 10071. A replicated stream may answer 10164 instead while another write to
    the subject is still being replicated (that write may yet fail): either way this write was not
    stored, and the caller reads again and decides again, as for any lost race."""


class JetStreamUnavailable(JetStreamError):
    """JetStream answered that it is temporarily unavailable (10008): a cluster electing a leader or
    a server catching up. Nothing was done; the same request may succeed a moment later.

    Also a publish refused with "too many requests" (429, 10167): the stream's ingest queue was
    full (nats-server's ``max_buffered_msgs``, 100,000 messages, or ``max_buffered_size``, 128 MB),
    and the message was dropped before it was stored.

    Also a stream's placement refused because a peer is offline (10005, "no suitable peers for
    placement, peer offline"): a cluster just formed, or one with a node down, places the stream once
    the node is back. (10005 for any other reason, a tag no server has or too few servers, is a
    :class:`JetStreamError`: trying again does not help.)"""


class KeyAlreadyScheduled(JetStreamError):
    """The key's token already exists (10077): the key is held or scheduled."""


ERR_CODES: Final[dict[int, type[JetStreamError]]] = {
    10059: StreamNotFound,
    10014: ConsumerNotFound,
    10037: MessageNotFound,
    10071: WrongLastSequence,
    10164: WrongLastSequence,
    10008: JetStreamUnavailable,
    10167: JetStreamUnavailable,
    10077: KeyAlreadyScheduled,
}
"""JetStream ``err_code`` values that keyqueue gives their own type."""


NO_PLACEMENT: Final = 10005
"""nats-server's "no suitable peers for placement", its reasons after a comma."""

PEER_OFFLINE: Final = "peer offline"
"""The reason of a :data:`NO_PLACEMENT` that passes once the peer is back."""


def from_api_error(description: str, code: int = 0, err_code: int = 0) -> JetStreamError:
    """The typed error for a JetStream API error response."""
    if err_code == NO_PLACEMENT and PEER_OFFLINE in description:
        return JetStreamUnavailable(description, code, err_code)
    return ERR_CODES.get(err_code, JetStreamError)(description, code, err_code)


# --- processing --------------------------------------------------------------------------------


class LeaseLost(KeyqueueError):
    """This worker's hold on a key expired: another worker may own it now.

    The session that sees it stops at once with no ack, no nak and no delete.
    """


class RequestNotFound(KeyqueueError):
    """No request with this id was found where it was looked for (``keyqueue cancel`` of an unknown id)."""


class ResultUnavailable(KeyqueueError):
    """A request's result cannot be had: not kept, or expired (see the subclasses)."""

    def __init__(self, message: str, request_id: str, queue: str) -> None:
        self.request_id, self.queue = request_id, queue
        super().__init__(message)


class ResultNotKept(ResultUnavailable):
    """The request's task keeps no results: declare it with ``result_ttl=`` (or give the app a default)."""


class ResultExpired(ResultUnavailable):
    """The request's result was kept, but for ``result_ttl`` seconds, which have passed."""


class TaskFailure(KeyqueueError):
    """The outcome of processing a request, when it was not success."""


class Reject(TaskFailure):
    """Raise from a handler to dead-letter the request at once, without retries."""


class SoftTimeout(TaskFailure):
    """Raised inside a task function that passed its ``soft_timeout``: catch it to clean up.

    Uncaught, the attempt fails with it and is retried like any failure. The hard limit
    (``timeout``) stops the run whatever the function does.
    """

    def __init__(self, message: str = "the task passed its soft timeout") -> None:
        super().__init__(message)


class Retry(TaskFailure):
    """Raise from a task to have its request retried, after ``countdown`` seconds (else the task's backoff).

    The attempt counts toward ``max_attempts`` like any failed one, and the request stays at the head
    of its key (nothing behind it overtakes it). ``Retry`` is retried even when ``retry_on`` does not
    list it.
    """

    def __init__(self, message: str = "the task asked to be retried", *, countdown: float | None = None) -> None:
        if countdown is not None and not countdown >= 0:
            raise ConfigError(f"Retry countdown must be >= 0 seconds, got {countdown}")
        self.countdown = countdown
        super().__init__(message)


class CallOnOwnKey(Reject):
    """A task ``call``-ed a task on the key (of the same queue) that its own run holds.

    That request cannot start before the running one ends, so the call could only wait for its
    timeout, and every retry would store one more request. It is a programming error, so like
    ``Reject`` it is not retried: the running request is dead-lettered at once. ``enqueue`` the
    request instead (it runs after this one), or call a task on another key.
    """

    def __init__(self, caller: str, task: str, queue: str, key: str) -> None:
        self.caller, self.task, self.queue, self.key = caller, task, queue, key
        super().__init__(
            f"{caller} called {task} on key {key!r} of queue {queue!r}, which its own run holds: that "
            f"request cannot start before this run ends; enqueue it instead ({task}.enqueue(...) runs "
            "after this one), or call a task on another key"
        )


class RemoteError(TaskFailure):
    """A request failed in a worker; ``type_name`` is the remote exception's class name."""

    def __init__(self, type_name: str, message: str, request_id: str = "") -> None:
        self.type_name, self.message, self.request_id = type_name, message, request_id
        super().__init__(f"{type_name}: {message}")


class DeadLettered(RemoteError):
    """The request was moved to the dead-letter queue; ``reason`` says why.

    ``reason`` is ``rejected`` (bad input or :class:`Reject`), ``max-attempts`` or ``crash-loop``.
    """

    def __init__(self, type_name: str, message: str, request_id: str = "", reason: str = "") -> None:
        super().__init__(type_name, message, request_id)
        self.reason = reason


class Cancelled(TaskFailure):
    """The request was cancelled (``receipt.cancel()``, ``App.cancel``) before it started: it never ran."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} was cancelled before it started; it did not run")


class WorkflowFailed(DeadLettered):
    """A step of a workflow failed for good (dead-lettered after its retries): the workflow stopped there.

    ``workflow_id``, ``step`` (its number), ``task``; ``type_name``, ``message``, ``reason`` and
    ``request_id`` are the failed step's. Replaying the step from the dead-letter queue resumes it.
    """

    def __init__(self, workflow_id: str, step: int, task: str, type_name: str, message: str, request_id: str = "",
                 reason: str = "") -> None:
        super().__init__(type_name, message, request_id, reason)
        self.workflow_id, self.step, self.task = workflow_id, step, task
        self.args = (f"workflow {workflow_id} stopped at step {step} ({task}): {type_name}: {message}"
                     + (f" ({reason})" if reason else ""),)


class WorkflowCancelled(Cancelled):
    """The workflow was cancelled: its steps that had not started never run."""

    def __init__(self, workflow_id: str) -> None:
        super().__init__(workflow_id)
        self.workflow_id = workflow_id
        self.args = (f"workflow {workflow_id} was cancelled; its steps that had not started did not run",)


class Expired(TaskFailure):
    """The request's ``expires`` time passed before it started (``options(expires=...)``): it never ran."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} expired before it started (expires=); it did not run")


class Superseded(TaskFailure):
    """A newer request for the same key replaced this one (policy ``latest`` or ``merge``)."""

    def __init__(self, request_id: str, by: str) -> None:
        self.request_id, self.by = request_id, by
        super().__init__(f"request {request_id} was superseded by request {by}")
