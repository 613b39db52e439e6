"""The processor seam: what per-key code receives, and what it must provide.

A :class:`KeyProcessor` is built for each key session (by a plugin, or by the task API's
default processor). The session calls ``open`` once, then ``handle`` for each request in order
(or ``handle_batch`` when ``batch_size`` > 0), ``idle`` before it releases the key (to finish
background work such as a DVU), and ``close`` last.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import InvalidSubject
from keyqueue.jetstream.subjects import MAX_REQUEST_ID_LENGTH, validate_subject

T = TypeVar("T")


class CloseReason(enum.StrEnum):
    """Why a processor is closed (``KeyProcessor.close``)."""

    QUIESCENT = "quiescent"
    """The key had no more requests; it is given back."""
    SHUTDOWN = "shutdown"
    """The worker is draining; the key goes to another worker with whatever is left."""
    LEASE_LOST = "lease-lost"
    """The lease ended: another worker may own the key now, so write nothing."""


@dataclass(frozen=True, slots=True)
class Request:
    """One stored request for a key, as read from the inbox."""

    key: str
    seq: int
    subject: str
    headers: Mapping[str, str]
    data: bytes

    @property
    def request_id(self) -> str:
        return self.headers.get("Nats-Msg-Id", "")

    @property
    def reply_inbox(self) -> str | None:
        return self.headers.get("X-Reply-Inbox") or None

    def check_subjects(self) -> None:
        """Raise :class:`~keyqueue.errors.InvalidSubject` if a header that becomes a subject cannot be
        one: the reply inbox (answered), the request id (part of its result and cancel records'
        subjects). Checked before the request runs: a publish to such a subject would make the server
        close the connection."""
        headers = self.headers  # (the properties, read once each: this runs for every request)
        request_id = headers.get("Nats-Msg-Id", "")
        reply_inbox = headers.get("X-Reply-Inbox")
        if reply_inbox:
            validate_subject(reply_inbox, f"the reply inbox (X-Reply-Inbox) of request {request_id[:64]!r}")
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidSubject(f"request id {request_id[:64]!r}...",
                                 f"it is {len(request_id)} characters long, over {MAX_REQUEST_ID_LENGTH} (it "
                                 "becomes part of the subjects of the request's records)")


@dataclass(frozen=True, slots=True)
class Reply:
    """What a processor returns for a request that asked for a reply."""

    data: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


BatchOutcome = Reply | BaseException | None
"""One request's outcome in ``handle_batch``: a reply, nothing, or an exception that rejects it alone."""


HoldRemoval = Callable[[Callable[[], Awaitable[None]]], None]
"""``hold(confirm)``: await ``confirm()`` before removing any request handled up to now
(``RequestContext.hold_removal``)."""


class SessionContext(Protocol):
    """What a processor may use for the whole key session.

    Every member is there in every context (a test's fake, a plugin's own context included): one
    that cannot do a capability has the plain default its docstring names, so a caller never asks
    whether a member exists (a runtime protocol's ``isinstance`` would be slow on the key's path)."""

    queue: str
    key: str
    fencing: tuple[int, int]

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose records carry the queue and the key."""

    def lease_valid(self) -> bool:
        """True while this worker still owns the key."""

    def lease_remaining(self) -> float:
        """Seconds the lease has left: 0 once lost; ``math.inf`` in a context whose lease never ends
        (the eager test mode)."""

    def check_lease(self) -> None:
        """Raise :class:`~keyqueue.errors.LeaseLost` unless this worker still owns the key."""

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()`` (idempotent), again after a transient NATS failure while the lease holds.

        keyqueue's I/O before and after a run (cancel records, rate-limit slots, answers) is not the
        user's code, so its transient failures must not cost an attempt: the key session runs the
        step again after a lost connection, a lost reply or no answer, as it does its own steps,
        until the lease ends (then ``LeaseLost``: the session ends as a lost lease, no attempt
        charged). Plain default (no session to retry within): ``await step()`` once."""

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Publish a progress message on ``kq.<queue>.progress.<key>``."""


class RequestContext(SessionContext, Protocol):
    """A :class:`SessionContext` plus the request being handled."""

    request_id: str
    attempt: int
    """1 for the first try, 2 for the first retry, ..."""

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` keeping the key but lending the worker slot to another key (a rate
        limit's wait). Plain default (no slot to lend): ``asyncio.sleep(seconds)``."""

    @property
    def hold_removal(self) -> HoldRemoval | None:
        """Where the session can hold a handled request's removal until a write of the processor's has
        settled (the key session's context), a function taking that write's confirmation; else None
        (the unkeyed lane and the eager test mode remove nothing after the processor returns, so the
        processor awaits its write itself before returning).

        A processor that must store something before the request leaves the inbox (a kept result)
        sends it without awaiting the reply and hands the confirmation here: the session goes on to
        the next request at once, and awaits every held confirmation before it sends the removal
        (purge or delete) of any request handled so far. The confirmation raises only ``LeaseLost``
        (or cancellation); it handles its own failures."""


@runtime_checkable
class KeyProcessor(Protocol):
    """Per-key code. One instance serves one key session."""

    batch_size: int
    """0: one request per ``handle`` call; N > 0: up to N available requests per ``handle_batch``."""

    async def open(self, ctx: SessionContext) -> None: ...

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None: ...

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        """Handle ``requests`` (the key's next ones, in order); return one outcome per request handled.

        Returning fewer outcomes than requests handles only that prefix: the rest stay at the head
        of the key, in order, for the next call. An exception *returned* in a request's place
        dead-letters that request alone (reason ``rejected``); an exception *raised* retries (or
        dead-letters) the whole batch.
        """

    async def idle(self, ctx: SessionContext) -> None:
        """The key has no more requests: finish owed background work before the key is released."""

    async def close(self, ctx: SessionContext, reason: CloseReason) -> None: ...

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        """The retry policy for this request, or None for the worker's default."""


class BaseProcessor:
    """A KeyProcessor with do-nothing defaults; subclass and override ``handle``."""

    batch_size: int = 0

    async def open(self, ctx: SessionContext) -> None:
        return None

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        raise NotImplementedError

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        return [await self.handle(ctx, r) for r in requests]

    async def idle(self, ctx: SessionContext) -> None:
        return None

    async def close(self, ctx: SessionContext, reason: CloseReason) -> None:
        return None

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        return None


ProcessorFactory = Callable[[str], KeyProcessor | Awaitable[KeyProcessor]]
"""Builds the processor for a key (may be async)."""
