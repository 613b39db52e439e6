"""Every hook keyqueue calls, grouped by lifecycle. Implement them with ``@keyqueue.hookimpl``.

A plugin is a module, class instance or any object with ``keyqueue_*`` functions marked with
``keyqueue.hookimpl``; it may implement any subset of a hook's arguments. Plugins come from
``App(plugins=[...])``, from the ``keyqueue`` entry-point group (unless
``KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD`` is set), and keyqueue's own behaviour is plugins too
(``keyqueue.plugins.manager.BUILTIN_PLUGINS``).

Call order. pluggy calls the most recently registered plugin first (``tryfirst`` / ``trylast``
move an implementation to either end), so built-in plugins run last. Hooks come in pairs that
open and close something (worker started / stopping, key acquired / released, request started /
its outcome): *opening* hooks run in that order, *closing* hooks in the reverse order, so the
plugin that opened first closes last, like nested ``with`` blocks.

Sync or async. pluggy does not await, so keyqueue does: wherever a spec says "may be async", an
implementation may be an ``async def`` (or return an awaitable) and keyqueue awaits it. A
``firstresult`` hook takes the first result that is not ``None``; an implementation that wants
to decline must therefore return ``None`` synchronously (a coroutine is never ``None``).

Unkeyed requests. The requests of a task declared without ``key=`` run in each worker's unkeyed
lane (``keyqueue.core.unkeyed``), not in key sessions: the request hooks fire for them as for any
request, with ``key`` ``"~"`` (``keyqueue.UNKEYED``), and the key hooks never do.

Failures. Lifecycle hooks (worker, key and request events) are observers: an exception in one
is logged with the plugin's name and the worker goes on. Exceptions in the other hooks
propagate to whoever triggered them (the ``App``, the worker's processor, the CLI).

When. A worker calls the key, request and pin hooks in order from one dispatcher task, shortly
after the event; an implementation marked ``@keyqueue.inline_observer`` (a plain function that
only counts or keeps something) is called at the event itself (docs/plugins.md, "Inline observers").

Around-style hooks (``keyqueue_wrap_enqueue``, ``keyqueue_wrap_process``) return a context
manager (sync or async) or ``None``; keyqueue enters them in call order around the operation and
exits them in reverse, so a tracing plugin can hold a span open for exactly the operation.
pluggy's own ``wrapper=True`` / ``hookwrapper=True`` are not supported on keyqueue hooks: they
cannot wrap work that is awaited after the hook call returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Any, Final

import pluggy

if TYPE_CHECKING:
    import click

    from keyqueue.app.application import App
    from keyqueue.app.worker import Worker
    from keyqueue.core.processor import KeyProcessor, Reply, Request, RequestContext
    from keyqueue.core.retry import RetryPolicy
    from keyqueue.tasks.task import TaskRequest, TaskSpec

PROJECT: Final = "keyqueue"
"""pluggy's project name: the marker name and the prefix of every hook."""

hookspec = pluggy.HookspecMarker(PROJECT)

Wrapper = AbstractContextManager[Any] | AbstractAsyncContextManager[Any]
"""What an around-style hook returns: a context manager, sync or async."""


# --- setup: what an app serves --------------------------------------------------------------------


@hookspec
def keyqueue_register(app: App) -> None:
    """Register tasks and processors with ``app``.

    Fires once per app, the first time its plugins are needed (a worker starts, a task is
    looked up by name, ``app.plugins`` is read). Use ``app.task(...)(function)`` for tasks and
    ``app.register_processor(queue, factory)`` for per-key processors (``KeyProcessor``).
    Sync. The return value is ignored.
    """


@hookspec
def keyqueue_add_commands(cli: click.Group) -> None:
    """Add commands to the ``keyqueue`` command line with ``cli.add_command(...)``.

    Fires once per ``keyqueue`` invocation, when the command line looks up a command that is
    not built in (or lists them all for ``--help``). Sync. The return value is ignored.
    """


# --- processors: who handles a key ----------------------------------------------------------------


@hookspec(firstresult=True)
def keyqueue_build_processor(
    app: App, worker: Worker, queue: str, key: str
) -> KeyProcessor | Awaitable[KeyProcessor] | None:
    """Build the processor for one key session of ``queue``.

    Fires at the start of every key session, in ``worker``, which acquired the key. Return a
    ``KeyProcessor`` (``open``, ``handle`` or ``handle_batch``, ``idle``, ``close``), an
    awaitable of one (may be async), or ``None`` to leave the key to another plugin. The
    built-in implementation (``trylast``) returns the factory registered with
    ``app.register_processor`` for the queue, else the default processor that runs the queue's
    ``@task`` functions.

    Also fires once when a worker starts a queue's unkeyed lane, with ``key`` ``"~"``: the
    processor returned then handles every unkeyed request of the queue that worker runs, several
    at once (``handle`` only; ``idle`` is never called). The built-in one runs the app's unkeyed
    tasks.
    """


