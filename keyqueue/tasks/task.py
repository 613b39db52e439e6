"""Tasks: ``@app.task`` / ``@keyqueue.task``, and ``enqueue`` / ``call`` / ``delay`` / ``enqueue_many``
(``call_sync`` / ``enqueue_many_sync``: the sync forms; ``delay_on_commit``: ``delay`` once the
current Django transaction commits).

``Task[F]`` is generic over the function ``F`` it wraps: its methods are typed by ``F``'s
parameters (less the optional context) and result, so mypy checks
``charge.enqueue(order_id="o1", amount=5)`` against ``charge``'s signature and knows what
``charge.call(...)`` returns. (Generic over the whole function rather than ``P`` and ``R``
apart because mypy cannot otherwise tell a context parameter from an ordinary one when the
signature mentions ``Any``.) A task with ``policy="batch"`` is a ``BatchTask[T, R]``: its
function takes ``list[T]`` and each request carries one ``T``.

A task sends its requests through a ``Dispatcher``: the part of its app it needs (``publish``,
``ask``, ``run_sync``), which ``keyqueue.App`` implements. The app layer sits above this one.

Policies (how a key's backlog is consumed):

- ``serial`` (default): every request, one at a time, in order.
- ``batch``: every available request of the key (up to ``max_batch``) in one call; the function
  returns one result per item (or ``None``); the requests are removed together afterwards.
- ``latest``: only the newest available request runs; older ones are removed and their callers
  get ``Superseded`` naming the request that replaced them.
- ``merge``: the available requests are folded into one run by ``merge=`` (or a plugin's
  ``keyqueue_merge_arguments``); every caller gets that run's result.

Every ``call`` takes ``timeout=`` (seconds to wait for the result; ``DEFAULT_CALL_TIMEOUT`` by
default), unless the function has a parameter of that name. mypy cannot check a function's
arguments beside an extra keyword (PEP 612): ``charge.call(..., timeout=10)`` type-checks with
the result typed but the arguments unchecked, while ``charge.options(timeout=10).call(...)``
checks both.

``options(countdown=seconds)`` or ``options(eta=aware_datetime)`` delays a request (``Delay``,
``keyqueue.tasks.delay``): it is stored at once and joins its key's order at its due time; its
receipt's ``due`` says when.

A task function must not ``call`` a task on the key its own run holds (the same queue and key):
that request cannot start before the run ends. ``call`` raises ``CallOnOwnKey`` at once (a
``Reject``: the running request is dead-lettered, not retried); ``enqueue`` stays allowed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import inspect
import logging
import typing
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Concatenate, Final, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import CallOnOwnKey, ConfigError, MalformedBody
from keyqueue.jetstream.subjects import UNKEYED, validate_queue_name, validate_request_id
from keyqueue.tasks.argument_types import check_value, type_check
from keyqueue.tasks.arguments import ArgumentCodec, KeyMaker, Upgrade, check_upgrades, decode_result, takes_context
from keyqueue.tasks.canvas import Signature
from keyqueue.tasks.context import Context, Progress
from keyqueue.tasks.delay import Delay
from keyqueue.tasks.invoke import invoke
from keyqueue.tasks.rate_limit import RateLimit
from keyqueue.wire import CBOR, check_plain, dumps, from_fields, new_request_id, to_fields
from keyqueue.wire import headers as H

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "POLICIES",
    "SYNC_BOUND",
    "Backoff",
    "BatchTask",
    "BatchTaskCall",
    "Dispatcher",
    "KeySpec",
    "Policy",
    "Receipt",
    "RequestLookup",
    "Task",
    "TaskCall",
    "TaskRequest",
    "TaskSpec",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("keyqueue.task")

Policy = Literal["serial", "batch", "latest", "merge"]
POLICIES: Final = ("serial", "batch", "latest", "merge")
"""The per-key policies, ``serial`` first (the default)."""

DEFAULT_CALL_TIMEOUT: Final = 30.0
"""Seconds ``call`` waits for a result unless told otherwise."""

SYNC_BOUND: Final = 60.0
"""Seconds a sync call waits beyond what it waits for by design (a ``call``'s own timeout): an
enqueue's longest path is a first connect (2 x ``connect_timeout`` + 1, 11 s by default), a
producer's outage wait (15 s) and a few JetStream replies (5 s each)."""


KeySpec = str | Callable[..., str]
"""A key template over the task's arguments (``"{order_id}"``) or a callable returning the key
(``None`` where a task takes one: an unkeyed task)."""

Merge = Callable[[Sequence[dict[str, Any]]], dict[str, Any]]
"""Folds the argument maps of a ``merge`` task's pending requests (oldest first) into one."""

_RUNNING: Final = contextvars.ContextVar[tuple[str, str, str] | None]("keyqueue_running_task", default=None)
"""``(queue, key, task)`` of the task function running in this context (a worker's run), so that
``call`` can refuse to wait for a request on the key that run holds. ``invoke`` copies the
context into the thread of a sync function, so it is seen there too."""


# --- values --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff between attempts: ``base * factor ** (attempt - 1)``, capped, with jitter."""

    base: float = 0.5
    factor: float = 2.0
    max: float = 60.0
    jitter: float = 0.2
    """Fraction of each delay drawn at random (+/-), so retries of many keys do not align."""


@dataclass(frozen=True)
class TaskSpec:
    """Everything about a task but its function: what the worker and the plugins see."""

    name: str
    queue: str
    policy: Policy = "serial"
    max_attempts: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    timeout: float | None = None
    """The hard limit: seconds one attempt may run before it is stopped; it then fails (and is retried)."""
    soft_timeout: float | None = None
    """Seconds after which ``SoftTimeout`` is raised inside the attempt (it may catch it to clean up)."""
    retry_on: tuple[type[BaseException], ...] | None = None
    """Only these exceptions (and their subclasses) are retried; any other dead-letters at once
    (reason ``not-retried``). None: every exception is retried, up to ``max_attempts``."""
    version: int = 1
    upgrades: Mapping[int, Upgrade] = field(default_factory=dict)
    max_batch: int = 100
    """Most requests one run takes (``batch``, ``latest``, ``merge``)."""
    merge: Merge | None = None
    result_ttl: float | None = None
    """Seconds each request's result (or error) is kept, found by request id (None: the app's default;
    0: none kept, whatever the app's default)."""
    rate_limit: RateLimit | None = None
    """At most this many runs per key per period, across the fleet (``rate_limit="10/m"``); for an
    unkeyed task, runs of the task per period across the fleet."""
    unkeyed: bool = False
    """Declared without ``key=``: no exclusivity, no order; its requests go to the queue's work stream
    and run beside any other (``keyqueue.core.unkeyed``)."""

    def kept_for(self, default: float | None) -> float | None:
        """Seconds this task's results are kept, given the app's ``default``; None: none are kept.

        Its own ``result_ttl`` wins; ``result_ttl=0`` opts out of the app's default.
        """
        ttl = self.result_ttl if self.result_ttl is not None else default
        return ttl or None

    def __post_init__(self) -> None:
        validate_queue_name(self.queue)
        if self.result_ttl is not None and not (self.result_ttl == 0 or self.result_ttl >= 1):
            raise ConfigError(f"task {self.name}: result_ttl must be at least 1 second, or 0 to keep no results "
                              f"(None: the app's default), got {self.result_ttl}")
        if not self.name or any(c.isspace() or ord(c) < 32 for c in self.name):
            raise ConfigError(f"task name {self.name!r} must be non-empty text without spaces")
        if self.policy not in POLICIES:
            raise ConfigError(f"task {self.name}: policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.max_batch < 1:
            raise ConfigError(f"task {self.name}: max_batch must be at least 1, got {self.max_batch}")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"task {self.name}: timeout must be a positive number of seconds, got {self.timeout}")
        if self.soft_timeout is not None and not self.soft_timeout > 0:
            raise ConfigError(f"task {self.name}: soft_timeout must be a positive number of seconds, "
                              f"got {self.soft_timeout}")
        if self.soft_timeout is not None and self.timeout is not None and not self.soft_timeout < self.timeout:
            raise ConfigError(f"task {self.name}: soft_timeout ({self.soft_timeout}s) must come before the hard "
                              f"timeout ({self.timeout}s)")
        if self.retry_on is not None and not all(isinstance(e, type) and issubclass(e, BaseException)
                                                 for e in self.retry_on):
            raise ConfigError(f"task {self.name}: retry_on takes exception classes, got {self.retry_on!r}")
        if self.merge is not None and self.policy != "merge":
            raise ConfigError(f"task {self.name}: merge= is only used with policy='merge'")
        if self.unkeyed and self.policy != "serial":
            raise ConfigError(f"task {self.name}: policy {self.policy!r} takes a key's pending requests together, so "
                              "it needs key=; a task without a key runs each request on its own")
        check_upgrades(self.name, self.version, self.upgrades)
        self.retry_policy()  # validates max_attempts and backoff now, not at the first failure

    def retry_policy(self) -> RetryPolicy:
        """The core's retry policy for this task's attempts and backoff."""
        b = self.backoff
        return RetryPolicy(max_attempts=self.max_attempts, base_delay=b.base, factor=b.factor,
                           max_delay=b.max, jitter=b.jitter, retry_on=self.retry_on)


@dataclass(frozen=True)
class Receipt:
    """Where an enqueued request was stored."""

    request_id: str
    key: str
    """The request's key; ``~`` (``keyqueue.UNKEYED``) for a request of an unkeyed task."""
    seq: int
    """The request's sequence in the queue's inbox stream (an unkeyed request's: in its work stream)."""
    duplicate: bool
    """True if a request with this id was already stored (within the duplicate window): nothing new was stored."""
    queue: str = ""
    task: str = ""
    due: datetime.datetime | None = None
    """For a delayed request, when it joins its key's order (UTC); ``seq`` is then its sequence in the
    queue's schedules stream, where it waits until then."""
    source: RequestLookup | None = field(default=None, repr=False, compare=False)
    """The app that stored it (set by ``App.publish``), for ``result`` and ``cancel``."""

    def _lookup(self) -> RequestLookup:
        if self.source is None:
            raise ConfigError("this receipt was not returned by an app; use App.result / App.cancel / App.status")
        return self.source

    @property
    def _inbox_seq(self) -> int | None:
        # A delayed request's seq is in the schedules stream, not the inbox: not a clue to its state.
        return self.seq if self.due is None else None

    async def result(self, timeout: float = DEFAULT_CALL_TIMEOUT) -> Any:
        """The request's result, waiting up to ``timeout`` seconds for it (see ``App.result``)."""
        return await self._lookup().result(self.request_id, queue=self.queue, timeout=timeout, task=self.task)

    async def cancel(self) -> str:
        """Cancel the request unless it has started; what became of it (see ``App.cancel``)."""
        return await self._lookup().cancel(self.request_id, queue=self.queue, seq=self._inbox_seq, key=self.key)

    async def status(self) -> str:
        """Where the request is: pending, scheduled, running, done, failed, cancelled, expired (``App.status``)."""
        return await self._lookup().status(self.request_id, queue=self.queue, seq=self._inbox_seq, key=self.key)

    def result_sync(self, timeout: float = DEFAULT_CALL_TIMEOUT) -> Any:
        """``result`` for code without a running event loop."""
        return self._lookup().result_sync(self.request_id, queue=self.queue, timeout=timeout, task=self.task)

    def cancel_sync(self) -> str:
        """``cancel`` for code without a running event loop."""
        return self._lookup().cancel_sync(self.request_id, queue=self.queue, seq=self._inbox_seq, key=self.key)

    def status_sync(self) -> str:
        """``status`` for code without a running event loop."""
        return self._lookup().status_sync(self.request_id, queue=self.queue, seq=self._inbox_seq, key=self.key)

    async def progress(self) -> Progress | None:
        """The last progress the request's task reported, as kept (see ``App.progress``)."""
        return await self._lookup().progress(self.request_id, queue=self.queue)

    def progress_sync(self) -> Progress | None:
        """``progress`` for code without a running event loop."""
        return self._lookup().progress_sync(self.request_id, queue=self.queue)


class RequestLookup(Protocol):
    """Finding a stored request by id: what a ``Receipt`` asks its app (``keyqueue.App`` implements this)."""

    async def result(self, request_id: str, *, queue: str | None = None, timeout: float = DEFAULT_CALL_TIMEOUT,
                     task: str | None = None) -> Any:
        """The request's kept result (or its error, raised)."""

    async def cancel(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                     key: str | None = None) -> str:
        """Cancel the request unless it started; its state."""

    async def status(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                     key: str | None = None) -> str:
        """Where the request is."""

    def result_sync(self, request_id: str, *, queue: str | None = None, timeout: float = DEFAULT_CALL_TIMEOUT,
                    task: str | None = None) -> Any:
        """``result`` from code without a running event loop."""

    def cancel_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None) -> str:
        """``cancel`` from code without a running event loop."""

    def status_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None) -> str:
        """``status`` from code without a running event loop."""

    async def progress(self, request_id: str, *, queue: str | None = None) -> Progress | None:
        """The request's last kept progress."""

    def progress_sync(self, request_id: str, *, queue: str | None = None) -> Progress | None:
        """``progress`` from code without a running event loop."""


