"""``Context``: what a task function may ask about the request it runs.

A task function gets one when its first parameter is annotated ``keyqueue.Context`` (or, without
an annotation, is named ``ctx``)::

    @app.task(key="{order_id}")
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict:
        ctx.log.info("attempt %d for %s", ctx.attempt, ctx.key)
        await ctx.progress({"step": "authorising"})
        ...
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from keyqueue.core.processor import RequestContext
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H

__all__ = ["CANCEL_CHECK", "PROGRESS_KEEP", "PROGRESS_TYPE", "Context", "Progress"]

PROGRESS_TYPE: Final = "keyqueue.Progress"
"""``X-MESSAGE-TYPE`` of progress messages (version 1; the body is one CBOR plain value)."""

_PROGRESS_TIMEOUT: Final = 10.0

CANCEL_CHECK: Final = contextvars.ContextVar[Callable[[], bool] | None]("keyqueue_cancel_check", default=None)
"""Set by the worker around a run: whether a cancel was asked for the running request (``Context.cancel_requested``)."""

PROGRESS_KEEP: Final = contextvars.ContextVar[Callable[[bytes, Mapping[str, str]], None] | None](
    "keyqueue_progress_keep", default=None)
"""Set by the worker around a run: keeps the run's last progress (its body and headers) under each of
its request ids, at most about once a second (``keyqueue.app.progress``); None where nothing is kept."""


@dataclass(frozen=True)
class Progress:
    """The last progress a request's task reported (``ctx.progress(value)``), as kept by request id:
    what ``App.progress`` and ``App.status(..., progress=True)`` return."""

    value: Any
    """The value the task passed to ``ctx.progress``."""
    request_id: str
    key: str
    task: str
    attempt: int
    """The attempt that reported it (1 for the first; a retry starts from its own progress)."""
    reported_at: datetime.datetime | None
    """When it was stored (the server's clock), None where unknown (the eager test mode)."""


class Context:
    """The running request: its key, id, attempt and fencing token, a logger, progress, the lease.

    One ``Context`` serves one attempt. In a sync task function (which runs in a thread) use
    ``progress_sync``; everything else works from any thread.
    """

    def __init__(self, core: RequestContext, task: str, request_ids: tuple[str, ...],
                 request_id: str | None = None) -> None:
        self._core = core
        self._loop = asyncio.get_running_loop()
        self._cancel_check = CANCEL_CHECK.get()
        self._keep_progress = PROGRESS_KEEP.get()
        self.task = task
        """The task's name."""
        self.queue = core.queue
        self.key = core.key
        self.request_id = request_id or core.request_id
        """The request's id (for ``latest`` and ``merge``: the newest request's, which the run answers;
        for ``batch``: the first's)."""
        self.request_ids = request_ids
        """Every request this run answers, oldest first (one, unless the task takes batches or merges)."""
        self.attempt = core.attempt
        """1 for the first try, 2 for the first retry, ..."""
        self.fencing = core.fencing
        """``(lease record sequence, token delivery count)``: strictly increases from one holder of the key to the next.

        Store it with what you write and refuse writes with a smaller one, and a worker that lost
        the key (paused past its lease, say) cannot overwrite the next holder's work.
        """

    @functools.cached_property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose records carry ``queue``, ``key`` and ``request_id`` as extra fields."""
        # Built on first use: most runs never log, and a Context is made for every run.
        return logging.LoggerAdapter(logging.getLogger(f"keyqueue.task.{self.task}"),
                                     {"queue": self.queue, "key": self.key, "request_id": self.request_id})

    def __repr__(self) -> str:
        return (f"<Context {self.task} queue={self.queue} key={self.key} request={self.request_id} "
                f"attempt={self.attempt}>")

    @property
    def cancel_requested(self) -> bool:
        """True once someone asked to cancel this request while it runs (``receipt.cancel()``).

        A running request is never interrupted; a long task may check this and stop early
        (return, or raise ``keyqueue.Reject``) if it wants to.
        """
        check = self._cancel_check
        return check is not None and check()

    def lease_valid(self) -> bool:
        """True while this worker still owns the key; check it before an irreversible step."""
        return self._core.lease_valid()

    def check_lease(self) -> None:
        """Raise ``LeaseLost`` unless this worker still owns the key."""
        self._core.check_lease()

    async def progress(self, value: Any = None, headers: Mapping[str, str] | None = None) -> None:
        """Publish ``value`` (a plain value: map, list, text, number...) on the key's progress subject,
        and keep it as the request's last progress.

        ``keyqueue watch QUEUE KEY`` shows it live; ``App.progress(request_id)`` (and
        ``App.status(request_id, progress=True)``) returns the last one kept, from any process.
        Keeping is coalesced: at most about one write a second per run, and the last value is
        always kept when the run ends (``keyqueue.app.progress``). Raises ``LeaseLost`` if the key
        was lost and ``MalformedBody`` if ``value`` is not plain.
        """
        body = dumps(value, CBOR)
        sent = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: PROGRESS_TYPE, H.MESSAGE_VERSION: "1", H.TASK: self.task,
                H.ATTEMPT: str(self.attempt), **(headers or {})}
        await self._core.progress(body, sent)
        if self._keep_progress is not None:
            self._keep_progress(body, {**sent, H.KEY: self.key})

    def progress_sync(self, value: Any = None, headers: Mapping[str, str] | None = None) -> None:
        """``progress`` for sync task functions, which run in a thread: blocks until published."""
        future = asyncio.run_coroutine_threadsafe(self.progress(value, headers), self._loop)
        future.result(_PROGRESS_TIMEOUT)
