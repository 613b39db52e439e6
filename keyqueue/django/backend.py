"""A backend of Django's Tasks framework on keyqueue: the one that gives per-key exclusivity and order.

::

    # settings.py
    TASKS = {
        "default": {
            "BACKEND": "keyqueue.django.backend.KeyqueueBackend",
            "QUEUES": ["default", "emails"],                 # Django's default: ["default"]
            "OPTIONS": {"NAME": "shop", "RESULT_TTL": 86400},
        },
    }
    KEYQUEUE_URL = "nats://127.0.0.1:4222"                  # or the environment's KEYQUEUE_URL

    # shop/tasks.py
    from django.tasks import task                            # before Django 6: from django_tasks import task

    @task(key="{order_id}", max_attempts=5)
    def charge(order_id: str, amount: int) -> dict: ...

    result = charge.enqueue(order_id="o1", amount=5)         # or await charge.aenqueue(...)
    charge.get_result(result.id).status                      # from any process

    $ DJANGO_SETTINGS_MODULE=mysite.settings keyqueue worker keyqueue.django

How Django's concepts map (docs/decisions.md, "Django's Tasks framework on keyqueue"):

- ``@task(key=...)``: keyqueue's key, a template over the function's arguments or a callable taking
  them (Django 6.1 and the backport pass ``@task``'s extra keywords to the backend's ``task_class``,
  :class:`KeyqueueTask`). Requests of one key run one at a time, in order, on one worker at a time.
  Without ``key=`` each request is its own key: no order and no exclusivity, as other backends give.
  ``max_attempts`` (default 5) and ``timeout`` (seconds, a hard limit per attempt) are keyqueue's.
- ``queue_name``: queue ``Q`` of Django runs in keyqueue queue ``NAME`` (for ``default``) or
  ``NAME-Q``; ``NAME`` is the keyqueue app's name (``OPTIONS["NAME"]``, default ``django``).
- ``run_after``: a delayed request (keyqueue's ``eta``), held by nats-server until then.
- ``priority``: refused (``InvalidTask``) for anything but 0: keyqueue runs a key's requests in the
  order they were accepted; urgent work goes to a queue of its own with workers of its own.
- ``takes_context``: the function's first argument is Django's ``TaskContext``; its
  ``task_result.attempts`` counts keyqueue's attempts.
- ``TaskResult.id`` is keyqueue's request id (``app.status`` / ``app.cancel`` take it too);
  ``get_result`` works from any process for ``RESULT_TTL`` seconds (default a day) after the task ends.
  Each enqueue writes a small record (the task's path, arguments and queue) to a key-value bucket,
  ``kq_django_NAME``, which ``get_result`` reads.

``OPTIONS["APP"] = "mysite.kq:app"`` registers the tasks on that keyqueue ``App`` (declared with
``settings=keyqueue.django.django_settings``) instead of one of the backend's own, so one worker
(``keyqueue worker mysite.kq:app``) serves both the app's own tasks and Django's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import importlib
import inspect
import json
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from ulid import ULID

from keyqueue.app.application import App
from keyqueue.django import django_settings
from keyqueue.django.framework import (
    DEFAULT_TASK_BACKEND_ALIAS,
    DEFAULT_TASK_PRIORITY,
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    signals,
    task_backends,
)
from keyqueue.errors import (
    Cancelled,
    ConfigError,
    KeyqueueError,
    RemoteError,
    ResultExpired,
)
from keyqueue.jetstream.kv import KeyValue
from keyqueue.jetstream.records import CANCEL_TTL
from keyqueue.jetstream.subjects import validate_queue_name, validate_request_id
from keyqueue.tasks.arguments import KeyMaker
from keyqueue.tasks.context import Context
from keyqueue.tasks.task import Task as QueueTask
from keyqueue.wire import new_request_id

__all__ = ["DEFAULT_RESULT_TTL", "KeyqueueBackend", "KeyqueueTask", "default_backend_app"]

log = logging.getLogger("keyqueue.django")

DEFAULT_RESULT_TTL: Final = 24 * 3600.0
"""Seconds a task's result stays readable by ``get_result`` after it ends, unless ``OPTIONS["RESULT_TTL"]`` says."""