@dataclass
class TaskRequest:
    """One request on its way out; ``keyqueue_wrap_enqueue`` hooks may add headers."""

    queue: str
    key: str
    message_type: str
    """``X-MESSAGE-TYPE``: the task's name, or a message type's for ``App.enqueue_message``."""
    request_id: str
    arguments: Mapping[str, Any]
    """The body's plain field map."""
    headers: dict[str, str]
    body: bytes
    task: TaskSpec | None = None
    """The task, unless the request is a message for a processor (``App.enqueue_message``)."""
    receipt: Receipt | None = None
    """Set once the request is stored."""
    delay: Delay | None = None
    """When the request may start (``options(countdown=...)`` / ``options(eta=...)``); None: at once."""


@dataclass(frozen=True)
class CallOptions:
    """Per-call options: ``options(request_id=..., timeout=...)``."""

    request_id: str | None = None
    """The request id (``Nats-Msg-Id``): the same id within the duplicate window stores nothing new."""
    timeout: float | None = None
    """Seconds ``call`` waits for the result (``DEFAULT_CALL_TIMEOUT`` when unset)."""
    delay: Delay | None = None
    """When the request may start: ``countdown=`` seconds from the enqueue, or at ``eta=``."""
    expires: float | datetime.datetime | None = None
    """Drop the request if it has not started by then: seconds from the enqueue, or an aware datetime."""
    queue: str | None = None
    """Send the request to this queue instead of the task's (``options(queue=...)``)."""


