"""What key sessions tell the layer above them: the typed seam between the core and the app.

The core's key sessions (``core/session.py``) and queue worker (``core/worker.py``) call a
:class:`SessionObserver` at every step of a key's lifecycle, with everything the step knows; the
app's ``Worker`` implements it to call the lifecycle hooks, and the chaos and fault-test workers
to log the steps. One key session makes these calls, in this order::

    key_acquired
        ( wait_for_room ─► request_started ─► around_attempt { the processor's attempt }
              ├─ raised: attempt_failed ─► request_retried (and again) | request_dead_lettered
              └─ done:   request_succeeded / request_dead_lettered, once per request handled ) ...
    key_released

``wait_for_room`` is also awaited once before the session opens its processor, and a request
its holders keep dying on is dead-lettered (``crash-loop``) before any attempt. A session that
never acquires its key (a drain began while another worker held it) calls only
``key_released``, with :attr:`Outcome.CONTENDED`; one that could not write its lease record
(NATS down) calls nothing. ``worker_pinned`` / ``worker_unpinned`` come from the queue worker,
outside any session.

Notifications are plain calls made on the event loop in the middle of a session, so they must
return at once: an observer with slow work queues it, and pushes back through ``wait_for_room``.
The queue worker isolates its observer: a notification or ``wait_for_room`` that raises is
logged and the session carries on. ``around_attempt`` is part of the attempt: what it raises
fails the attempt, as the processor's own exception would.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from keyqueue.core.processor import Request, RequestContext

__all__ = ["DeadLetterReason", "KeyHold", "NullObserver", "Outcome", "RequestAttempt", "SessionEnd", "SessionObserver",
           "describe"]


class Outcome(enum.StrEnum):
    """How a key session ended."""

    RELEASED = "released"
    """Quiescent: the token was acked (and the inbox re-checked)."""
    HANDED_OFF = "handed-off"
    """Drained at shutdown: the token was given back for another worker."""
    LEASE_LOST = "lease-lost"
    """The lease record was lost: nothing more was sent for the key."""
    FAILED = "failed"
    """The processor or NATS failed: the token comes back after a short delay."""
    INTERRUPTED = "interrupted"
    """Cut off (the drain deadline, or a second signal): the request in hand runs again elsewhere."""
    CONTENDED = "contended"
    """Never acquired: the key's lease record stayed held by another worker until this worker began draining."""


class DeadLetterReason(enum.StrEnum):
    """Why a key session dead-lettered a request (its ``X-KQ-DLQ-Reason``)."""

    REJECTED = "rejected"
    """The processor rejected it (``Reject``; also an unknown type, a body that does not decode, a
    subject that cannot be replied to): it runs no more."""
    NOT_RETRIED = "not-retried"
    """It failed with an error its retry policy does not retry."""
    MAX_ATTEMPTS = "max-attempts"
    """It failed on every attempt its retry policy allows (killed attempts count too)."""
    CRASH_LOOP = "crash-loop"
    """Workers kept dying or losing the lease while it was the key's head request."""


@dataclass(frozen=True, slots=True)
class KeyHold:
    """One key session's hold on its key."""

    queue: str
    key: str
    fencing: tuple[int, int]
    """``(lease record sequence, token delivery count)``; ``(0, delivery count)`` if never acquired."""
    delivered: int
    """How many times the server delivered the key's token (more than 1: a redelivery)."""


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """How a key session ended, and what it did."""

    outcome: Outcome
    processed: int = 0
    """Requests the processor handled and the session removed from the inbox (dead-letters aside)."""
    republished: bool = False
    """Whether the re-check after the release found a request and scheduled the key again."""
    reason: str = ""
    """Why the lease was lost, or ``repr`` of what failed the session."""
    error: BaseException | None = None
    """What failed the session (outcome ``failed``)."""