OPTIONS: Final = frozenset({"APP", "NAME", "RESULT_TTL"})
"""The backend's ``OPTIONS``."""

RESULT_READ_TIMEOUT: Final = 5.0
"""Seconds ``get_result`` waits for the kept result of a request whose status says it is done."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KeyqueueTask(Task):  # type: ignore[misc]
    """Django's ``Task`` with keyqueue's options, given to ``@task(...)`` (Django 6.1, or the backport)."""

    key: str | Callable[..., str] | None = None
    """The key: a template over the function's arguments (``"{order_id}"``) or a callable taking
    them. None: each request is its own key (no order, no exclusivity)."""
    max_attempts: int = 5
    """Attempts before the request is dead-lettered (its result then says ``FAILED``)."""
    timeout: float | None = None
    """Seconds one attempt may run before it is stopped (and retried)."""


@dataclasses.dataclass
class _Shared:
    """What every instance of a backend alias shares. Django makes a backend per thread (its
    connection handler is thread-local), while one keyqueue app, with one connection per event
    loop, serves the whole process."""

    app: App
    tasks: dict[str, tuple[Any, QueueTask[Any]]] = dataclasses.field(default_factory=dict)
    """Task path -> (the Django task as declared, its keyqueue task)."""
    ensured: weakref.WeakSet[Any] = dataclasses.field(default_factory=weakref.WeakSet)
    """Connections on which the descriptor bucket is known to exist."""


_SHARED: dict[str, _Shared] = {}
"""Per alias and configuration, the state its backends share (``_Shared``)."""
_SHARED_LOCK = threading.Lock()


class KeyqueueBackend(BaseTaskBackend):  # type: ignore[misc]
    """Django's Tasks backend on keyqueue (module docstring)."""

    task_class = KeyqueueTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = set(self.options) - OPTIONS
        if unknown:
            raise ConfigError(f"TASKS[{alias!r}]['OPTIONS'] has {', '.join(sorted(unknown))}; keyqueue's backend "
                              f"takes {', '.join(sorted(OPTIONS))}")
        self.result_ttl = float(self.options.get("RESULT_TTL", DEFAULT_RESULT_TTL))
        if not self.result_ttl >= 1:
            raise ConfigError(f"TASKS[{alias!r}]['OPTIONS']['RESULT_TTL'] must be at least 1 second, "
                              f"got {self.result_ttl}")
        self._config = json.dumps([alias, sorted(self.queues), {k: str(v) for k, v in self.options.items()}])

    # --- the keyqueue side ---

    @property
    def _shared(self) -> _Shared:
        with _SHARED_LOCK:
            shared = _SHARED.get(self._config)
            if shared is None:
                shared = _SHARED[self._config] = _Shared(self._make_app())
                for queue_name in self.queues or [DEFAULT_TASK_QUEUE_NAME]:
                    self._queue_for(shared.app, queue_name)
            return shared

    def _make_app(self) -> App:
        spec = self.options.get("APP")
        if spec is None:
            return App(str(self.options.get("NAME", "django")), settings=django_settings, set_as_default=False)
        if "NAME" in self.options:
            raise ConfigError(f"TASKS[{self.alias!r}]['OPTIONS'] gives APP and NAME: the app {spec} has its own name")
        module_name, _, attribute = str(spec).partition(":")
        try:
            app = getattr(importlib.import_module(module_name), attribute or "app")
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"TASKS[{self.alias!r}]['OPTIONS']['APP'] = {spec!r}: {exc} (give MODULE:APP, "
                              "e.g. mysite.kq:app; that module must not import the tasks modules)") from None
        if not isinstance(app, App):
            raise ConfigError(f"TASKS[{self.alias!r}]['OPTIONS']['APP'] = {spec!r} is a {type(app).__name__}, "
                              "not a keyqueue.App")
        return app

    @property
    def app(self) -> App:
        """The keyqueue app that stores and serves this backend's tasks."""
        return self._shared.app

    def queue_for(self, queue_name: str) -> str:
        """The keyqueue queue of Django queue ``queue_name``: the app's name for ``default``, else ``NAME-QUEUE``."""
        return self._queue_for(self.app, queue_name)

    @staticmethod
    def _queue_for(app: App, queue_name: str) -> str:
        queue = app.name if queue_name == DEFAULT_TASK_QUEUE_NAME else f"{app.name}-{queue_name}"
        try:
            validate_queue_name(queue)
        except ConfigError as exc:
            raise InvalidTask(f"Django queue {queue_name!r} becomes keyqueue queue {queue!r}: {exc}") from None
        app.add_queue(queue)
        return queue

    @property
    def _bucket(self) -> str:
        name = f"kq_django_{self.app.name}"
        return name if len(name) <= 64 else "kq_django_" + hashlib.sha256(self.app.name.encode()).hexdigest()[:32]

    async def _descriptors(self) -> KeyValue:
        """The bucket of enqueued tasks' descriptors, on the running loop's connection."""
        nc = await self.app.connection()
        shared = self._shared
        replicas = self.app.queue_config(self.queue_for(DEFAULT_TASK_QUEUE_NAME)).replicas
        bucket = KeyValue(nc, self._bucket, replicas=replicas, max_age=CANCEL_TTL + self.result_ttl)
        if nc not in shared.ensured:
            await bucket.ensure()
            shared.ensured.add(nc)
        return bucket

    # --- the backend contract ---

    def validate_task(self, task: Any) -> None:
        """Django's checks, keyqueue's (``InvalidTask``), then the task is registered on the app."""
        if task.priority != DEFAULT_TASK_PRIORITY:
            raise InvalidTask(
                f"task {task.module_path}: priority={task.priority}, but keyqueue has no priority per request: it "
                "runs a key's requests in the order they were accepted. Send urgent work to a queue of its own "
                "(queue_name=..., listed in QUEUES) and give that queue workers of its own "
                "(keyqueue worker ... --queue NAME-QUEUE)")
        super().validate_task(task)
        self._keyqueue_task(task)

    def _keyqueue_task(self, task: Any) -> QueueTask[Any]:
        """The keyqueue task that runs ``task`` (declared on first use: one per function)."""
        shared = self._shared
        name = task.module_path
        key = getattr(task, "key", None)
        parameters = list(inspect.signature(task.func).parameters)[1 if task.takes_context else 0:]
        try:
            if key is not None:
                KeyMaker(key, name, tuple(parameters))  # a template naming no parameter fails here, not at enqueue
        except ConfigError as exc:
            raise InvalidTask(str(exc)) from None
        known = shared.tasks.get(name)
        if known is not None:
            if known[0].func is not task.func:
                raise InvalidTask(f"two tasks are named {name}; keyqueue tells tasks apart by module and name")
            return known[1]
        try:
            declared = self.app.task(key="{key}", queue=self.queue_for(task.queue_name), name=name,
                                     max_attempts=getattr(task, "max_attempts", 5),
                                     timeout=getattr(task, "timeout", None), result_ttl=self.result_ttl)
            runner: QueueTask[Any] = declared(_runner(self, task))
        except ConfigError as exc:
            raise InvalidTask(str(exc)) from None
        shared.tasks[name] = (task, runner)
        return runner

    def enqueue(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Store a request for ``task`` (from code without an event loop: a view, a script)."""
        self.validate_task(task)
        result = self._new_result(task, args, kwargs)
        self.app.run_sync(lambda: self._store(task, result), what=f"enqueueing {task.module_path}")
        signals.task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``enqueue`` on the running event loop (an async view)."""
        self.validate_task(task)
        result = self._new_result(task, args, kwargs)
        await self._store(task, result)
        signals.task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """The ``TaskResult`` of ``result_id`` as it is now (``TaskResultDoesNotExist`` if none)."""
        return self.app.run_sync(lambda: self.aget_result(result_id), what=f"the result of task {result_id}")

    async def aget_result(self, result_id: str) -> Any:
        """``get_result`` on the running event loop."""
        try:
            validate_request_id(result_id)
        except ConfigError:
            raise TaskResultDoesNotExist(f"{result_id!r} is not the id of a task result") from None
        entry = await (await self._descriptors()).get(result_id)
        if entry is None:
            raise TaskResultDoesNotExist(f"no task result {result_id}: never enqueued here, or older than "
                                         f"{self.result_ttl:g}s after it ended (RESULT_TTL)")
        stored = json.loads(entry.value)
        task = self._declared(stored["task"], stored["queue_name"])
        queue = stored["queue"]
        fields: dict[str, Any] = {"args": stored["args"], "kwargs": stored["kwargs"],
                                  "enqueued_at": _datetime(stored["enqueued_at"])}
        status = await self.app.status(result_id, queue=queue)
        if status in ("pending", "scheduled"):
            fields["status"] = TaskResultStatus.READY
        elif status == "running":
            fields["status"] = TaskResultStatus.RUNNING
        elif status in ("done", "failed", "cancelled"):
            fields.update(await self._finished(result_id, queue, task))
        else:  # unknown, expired: nothing left to say what became of it
            raise TaskResultDoesNotExist(f"task result {result_id} ({task.module_path}) is {status}: its result "
                                         f"was kept for {self.result_ttl:g}s (RESULT_TTL)")
        return _task_result(task, result_id, self.alias, **fields)

    async def _finished(self, result_id: str, queue: str, task: Any) -> dict[str, Any]:
        try:
            outcome = await self.app.result(result_id, queue=queue, timeout=RESULT_READ_TIMEOUT)
        except ResultExpired:
            raise TaskResultDoesNotExist(f"the result of task {result_id} ({task.module_path}) has expired "
                                         f"(RESULT_TTL: {self.result_ttl:g}s)") from None
        except (RemoteError, Cancelled) as exc:
            type_name = exc.type_name if isinstance(exc, RemoteError) else type(exc).__name__
            message = exc.message if isinstance(exc, RemoteError) else str(exc)
            error = TaskError(exception_class_path=_exception_path(type_name, task.func),
                              traceback=f"{type_name}: {message}\n(the whole traceback is in keyqueue's dead-letter "
                                        f"queue: keyqueue dlq list {queue})")
            return {"status": TaskResultStatus.FAILED, "errors": [error]}
        worker, attempts = outcome["worker_id"], int(outcome["attempts"])
        return {"status": TaskResultStatus.SUCCESSFUL, "return_value": outcome["return_value"],
                "started_at": _datetime(outcome["started_at"]), "last_attempted_at": _datetime(outcome["started_at"]),
                "finished_at": _datetime(outcome["finished_at"]), "worker_ids": [worker] * attempts}

    def _declared(self, path: str, queue_name: str) -> Any:
        """The Django task at ``path`` (as declared), on ``queue_name``."""
        known = self._shared.tasks.get(path)
        task = known[0] if known is not None else None
        if task is None:
            module_name, _, attribute = path.rpartition(".")
            try:
                task = getattr(importlib.import_module(module_name), attribute)
            except (ImportError, AttributeError, ValueError) as exc:
                raise TaskResultDoesNotExist(f"the task {path} of this result cannot be imported: {exc}") from None
            if not isinstance(task, Task):
                raise TaskResultDoesNotExist(f"{path} is no longer a task")
        return task if task.queue_name == queue_name else task.using(queue_name=queue_name)

    def _new_result(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """A ``READY`` result with a new id, its arguments made JSON as Django does (else ``TypeError``)."""
        return _task_result(task, new_request_id(), self.alias, status=TaskResultStatus.READY, args=list(args),
                            kwargs=dict(kwargs))

    async def _store(self, task: Any, result: Any) -> None:
        """Write the result's descriptor, then store the request (so a stored request always has one)."""
        queue = self.queue_for(task.queue_name)
        enqueued_at = dt.datetime.now(dt.UTC)
        object.__setattr__(result, "enqueued_at", enqueued_at)
        descriptor = {"task": task.module_path, "queue_name": task.queue_name, "queue": queue, "args": result.args,
                      "kwargs": result.kwargs, "enqueued_at": enqueued_at.isoformat()}
        await (await self._descriptors()).put(result.id, json.dumps(descriptor).encode(), expected_revision=None)
        declared = self._keyqueue_task(task)
        key = _key(task, result.id, result.args, result.kwargs)
        run_after = task.run_after
        if run_after is not None and run_after.tzinfo is None:  # USE_TZ = False: Django's local time
            from django.utils import timezone

            run_after = timezone.make_aware(run_after)
        eta = run_after if run_after is not None and run_after > enqueued_at else None
        await declared.options(request_id=result.id, queue=queue, eta=eta).enqueue(
            key=key, args=result.args, kwargs=result.kwargs)

    def check(self, **kwargs: Any) -> list[Any]:
        """Django's system checks: the keyqueue app can be made from these settings."""
        from django.core import checks

        try:
            self._shared  # noqa: B018
        except (ConfigError, KeyqueueError) as exc:
            return [checks.Error(str(exc), obj=f"TASKS[{self.alias!r}]", id="keyqueue.E001")]
        return []


# --- the worker side --------------------------------------------------------------------------


_WORKER_ID: Final = f"{socket.gethostname()}:{os.getpid()}"


def _runner(backend: KeyqueueBackend, task: Any) -> Callable[..., Any]:
    """The keyqueue task function that runs Django's ``task``: async for an async function (on the
    worker's loop), sync otherwise (in a thread, with Django's database connections checked around it)."""

    if inspect.iscoroutinefunction(task.func):
        async def run_async(ctx: Context, key: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
            result = _running(backend, task, ctx, args, kwargs)
            try:
                value = await task.func(*_context(task, result), *args, **kwargs)
            except BaseException as exc:
                _failed(backend, result, exc)
                raise
            return _succeeded(backend, result, value, ctx.attempt)

        runner: Callable[..., Any] = run_async
    else:
        def run_sync(ctx: Context, key: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
            from django.db import close_old_connections

            close_old_connections()  # as Django does around a request: drop connections that went bad or old
            try:
                result = _running(backend, task, ctx, args, kwargs)
                try:
                    value = task.func(*_context(task, result), *args, **kwargs)
                except BaseException as exc:
                    _failed(backend, result, exc)
                    raise
                return _succeeded(backend, result, value, ctx.attempt)
            finally:
                close_old_connections()

        runner = run_sync
    runner.__name__ = runner.__qualname__ = task.func.__name__
    runner.__doc__ = task.func.__doc__
    return runner


def _running(backend: KeyqueueBackend, task: Any, ctx: Context, args: list[Any], kwargs: dict[str, Any]) -> Any:
    now = dt.datetime.now(dt.UTC)
    result = _task_result(task, ctx.request_id, backend.alias, status=TaskResultStatus.RUNNING, args=args,
                          kwargs=kwargs, enqueued_at=_ulid_time(ctx.request_id), started_at=now,
                          last_attempted_at=now, worker_ids=[_WORKER_ID] * ctx.attempt)
    signals.task_started.send(type(backend), task_result=result)
    return result


def _context(task: Any, result: Any) -> tuple[Any, ...]:
    return (TaskContext(task_result=result),) if task.takes_context else ()


def _succeeded(backend: KeyqueueBackend, result: Any, value: Any, attempts: int) -> dict[str, Any]:
    value = normalize_json(value)
    finished = dt.datetime.now(dt.UTC)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", finished)
    object.__setattr__(result, "_return_value", value)
    signals.task_finished.send(type(backend), task_result=result)
    return {"return_value": value, "started_at": result.started_at.isoformat(), "finished_at": finished.isoformat(),
            "worker_id": _WORKER_ID, "attempts": attempts}


def _failed(backend: KeyqueueBackend, result: Any, exc: BaseException) -> None:
    """The attempt failed: Django's ``task_finished`` says so (keyqueue retries it, or dead-letters it)."""
    import traceback

    object.__setattr__(result, "status", TaskResultStatus.FAILED)
    object.__setattr__(result, "finished_at", dt.datetime.now(dt.UTC))
    result.errors.append(TaskError(exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                                   traceback="".join(traceback.format_exception(exc))))
    signals.task_finished.send(type(backend), task_result=result)


# --- values -----------------------------------------------------------------------------------


def _task_result(task: Any, result_id: str, backend: str, **given: Any) -> Any:
    """A Django ``TaskResult`` (unset times None, no errors); ``return_value`` is set as Django's backends set it."""
    value = given.pop("return_value", None)
    names = {f.name for f in dataclasses.fields(TaskResult) if f.init}
    defaults: dict[str, Any] = {"enqueued_at": None, "started_at": None, "finished_at": None,
                                "last_attempted_at": None, "args": [], "kwargs": {}, "errors": [], "worker_ids": []}
    values = {k: v for k, v in {**defaults, **given}.items() if k in names}
    result = TaskResult(task=task, id=result_id, backend=backend, **values)
    if value is not None:
        object.__setattr__(result, "_return_value", value)
    return result


def _key(task: Any, request_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The keyqueue key of one request of ``task`` (its own id when the task has no ``key=``)."""
    key = getattr(task, "key", None)
    if key is None:
        return request_id
    parameters = list(inspect.signature(task.func).parameters)
    maker = KeyMaker(key, task.module_path, tuple(parameters[1:] if task.takes_context else parameters))
    if maker.function is not None:
        return maker.make({}, tuple(args), kwargs)
    bound = inspect.signature(task.func).bind(*((None,) if task.takes_context else ()), *args, **kwargs)
    bound.apply_defaults()
    return maker.make(bound.arguments, (), {})


def _exception_path(type_name: str, func: Callable[..., Any]) -> str:
    """An importable path for an exception known by its class name only: a built-in, one in the task's
    module, else keyqueue's ``RemoteError`` (a failure the worker reported)."""
    import builtins

    if isinstance(getattr(builtins, type_name, None), type):
        return f"builtins.{type_name}"
    module = inspect.getmodule(func)
    found = getattr(module, type_name, None)
    if isinstance(found, type) and issubclass(found, BaseException) and module is not None:
        return f"{module.__name__}.{type_name}"
    if type_name == "Cancelled":
        return "keyqueue.errors.Cancelled"
    return "keyqueue.errors.RemoteError"


def _datetime(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value else None


def _ulid_time(request_id: str) -> dt.datetime | None:
    try:
        return ULID.from_str(request_id).datetime
    except ValueError:
        return None


def default_backend_app() -> App:
    """The keyqueue app of the default Tasks backend: what ``keyqueue worker keyqueue.django`` serves."""
    from django.conf import settings

    if not settings.configured:
        raise ConfigError("keyqueue.django:app is the app of Django's default Tasks backend: set "
                          "DJANGO_SETTINGS_MODULE (keyqueue worker then sets Django up and imports each app's tasks)")
    backend = task_backends[DEFAULT_TASK_BACKEND_ALIAS]
    if not isinstance(backend, KeyqueueBackend):
        raise ConfigError(f"TASKS['default'] is {type(backend).__module__}.{type(backend).__qualname__}, not "
                          "keyqueue.django.backend.KeyqueueBackend")
    return backend.app