def _expiry(expires: float | datetime.datetime | None) -> float | datetime.datetime | None:
    """``expires=`` checked: a number of seconds > 0, or an aware datetime (``ConfigError`` otherwise)."""
    if expires is None:
        return None
    if isinstance(expires, datetime.datetime):
        if expires.tzinfo is None or expires.utcoffset() is None:
            raise ConfigError(f"expires {expires.isoformat()} is naive: give it a time zone")
        return expires
    if isinstance(expires, bool) or not isinstance(expires, int | float) or not expires > 0:
        raise ConfigError(f"expires must be a number of seconds > 0 or an aware datetime, not {expires!r}")
    return float(expires)


class Dispatcher(Protocol):
    """What a task sends its requests through: its app (``App`` implements this).

    It is all ``keyqueue.tasks`` knows of the app, so this package never imports ``keyqueue.app``.
    """

    async def publish(self, requests: Sequence[TaskRequest]) -> list[Receipt]:
        """Store the requests (of one queue) in order; ``EnqueueError`` if any was not stored."""

    async def ask(self, request: TaskRequest, timeout: float) -> tuple[Mapping[str, str], bytes]:
        """Store the request and wait for its reply: ``(headers, body)``; ``KeyqueueTimeout`` if none."""

    def run_sync(self, make: Callable[[], Awaitable[T]], *, bound: float | None = None,
                 what: str = "a sync call") -> T:
        """Run ``make()`` to completion from code without a running event loop (``delay``), waiting at
        most ``bound`` seconds (None: the app's default bound); ``what`` names the work in its timeout."""