@dataclass(frozen=True, slots=True)
class RequestAttempt:
    """One request at one attempt; a batch's requests share ``attempt`` and ``batch``."""

    queue: str
    key: str
    request_id: str
    message_type: str
    """The request's ``X-MESSAGE-TYPE`` ("" if it has none)."""
    seq: int
    """The request's inbox sequence."""
    attempt: int
    """1 for the first try; for a dead-lettered request, the attempts made (for ``crash-loop``,
    the sessions that ended with it at the head)."""
    batch: int = 1
    """How many requests the attempt handled together."""
    max_attempts: int = 0
    """The attempts its retry policy allows in all (0 where it does not apply)."""
    stored_at: str = ""
    """When the server stored the request in the inbox (its RFC 3339 stream timestamp, the server's
    clock), "" where unknown: where the request's wait is measured from, however its id was made."""


class SessionObserver(Protocol):
    """Told every step of every key session of a queue worker (see the module docstring)."""

    def token_received(self, queue: str, key: str, delivered: int) -> None:
        """A key's token reached the worker (``delivered``: its delivery count); a session will try
        to acquire the key (or the running one adopts it, or it is handed back while draining)."""

    def key_acquired(self, hold: KeyHold) -> None:
        """The session holds ``hold.key`` under ``hold.fencing`` and is about to open its processor."""

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        """The session ended: once for every session that acquired its key (whatever ended it,
        cancellation included), and for one that gave up waiting for it (``contended``)."""

    def request_started(self, attempt: RequestAttempt) -> None:
        """An attempt begins (for a batch: once, for its first request)."""

    def attempt_failed(self, attempt: RequestAttempt, error: BaseException) -> None:
        """The attempt raised ``error``; ``request_retried`` or ``request_dead_lettered`` follows."""

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        """The request stays at the head of its key and runs again after ``delay`` seconds."""

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        """The request was removed from the inbox, its caller answered. ``superseded_by`` names the
        newer request that replaced it without running it (policy ``latest``), else None.
        ``elapsed``: the attempt's seconds."""

    def request_dead_lettered(self, request: RequestAttempt, reason: DeadLetterReason, error: BaseException) -> None:
        """The request was moved to the dead-letter queue: ``reason`` is ``rejected``,
        ``max-attempts`` or ``crash-loop``."""

    def worker_pinned(self, queue: str, pin_id: str) -> None:
        """The worker became the pinned client of ``queue``."""

    def worker_unpinned(self, queue: str, pin_id: str) -> None:
        """The worker is no longer the pinned client of ``queue``."""

    def around_attempt(self, attempt: RequestAttempt, context: RequestContext,
                       requests: Sequence[Request]) -> AbstractAsyncContextManager[object]:
        """What the session enters around one attempt at ``requests`` (one, or a batch); the
        attempt's exception passes through it."""

    async def wait_for_room(self) -> None:
        """Back-pressure: return once the observer can take more steps. Awaited before the
        session opens its processor and before each attempt."""


class NullObserver:
    """A :class:`SessionObserver` that does nothing; subclass it and override what you need."""

    def token_received(self, queue: str, key: str, delivered: int) -> None:
        return None

    def key_acquired(self, hold: KeyHold) -> None:
        return None

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        return None

    def request_started(self, attempt: RequestAttempt) -> None:
        return None

    def attempt_failed(self, attempt: RequestAttempt, error: BaseException) -> None:
        return None

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        return None

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        return None

    def request_dead_lettered(self, request: RequestAttempt, reason: DeadLetterReason, error: BaseException) -> None:
        return None

    def worker_pinned(self, queue: str, pin_id: str) -> None:
        return None

    def worker_unpinned(self, queue: str, pin_id: str) -> None:
        return None

    def around_attempt(self, attempt: RequestAttempt, context: RequestContext,
                       requests: Sequence[Request]) -> AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    async def wait_for_room(self) -> None:
        return None


def describe(error: BaseException) -> str:
    """``"ExceptionType: message"``, how logs and hooks name an error."""
    return f"{type(error).__name__}: {error}"