@hookspec(firstresult=True)
def keyqueue_retry_policy(app: App, queue: str, task: TaskSpec | None, request: Request) -> RetryPolicy | None:
    """The retry policy (attempts and backoff) for a request of ``task``.

    Fires when a default-processor request is read, before its first attempt; ``task`` is
    ``None`` when the request names no task of the queue (it will be dead-lettered). Sync.
    Return a ``RetryPolicy``, or ``None`` to fall through; the built-in implementation
    (``trylast``) builds it from the task's ``max_attempts`` and ``backoff``.
    """


@hookspec(firstresult=True)
def keyqueue_merge_arguments(task: TaskSpec, arguments: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Fold the pending requests of a ``merge`` task into the arguments of one run.

    Fires once per run of a task with ``policy="merge"``, with the decoded arguments of every
    request taken for the run, oldest first. Sync. Return the merged arguments (they must fit
    the task's signature), or ``None`` to fall through; the built-in implementation
    (``trylast``) calls the task's ``merge=`` function. When nothing merges, the requests are
    dead-lettered with a ``Reject`` saying so.
    """


# --- worker lifecycle -----------------------------------------------------------------------------


@hookspec
def keyqueue_worker_started(worker: Worker) -> Awaitable[None] | None:
    """The worker's queues are set up and it is taking keys.

    Fires once per worker, in its own event loop, before ``App.worker()`` returns from
    ``__aenter__``. Opening hook. May be async. The return value is ignored.
    """


@hookspec
def keyqueue_worker_stopping(worker: Worker) -> Awaitable[None] | None:
    """The worker stopped taking keys and has drained; it is about to close.

    Fires once per started worker, after every key session ended and every lifecycle event was
    delivered. Closing hook (reverse order). May be async. The return value is ignored.
    """


@hookspec
def keyqueue_worker_pinned(worker: Worker, queue: str, pin_id: str) -> Awaitable[None] | None:
    """This worker became the pinned client of ``queue`` (priority policy ``pinned_client``).

    It now takes all of the queue's keys; standbys take over if it goes silent for the queue's
    ``priority_timeout``. Opening hook. May be async.
    """


@hookspec
def keyqueue_worker_unpinned(worker: Worker, queue: str, pin_id: str) -> Awaitable[None] | None:
    """This worker is no longer the pinned client of ``queue`` (the server moved or cleared the pin).

    Closing hook (reverse order). May be async.
    """


# --- key lifecycle --------------------------------------------------------------------------------


@hookspec
def keyqueue_key_acquired(worker: Worker, queue: str, key: str, fencing: tuple[int, int]) -> Awaitable[None] | None:
    """This worker acquired ``key`` and starts a key session for it.

    ``fencing`` is ``(lease record sequence, token delivery count)``, strictly increasing from one holder of
    the key to the next. Opening hook. May be async. Delivered in order with the other events of
    the worker, shortly after they happen (a session waits only once 10,000 events are queued).
    """


@hookspec
def keyqueue_key_released(worker: Worker, queue: str, key: str, outcome: str) -> Awaitable[None] | None:
    """The key session for ``key`` ended.

    ``outcome`` is ``released`` (quiescent, token acked), ``handed-off`` (drained at shutdown,
    token given back), ``lease-lost``, ``failed`` (the processor or NATS failed; the token is
    redelivered later) or ``interrupted`` (cut off by the drain deadline). Closing hook (reverse
    order). May be async.
    """


# --- request lifecycle ----------------------------------------------------------------------------


@hookspec
def keyqueue_request_started(
    worker: Worker, queue: str, key: str, request_id: str, message_type: str, attempt: int,
    enqueued_at: float | None,
) -> Awaitable[None] | None:
    """An attempt at a request begins (for a batch: once, for its first request).

    ``message_type`` is the request's ``X-MESSAGE-TYPE`` (the task name for tasks); ``attempt``
    counts from 1. ``enqueued_at`` is when the server stored the request in its key's inbox (Unix
    seconds on the server's clock, from the stored message, whatever its request id), or None if
    unknown: ``time.time() - enqueued_at`` is its wait, as exact as the two hosts' clocks agree.
    Opening hook. May be async.
    """


@hookspec
def keyqueue_request_failed(
    worker: Worker, queue: str, key: str, request_id: str, message_type: str, attempt: int, error: BaseException,
    elapsed: float,
) -> Awaitable[None] | None:
    """An attempt raised ``error``; a ``retried`` or ``dead_lettered`` event follows.

    ``elapsed`` is the failed attempt's duration in seconds. Closing hook (reverse order). May be async.
    """


@hookspec
def keyqueue_request_retried(
    worker: Worker, queue: str, key: str, request_id: str, message_type: str, attempt: int, delay: float, error: str
) -> Awaitable[None] | None:
    """Attempt ``attempt`` failed; the request stays at the head and runs again after ``delay`` s.

    ``error`` is ``"ExceptionType: message"``. Closing hook (reverse order). May be async.
    """


@hookspec
def keyqueue_request_succeeded(
    worker: Worker, queue: str, key: str, request_id: str, message_type: str, elapsed: float
) -> Awaitable[None] | None:
    """The request was processed and removed from the inbox (and its caller answered).

    ``elapsed`` is the successful attempt's duration in seconds (for a batch, the batch's).
    Closing hook (reverse order). May be async.
    """


@hookspec
def keyqueue_request_superseded(
    worker: Worker, queue: str, key: str, request_id: str, message_type: str, superseded_by: str
) -> Awaitable[None] | None:
    """A newer request for the key (``superseded_by``) replaced this one (policy ``latest``).

    The request was removed without running; its caller was told which request replaced it.
    Closing hook (reverse order). May be async.
    """


@hookspec
def keyqueue_request_dead_lettered(
    worker: Worker,
    queue: str,
    key: str,
    request_id: str,
    message_type: str,
    reason: str,
    attempts: int,
    error: str,
) -> Awaitable[None] | None:
    """The request was moved to the queue's dead-letter queue.

    ``reason`` is ``rejected`` (bad input, unknown task or version, ``Reject``),
    ``max-attempts`` or ``crash-loop``; ``error`` is ``"ExceptionType: message"``. Closing hook
    (reverse order). May be async.
    """


# --- a request's outcome, on the key session's path -----------------------------------------------


@hookspec
def keyqueue_request_settled(
    app: App, queue: str, key: str, request: Request, task: TaskSpec | None, status: str, reply: Reply | None,
    error: BaseException | None, reason: str | None, elapsed: float, context: RequestContext,
) -> Awaitable[None] | None:
    """A request of the default processor reached its final outcome, and is still in its inbox.

    ``status`` is ``ok`` (``reply`` is the task's reply: its body is the encoded result when a caller
    waits, the task keeps results or the request is a workflow step), ``dead-lettered`` (``error``
    is the final failure and ``reason`` says why: ``rejected``, ``not-retried`` or ``max-attempts``;
    the session dead-letters it next), ``cancelled`` or ``expired`` (it did not run). ``task`` is
    None for a request that names no task of the queue; ``elapsed`` is the run's seconds (0 if it
    did not run); ``context`` is the request's (``check_lease``, and ``steady`` to retry keyqueue's
    own NATS steps within the lease).

    Fires in the key session, on its path, after a kept result was sent and before the session
    removes the request: what an implementation has stored when it returns is stored before the
    request leaves the inbox. A worker that dies in between runs the request again, and this hook
    again, so implementations must be idempotent. May be async (awaited: the key's next request
    waits for it). Raise only ``LeaseLost`` (the session ends; the key's next holder runs the
    request again); any other exception is logged and the request is removed all the same (it
    ran). A request the session dead-letters without an attempt (``crash-loop``) does not pass
    here (``keyqueue_request_dead_lettered`` does). The built-in workflows plugin
    (``keyqueue.builtins.workflows``) carries a workflow on from here.
    """


# --- workflows ------------------------------------------------------------------------------------


@hookspec
def keyqueue_workflow_changed(
    app: App, queue: str, workflow_id: str, change: str, step: int | None, task: str | None, key: str | None,
    reason: str | None,
) -> Awaitable[None] | None:
    """A workflow (``chain``, ``group``, ``chord``) changed state, in the process that changed it.

    ``change`` is ``started`` (its plan is stored and its first steps enqueued: in the producer),
    ``joined`` (a group's parts are all done and its list handed on), ``failed`` (``step`` failed
    for good; ``reason`` says why), ``resumed`` (a failed step's dead-letter replay succeeded),
    ``done`` (its result is stored) or ``cancelled``. ``queue``, ``key`` and ``task`` are the step's
    where one is concerned, else the workflow's queue and None. An observer: failures are logged,
    never raised. May be async.
    """


# --- around-style: tracing and the like -----------------------------------------------------------


@hookspec
def keyqueue_wrap_enqueue(app: App, request: TaskRequest) -> Wrapper | None:
    """Wrap the publishing of one task request, e.g. in a tracing span.

    Fires for every request ``enqueue``, ``call``, ``delay`` and ``enqueue_many`` publish
    (``enqueue_many``: all requests' wrappers are entered before the bulk publish). Return a
    context manager (sync or async) or ``None``. Inside it, ``request.headers`` may be changed
    (to add ``traceparent``, say); after the publish ``request.receipt`` is set. An exception
    raised while entering aborts the enqueue.
    """


@hookspec
def keyqueue_wrap_process(
    queue: str, key: str, requests: Sequence[Request], context: RequestContext
) -> Wrapper | None:
    """Wrap one attempt at processing ``requests`` (one, or a batch) with any processor.

    Return a context manager (sync or async) or ``None``; the attempt's exception, if any,
    passes through it (it may observe it; it should not swallow it). Runs in the worker's key
    session, so keep it quick.
    """