# --- tasks ---------------------------------------------------------------------------------------


class _TaskBase:
    """What every task has: its function, spec and dispatcher, and the send / ask paths.

    ``dispatcher`` is called on each use rather than once: a ``@keyqueue.task`` may be declared
    before the app it belongs to (the default app) exists.
    """

    spec: TaskSpec

    def __init__(self, fn: Callable[..., Any], spec: TaskSpec, dispatcher: Callable[[], Dispatcher]) -> None:
        self.fn = fn
        self.spec = spec
        self._dispatcher = dispatcher
        self.takes_context = takes_context(fn)
        functools.update_wrapper(typing.cast(Any, self), fn)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec.name} queue={self.spec.queue} policy={self.spec.policy}>"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def queue(self) -> str:
        return self.spec.queue

    @property
    def app(self) -> Dispatcher:
        """The app this task belongs to (for ``@keyqueue.task``: the default app).

        At run time it is the ``keyqueue.App``; it is typed as the ``Dispatcher`` the task sends
        through because tasks sit below the app and must not import it. Code that needs the
        ``App`` itself has it already (it declared the task on it) or asks ``keyqueue.default_app()``.
        """
        return self._dispatcher()

    # --- the wire, implemented by each kind of task ---

    def fields_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(key, plain argument map)`` for one request."""
        raise NotImplementedError

    def fields_from_mapping(self, item: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(key, plain argument map)`` from one item of ``enqueue_many``."""
        raise NotImplementedError

    def result_type(self) -> type | None:
        return None

    # --- sending ---

    def _request(self, key: str, fields: dict[str, Any], request_id: str | None,
                 opts: CallOptions | None = None) -> TaskRequest:
        request_id = new_request_id() if request_id is None else validate_request_id(request_id)
        body = dumps(fields, CBOR)
        headers = {
            H.CONTENT_TYPE: CBOR,
            H.MESSAGE_TYPE: self.spec.name,
            H.MESSAGE_VERSION: str(self.spec.version),
            H.MSG_ID: request_id,
        }
        queue = self.spec.queue
        if opts is not None:
            if opts.expires is not None:
                deadline = (opts.expires if isinstance(opts.expires, datetime.datetime) else
                            datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=opts.expires))
                headers[H.EXPIRES] = deadline.astimezone(datetime.UTC).isoformat()
            if opts.queue is not None:
                queue = opts.queue
        return TaskRequest(queue, key, self.spec.name, request_id, fields, headers, body, self.spec)

    async def _enqueue(self, opts: CallOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Receipt:
        key, fields = self.fields_for(args, kwargs)
        request = self._request(key, fields, opts.request_id, opts)
        request.delay = opts.delay
        [receipt] = await self.app.publish([request])
        return receipt

    async def _call(self, opts: CallOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        key, fields = self.fields_for(args, kwargs)
        running = _RUNNING.get()
        queue = opts.queue or self.spec.queue
        # An unkeyed request waits for no key, so a run may call one (even of its own task).
        if running is not None and key != UNKEYED and running[:2] == (queue, key):
            raise CallOnOwnKey(running[2], self.spec.name, queue, key)
        request = self._request(key, fields, opts.request_id, opts)
        request.delay = opts.delay
        timeout = opts.timeout if opts.timeout is not None else DEFAULT_CALL_TIMEOUT
        headers, body = await self.app.ask(request, timeout)
        return decode_result(headers, body, request.request_id, self.result_type())

    async def _enqueue_many(self, items: Iterable[Any], as_mapping: bool, delay: Delay | None = None,
                            opts: CallOptions | None = None) -> list[Receipt]:
        requests = []
        for index, item in enumerate(items):
            try:
                key, fields = self.fields_from_mapping(item) if as_mapping else self.fields_for((item,), {})
            except (TypeError, MalformedBody, ConfigError) as exc:
                raise type(exc)(f"item {index}: {exc}") from None
            requests.append(self._request(key, fields, None, opts))
            requests[-1].delay = delay
        if not requests:
            return []
        return await self.app.publish(requests)

    def _delay(self, opts: CallOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Receipt:
        return self.app.run_sync(lambda: self._enqueue(opts, args, kwargs), what=f"{self.spec.name}.delay()")

    def _delay_on_commit(self, opts: CallOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        try:
            from django.db import transaction
        except ImportError:
            raise ConfigError("delay_on_commit enqueues when the current Django transaction commits: it needs "
                              "Django (pip install 'keyqueue[django]'); elsewhere use delay()") from None
        self.fields_for(args, kwargs)  # bad arguments raise here, in the view, rather than after the commit
        if opts.request_id is None:
            opts = dataclasses.replace(opts, request_id=new_request_id())
        transaction.on_commit(lambda: self._delay(opts, args, kwargs))
        assert opts.request_id is not None
        return opts.request_id

    def _enqueue_many_sync(self, items: Iterable[Any], as_mapping: bool, delay: Delay | None = None,
                           opts: CallOptions | None = None) -> list[Receipt]:
        listed = list(items)  # read in the caller's thread, not on the portal's loop
        return self.app.run_sync(lambda: self._enqueue_many(listed, as_mapping, delay, opts),
                                 what=f"{self.spec.name}.enqueue_many_sync()")

    def step_request(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, request_id: str,
                     headers: Mapping[str, str], queue: str | None = None, countdown: float | None = None,
                     expires: float | None = None) -> TaskRequest:
        """The request of one workflow step (``keyqueue.tasks.canvas``): as ``enqueue`` builds it, under
        the step's derived ``request_id`` and with the workflow's ``headers``. ``TypeError`` /
        ``MalformedBody`` if the arguments do not fit the task."""
        key, fields = self.fields_for(args, kwargs)
        opts = _options(self, None, None, countdown, None, expires, queue)
        request = self._request(key, fields, request_id, opts)
        request.headers.update(headers)
        request.delay = opts.delay
        return request

    def _call_sync(self, opts: CallOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        timeout = opts.timeout if opts.timeout is not None else DEFAULT_CALL_TIMEOUT
        return self.app.run_sync(lambda: self._call(opts, args, kwargs), bound=timeout + SYNC_BOUND,
                                 what=f"{self.spec.name}.call_sync()")

    # --- running (the worker side) ---

    async def run(self, context: Context | None, args: Sequence[Any], kwargs: Mapping[str, Any],
                  executor: Executor | None = None) -> Any:
        """Run the function once with decoded arguments (the default processor calls this).

        While it runs, ``call`` from it (or from tasks and threads it starts) refuses the key
        ``context`` holds: see ``CallOnOwnKey``.
        """
        if self.takes_context:
            args = [context, *args]
        token = _RUNNING.set((context.queue, context.key, self.spec.name)) if context is not None else None
        try:
            return await invoke(self.spec.name, self.fn, args, kwargs, timeout=self.spec.timeout,
                                soft_timeout=self.spec.soft_timeout, executor=executor)
        finally:
            if token is not None:
                _RUNNING.reset(token)


_WithContext = Callable[Concatenate[Context, P], Any]
_AsyncWithContext = Callable[Concatenate[Context, P], Coroutine[Any, Any, R]]
_SyncWithContext = Callable[Concatenate[Context, P], R]
_Async = Callable[P, Coroutine[Any, Any, R]]
_Sync = Callable[P, R]


class Task(_TaskBase, Generic[F]):
    """A task wrapping the function ``F``; ``enqueue`` / ``call`` take ``F``'s arguments, less the context."""

    def __init__(self, fn: F, spec: TaskSpec, key: KeySpec | None, dispatcher: Callable[[], Dispatcher]) -> None:
        if spec.policy == "batch":
            raise ConfigError(f"task {spec.name}: policy='batch' makes a BatchTask")
        super().__init__(fn, spec, dispatcher)
        self.codec = ArgumentCodec(fn, spec.name)
        self.keys = KeyMaker(key, spec.name, tuple(self.codec.signature.parameters))

    def fields_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        bound = self.codec.bind(args, kwargs)
        key = self.keys.make(bound.arguments, bound.args, bound.kwargs)
        return key, self.codec.to_fields(bound)

    def fields_from_mapping(self, item: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        if not isinstance(item, Mapping):
            raise TypeError(
                f"{self.spec.name}: enqueue_many takes maps of keyword arguments, not {type(item).__name__}"
            )
        return self.fields_for((), item)

    def result_type(self) -> type | None:
        return self.codec.result_dataclass

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task, a step of a workflow (``chain``, ``group``, ``chord``): in it, the
        result of what runs before it goes in front of ``args`` (``mul.s(8)`` after a step that
        returned 8 runs ``mul(8, 8)``). See ``keyqueue.tasks.canvas``."""
        return Signature(self, args, kwargs)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: a step that takes nothing from what runs before it."""
        return Signature(self, args, kwargs, immutable=True)

    def options(self, *, request_id: str | None = None, timeout: float | None = None,
                countdown: float | None = None, eta: datetime.datetime | None = None,
                expires: float | datetime.datetime | None = None, queue: str | None = None) -> TaskCall[F]:
        """This task with per-call options: ``await charge.options(timeout=10).call(...)``.

        ``countdown=`` (seconds) or ``eta=`` (an aware datetime) delays the request: it is stored at
        once and joins its key's order when it falls due (``InvalidSchedule`` for a naive ``eta`` or
        a negative ``countdown``). ``expires=`` (seconds from now, or an aware datetime): a request
        that has not started by then is dropped (``Expired``). ``queue=``: send it to that queue
        (whose workers run it; a key is exclusive within its queue).
        """
        return TaskCall(self, _options(self, request_id, timeout, countdown, eta, expires, queue))

    @overload
    async def enqueue(self: Task[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...
    @overload
    async def enqueue(self: Task[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...

    async def enqueue(self, *args: Any, **kwargs: Any) -> Receipt:
        """Store a request; returns once the server has it (not when it has run)."""
        return await self._enqueue(CallOptions(), args, kwargs)

    @overload
    async def call(self: Task[_AsyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: Task[_SyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: Task[_Async[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: Task[_Sync[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    # With timeout=, mypy checks the result's type but not the arguments (see the module docstring).
    @overload
    async def call(self: Task[Callable[..., Coroutine[Any, Any, R]]], *args: Any, timeout: float | None,
                   **kwargs: Any) -> R: ...
    @overload
    async def call(self: Task[Callable[..., R]], *args: Any, timeout: float | None, **kwargs: Any) -> R: ...

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        """Store a request and wait for its result; remote failures raise typed errors.

        ``RemoteError`` / ``DeadLettered`` carry the remote exception's ``type_name`` and
        ``message``; ``Superseded`` names the request that replaced this one; ``KeyqueueTimeout``
        if no result came in time (the request is stored and still runs); ``CallOnOwnKey`` from
        a task function calling a task on the key it holds. ``timeout=`` (seconds) is taken unless
        the function has a parameter of that name.
        """
        opts, arguments = self._call_timeout(CallOptions(), kwargs)
        return await self._call(opts, args, arguments)

    def _call_timeout(self, opts: CallOptions, kwargs: Mapping[str, Any]) -> tuple[CallOptions, Mapping[str, Any]]:
        """``opts`` with the ``timeout=`` of ``call``'s keywords, and the keywords left for the function."""
        if "timeout" not in kwargs or "timeout" in self.codec.signature.parameters:
            return opts, kwargs
        rest = dict(kwargs)
        return dataclasses.replace(opts, timeout=rest.pop("timeout")), rest

    @overload
    def delay(self: Task[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...
    @overload
    def delay(self: Task[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...

    def delay(self, *args: Any, **kwargs: Any) -> Receipt:
        """``enqueue`` for code without a running event loop (blocks until stored)."""
        return self._delay(CallOptions(), args, kwargs)

    @overload
    def delay_on_commit(self: Task[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> str: ...
    @overload
    def delay_on_commit(self: Task[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> str: ...

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> str:
        """``delay`` once the current Django transaction commits (at once outside one; never if it
        rolls back), so a worker never runs it before the rows it reads are committed. Bad arguments
        raise now. Returns the request's id (``options(request_id=...)`` chooses it)."""
        return self._delay_on_commit(CallOptions(), args, kwargs)

    @overload
    def call_sync(self: Task[_AsyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: Task[_SyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: Task[_Async[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: Task[_Sync[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: Task[Callable[..., Coroutine[Any, Any, R]]], *args: Any, timeout: float | None,
                  **kwargs: Any) -> R: ...
    @overload
    def call_sync(self: Task[Callable[..., R]], *args: Any, timeout: float | None, **kwargs: Any) -> R: ...

    def call_sync(self, *args: Any, **kwargs: Any) -> Any:
        """``call`` for code without a running event loop: blocks until the result comes (up to
        ``timeout=`` seconds, then ``KeyqueueTimeout``), safe in a forked process."""
        opts, arguments = self._call_timeout(CallOptions(), kwargs)
        return self._call_sync(opts, args, arguments)

    async def enqueue_many(self, items: Iterable[Mapping[str, Any]]) -> list[Receipt]:
        """Store many requests, each a map of keyword arguments, with pipelined publishes.

        Requests of one key are stored in the order given. If some are not stored (a full
        backlog, say), the others still are, and ``PartiallyEnqueued`` (an ``EnqueueError``) holds
        each item's receipt or error (``results``) and the stored ones' receipts (``receipts``).
        """
        return await self._enqueue_many(items, as_mapping=True)

    def enqueue_many_sync(self, items: Iterable[Mapping[str, Any]]) -> list[Receipt]:
        """``enqueue_many`` for code without a running event loop (as ``delay`` is ``enqueue``'s)."""
        return self._enqueue_many_sync(items, as_mapping=True)


class TaskCall(Generic[F]):
    """A task with per-call options (``Task.options(...)``)."""

    def __init__(self, task: Task[F], options: CallOptions) -> None:
        self.task = task
        self.call_options = options

    @overload
    async def enqueue(self: TaskCall[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...
    @overload
    async def enqueue(self: TaskCall[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...

    async def enqueue(self, *args: Any, **kwargs: Any) -> Receipt:
        return await self.task._enqueue(self.call_options, args, kwargs)

    @overload
    async def call(self: TaskCall[_AsyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: TaskCall[_SyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: TaskCall[_Async[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: TaskCall[_Sync[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call(self: TaskCall[Callable[..., Coroutine[Any, Any, R]]], *args: Any, timeout: float | None,
                   **kwargs: Any) -> R: ...
    @overload
    async def call(self: TaskCall[Callable[..., R]], *args: Any, timeout: float | None, **kwargs: Any) -> R: ...

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        """``Task.call`` with these options; a ``timeout=`` here wins over ``options(timeout=...)``."""
        opts, arguments = self.task._call_timeout(self.call_options, kwargs)
        return await self.task._call(opts, args, arguments)

    @overload
    def delay(self: TaskCall[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...
    @overload
    def delay(self: TaskCall[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> Receipt: ...

    def delay(self, *args: Any, **kwargs: Any) -> Receipt:
        return self.task._delay(self.call_options, args, kwargs)

    @overload
    def delay_on_commit(self: TaskCall[_WithContext[P]], *args: P.args, **kwargs: P.kwargs) -> str: ...
    @overload
    def delay_on_commit(self: TaskCall[Callable[P, Any]], *args: P.args, **kwargs: P.kwargs) -> str: ...

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> str:
        """``Task.delay_on_commit`` with these options."""
        return self.task._delay_on_commit(self.call_options, args, kwargs)

    @overload
    def call_sync(self: TaskCall[_AsyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: TaskCall[_SyncWithContext[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: TaskCall[_Async[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: TaskCall[_Sync[P, R]], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call_sync(self: TaskCall[Callable[..., Coroutine[Any, Any, R]]], *args: Any, timeout: float | None,
                  **kwargs: Any) -> R: ...
    @overload
    def call_sync(self: TaskCall[Callable[..., R]], *args: Any, timeout: float | None, **kwargs: Any) -> R: ...

    def call_sync(self, *args: Any, **kwargs: Any) -> Any:
        """``Task.call_sync`` with these options."""
        opts, arguments = self.task._call_timeout(self.call_options, kwargs)
        return self.task._call_sync(opts, args, arguments)

    async def enqueue_many(self, items: Iterable[Mapping[str, Any]]) -> list[Receipt]:
        """``Task.enqueue_many`` with these options' delay (each request gets its own id)."""
        _no_request_id(self.call_options)
        return await self.task._enqueue_many(items, as_mapping=True, delay=self.call_options.delay,
                                             opts=self.call_options)

    def enqueue_many_sync(self, items: Iterable[Mapping[str, Any]]) -> list[Receipt]:
        """``Task.enqueue_many_sync`` with these options' delay (each request gets its own id)."""
        _no_request_id(self.call_options)
        return self.task._enqueue_many_sync(items, as_mapping=True, delay=self.call_options.delay,
                                            opts=self.call_options)


class BatchTask(_TaskBase, Generic[T, R]):
    """A ``policy="batch"`` task: its function takes ``list[T]``; each request carries one ``T``.

    The function returns one result per item, in order (each caller gets its own), or ``None``.
    """

    ITEM: Final = "item"
    """The one field of a batch request's body."""

    def __init__(self, fn: Callable[..., Any], spec: TaskSpec, key: KeySpec | None,
                 dispatcher: Callable[[], Dispatcher]) -> None:
        if spec.policy != "batch":
            raise ConfigError(f"task {spec.name}: a BatchTask needs policy='batch'")
        super().__init__(fn, spec, dispatcher)
        params = list(inspect.signature(fn).parameters.values())[1 if self.takes_context else 0 :]
        if len(params) != 1:
            raise ConfigError(
                f"batch task {spec.name} must take one list parameter (after the optional context), "
                f"like def {fn.__name__}(ctx: keyqueue.Context, items: list[Item])"
            )
        item_hint = self._item_hint(fn, params[0].name)
        self.item_type = item_hint if isinstance(item_hint, type) and dataclasses.is_dataclass(item_hint) else None
        self._check_item = type_check(item_hint) if item_hint is not None else None
        fields = tuple(f.name for f in dataclasses.fields(self.item_type)) if self.item_type is not None else None
        self.keys = KeyMaker(key, spec.name, fields)

    @staticmethod
    def _item_hint(fn: Callable[..., Any], param: str) -> Any:
        """The annotation of one item (``Reading`` for ``list[Reading]``), or None."""
        try:
            hint = typing.get_type_hints(fn).get(param)
        except Exception:
            return None
        args = typing.get_args(hint)
        return args[0] if args else None

    def fields_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        [item] = args
        if self._check_item is not None:
            check_value(self._check_item, item, f"{self.spec.name}(): item")
        if isinstance(item, Mapping):
            values: Mapping[str, Any] = item
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            values = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
        else:
            values = {self.ITEM: item}
        key = self.keys.make(values, (item,), {})
        plain = to_fields(item) if self.item_type is not None and dataclasses.is_dataclass(item) else item
        check_plain(plain, CBOR, path=f"{self.spec.name}: item")
        return key, {self.ITEM: plain}

    def fields_from_mapping(self, item: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        return self.fields_for((item,), {})

    def item_from_fields(self, fields: Mapping[str, Any]) -> Any:
        """One request's item from its decoded body."""
        if set(fields) != {self.ITEM}:
            raise MalformedBody(
                f"{self.spec.name}: a batch request's body is {{'item': ...}}, got fields {sorted(fields)}"
            )
        item = fields[self.ITEM]
        if self.item_type is not None:
            if not isinstance(item, dict):
                raise MalformedBody(f"{self.spec.name}: item must be a map of {self.item_type.__name__} fields")
            return from_fields(self.item_type, item)
        return item

    def options(self, *, request_id: str | None = None, timeout: float | None = None,
                countdown: float | None = None, eta: datetime.datetime | None = None,
                expires: float | datetime.datetime | None = None) -> BatchTaskCall[T, R]:
        """This task with per-call options (see ``Task.options``)."""
        return BatchTaskCall(self, _options(self, request_id, timeout, countdown, eta, expires, None))

    async def enqueue(self, item: T) -> Receipt:
        """Store a request carrying ``item``."""
        return await self._enqueue(CallOptions(), (item,), {})

    async def call(self, item: T, *, timeout: float | None = None) -> R:
        """Store a request and wait for its item's result, up to ``timeout`` seconds (see ``Task.call``)."""
        result: R = await self._call(CallOptions(timeout=timeout), (item,), {})
        return result

    def delay(self, item: T) -> Receipt:
        """``enqueue`` for code without a running event loop."""
        return self._delay(CallOptions(), (item,), {})

    def delay_on_commit(self, item: T) -> str:
        """``delay`` once the current Django transaction commits (see ``Task.delay_on_commit``)."""
        return self._delay_on_commit(CallOptions(), (item,), {})

    def call_sync(self, item: T, *, timeout: float | None = None) -> R:
        """``call`` for code without a running event loop."""
        result: R = self._call_sync(CallOptions(timeout=timeout), (item,), {})
        return result

    async def enqueue_many(self, items: Iterable[T]) -> list[Receipt]:
        """Store one request per item, pipelined (see ``Task.enqueue_many``)."""
        return await self._enqueue_many(items, as_mapping=False)

    def enqueue_many_sync(self, items: Iterable[T]) -> list[Receipt]:
        """``enqueue_many`` for code without a running event loop."""
        return self._enqueue_many_sync(items, as_mapping=False)


class BatchTaskCall(Generic[T, R]):
    """A batch task with per-call options (``BatchTask.options(...)``)."""

    def __init__(self, task: BatchTask[T, R], options: CallOptions) -> None:
        self.task = task
        self.call_options = options

    async def enqueue(self, item: T) -> Receipt:
        return await self.task._enqueue(self.call_options, (item,), {})

    async def call(self, item: T, *, timeout: float | None = None) -> R:
        """``BatchTask.call`` with these options; a ``timeout=`` here wins over ``options(timeout=...)``."""
        opts = self.call_options if timeout is None else dataclasses.replace(self.call_options, timeout=timeout)
        result: R = await self.task._call(opts, (item,), {})
        return result

    def delay(self, item: T) -> Receipt:
        return self.task._delay(self.call_options, (item,), {})

    def delay_on_commit(self, item: T) -> str:
        return self.task._delay_on_commit(self.call_options, (item,), {})

    def call_sync(self, item: T, *, timeout: float | None = None) -> R:
        opts = self.call_options if timeout is None else dataclasses.replace(self.call_options, timeout=timeout)
        result: R = self.task._call_sync(opts, (item,), {})
        return result

    async def enqueue_many(self, items: Iterable[T]) -> list[Receipt]:
        """``BatchTask.enqueue_many`` with these options' delay (each request gets its own id)."""
        _no_request_id(self.call_options)
        return await self.task._enqueue_many(items, as_mapping=False, delay=self.call_options.delay,
                                             opts=self.call_options)

    def enqueue_many_sync(self, items: Iterable[T]) -> list[Receipt]:
        """``BatchTask.enqueue_many_sync`` with these options' delay (each request gets its own id)."""
        _no_request_id(self.call_options)
        return self.task._enqueue_many_sync(items, as_mapping=False, delay=self.call_options.delay,
                                            opts=self.call_options)


def _options(task: _TaskBase, request_id: str | None, timeout: float | None, countdown: float | None,
             eta: datetime.datetime | None, expires: float | datetime.datetime | None,
             queue: str | None) -> CallOptions:
    if queue is not None:
        validate_queue_name(queue)
        if task.spec.policy != "serial":
            raise ConfigError(f"task {task.spec.name} (policy {task.spec.policy!r}) runs only in its own queue "
                              f"{task.spec.queue!r}: options(queue=...) is for serial tasks")
    return CallOptions(request_id, timeout, Delay.of(countdown, eta), _expiry(expires),
                       None if queue == task.spec.queue else queue)


def _no_request_id(options: CallOptions) -> None:
    if options.request_id is not None:
        raise ConfigError(
            "enqueue_many gives each request an id of its own: options(request_id=...) is for one request")


AnyTask = Task[Any] | BatchTask[Any, Any]
"""Either kind of task."""
