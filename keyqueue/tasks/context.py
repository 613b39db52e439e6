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
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from keyqueue.core.processor import RequestContext
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H

__all__ = ["CANCEL_CHECK", "PROGRESS_TYPE", "Context"]

PROGRESS_TYPE: Final = "keyqueue.Progress"
"""``X-MESSAGE-TYPE`` of progress messages (version 1; the body is one CBOR plain value)."""

_PROGRESS_TIMEOUT: Final = 10.0

CANCEL_CHECK: Final = contextvars.ContextVar[Callable[[], bool] | None]("keyqueue_cancel_check", default=None)
"""Set by the worker around a run: whether a cancel was asked for the running request (``Context.cancel_requested``)."""


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
        """Publish ``value`` (a plain value: map, list, text, number...) on the key's progress subject.

        ``keyqueue watch QUEUE KEY`` shows it live. Raises ``LeaseLost`` if the key was lost and
        ``MalformedBody`` if ``value`` is not plain.
        """
        body = dumps(value, CBOR)
        await self._core.progress(
            body,
            {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: PROGRESS_TYPE, H.MESSAGE_VERSION: "1", **(headers or {})},
        )

    def progress_sync(self, value: Any = None, headers: Mapping[str, str] | None = None) -> None:
        """``progress`` for sync task functions, which run in a thread: blocks until published."""
        future = asyncio.run_coroutine_threadsafe(self.progress(value, headers), self._loop)
        future.result(_PROGRESS_TIMEOUT)
