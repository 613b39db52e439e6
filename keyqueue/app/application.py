"""``App``: tasks, processors and plugins of one application, and its connection to NATS.

::

    app = keyqueue.App("shop")                       # URL from KEYQUEUE_URL, else the embedded server
    app = keyqueue.App("shop", url="nats://127.0.0.1:4222")

    @app.task(key="{order_id}", max_attempts=5)
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict: ...

    async with app.worker(concurrency=8):            # a worker, from code
        print(await charge.call(order_id="o1", amount=5))

The app's name is the default queue of its tasks. An app connects lazily, once per event loop
(``delay`` runs on a private loop in a thread).

``@keyqueue.task(queue=Q, ...)`` declares a *shared task*, one no ``App`` declared. It belongs to
the app that serves its queue: the ``App`` in this process that claims ``Q`` (whose name is ``Q``,
or which declared ``Q`` itself: a task of its own there, a processor, ``add_queue``), else the
*default app* (the first ``App`` created, else one named ``default``). Two apps that both claim
``Q`` make its shared tasks ambiguous: using them raises ``ConfigError`` naming both. An app created
with ``set_as_default=False`` takes no shared task; a worker of such an app warns, naming them,
when shared tasks of a queue it serves belong to another app (their requests would be
dead-lettered as ``UnknownMessageType`` by it). The apps, the default app and the shared tasks are
the only process-wide state (docs/decisions.md, "Which app a shared task belongs to").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, cast, overload

from keyqueue.app.cancel import CANCEL_ANSWER_WAIT, CancelState
from keyqueue.app.portal import SYNC_BOUND, SyncRunner, require_sync_caller
from keyqueue.app.schedules import Periodic, make_periodic
from keyqueue.app.status import RequestStatus, StatusReport
from keyqueue.app.transport import Connections, NatsTransport, Transport
from keyqueue.app.workflows import (
    WorkflowView,
    cancel_workflow,
    locate_workflow,
    read_workflow,
    start_workflow,
    workflow_result,
    workflow_status,
)
from keyqueue.core.processor import ProcessorFactory, Reply
from keyqueue.errors import ConfigError, EnqueueError, PartiallyEnqueued
from keyqueue.jetstream.subjects import validate_key, validate_queue_name, validate_request_id, validate_request_key
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.plugins.manager import PluginManager, autoload_disabled
from keyqueue.server.local import LocalServer
from keyqueue.settings import Settings
from keyqueue.tasks.arguments import decode_result
from keyqueue.tasks.canvas import WorkflowPlan, WorkflowReceipt, is_workflow_id, validate_workflow_id
from keyqueue.tasks.decorators import BatchTaskDecorator, TaskDecorator, declare
from keyqueue.tasks.task import (
    DEFAULT_CALL_TIMEOUT,
    AnyTask,
    Backoff,
    KeySpec,
    Merge,
    Policy,
    Receipt,
    Task,
    TaskRequest,
)
from keyqueue.wire import Message, encode, to_fields
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.app.worker import Worker
    from keyqueue.jetstream.workflows import WorkflowStore
    from keyqueue.tasks.arguments import Upgrade
    from keyqueue.tasks.context import Progress

__all__ = ["App", "default_app", "shared_task_owner", "shared_tasks_elsewhere", "task"]

log = logging.getLogger("keyqueue.app")

T = TypeVar("T")
_TaskFn = TypeVar("_TaskFn", bound=Callable[..., Any])
"""A task's function, for ``@app.task`` without options."""


# --- process-wide: the default app and the tasks declared on it -----------------------------------


class _Defaults:
    """The apps that take shared tasks, the default app, and the ``@keyqueue.task`` tasks.

    Which app a shared task belongs to is decided each time it is asked (``owner``), so the
    order of imports does not matter: an app created after the task was declared still gets it.
    """

    def __init__(self) -> None:
        self.app: App | None = None
        self.apps: list[weakref.ref[App]] = []
        """Every live ``App`` that takes shared tasks (``set_as_default=True``), oldest first."""
        self.shared: list[AnyTask] = []

    def add_app(self, app: App) -> None:
        self.apps.append(weakref.ref(app))
        if self.app is None:
            self.app = app

    def add_shared(self, task: AnyTask) -> None:
        for other in self.shared:
            if other.name == task.name:
                raise ConfigError(f"@keyqueue.task {task.name!r} is declared twice ({other.fn.__module__} and "
                                  f"{task.fn.__module__}); give one a name= of its own")
        self.shared.append(task)

    def claimants(self, queue: str) -> list[App]:
        """The live apps taking shared tasks that claim ``queue`` (``App.claims``), oldest first."""
        self.apps = [ref for ref in self.apps if ref() is not None]
        return [app for ref in self.apps if (app := ref()) is not None and app.claims(queue)]

    def owner(self, task: AnyTask) -> App:
        """The app ``task`` (a shared one) belongs to: the one app claiming its queue, else the
        default app; ``ConfigError`` naming them when several claim it."""
        claimants = self.claimants(task.queue)
        if len(claimants) > 1:
            raise _ambiguous(task, claimants)
        return claimants[0] if claimants else default_app()

    def belongs_to(self, task: AnyTask, app: App) -> bool:
        """Whether shared ``task`` belongs to ``app`` (``ConfigError`` if ``app`` is one of several
        claiming its queue; an ambiguity between other apps is theirs)."""
        claimants = self.claimants(task.queue)
        if app in claimants:
            if len(claimants) > 1:
                raise _ambiguous(task, claimants)
            return True
        return not claimants and app is self.app


def _ambiguous(task: AnyTask, claimants: Sequence[App]) -> ConfigError:
    apps = " and ".join(f"app {a.name!r}" for a in claimants)
    return ConfigError(
        f"@keyqueue.task {task.name!r} (queue {task.queue!r}) could belong to {apps}, which all claim queue "
        f"{task.queue!r}: declare it on the one that serves it (@app.task(queue={task.queue!r}, ...)), or create "
        "the others with set_as_default=False (they then take no @keyqueue.task tasks)")


_DEFAULTS = _Defaults()


def default_app() -> App:
    """The default app: the first ``App`` created (with ``set_as_default=True``, the default), else
    ``App("default")``. It takes the ``@keyqueue.task`` tasks whose queue no other app claims."""
    if _DEFAULTS.app is None:
        App("default")
    assert _DEFAULTS.app is not None
    return _DEFAULTS.app


def shared_task_owner(task: AnyTask) -> App:
    """The app a ``@keyqueue.task`` task belongs to (see the module docstring)."""
    return _DEFAULTS.owner(task)


def shared_tasks_elsewhere(app: App, queue: str) -> list[tuple[AnyTask, str]]:
    """The ``@keyqueue.task`` tasks of ``queue`` that ``app`` does not have, each with where it belongs
    (an app's name, or why none): what a worker of ``app`` serving ``queue`` would dead-letter."""
    mine = app.tasks
    found = []
    for shared in _DEFAULTS.shared:
        if shared.queue != queue or mine.get(shared.name) is shared:
            continue
        try:
            where = f"app {_DEFAULTS.owner(shared).name!r}"
        except ConfigError:
            where = "several apps (ambiguous)"
        found.append((shared, where))
    return found


@overload
def task(*, queue: str, key: KeySpec, policy: Literal["batch"], name: str | None = None, max_attempts: int = 5,
         backoff: Backoff | float = ..., timeout: float | None = None, version: int = 1,
         upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
         result_ttl: float | None = None, rate_limit: str | None = None, soft_timeout: float | None = None,
         retry_on: Sequence[type[BaseException]] | None = None) -> BatchTaskDecorator: ...
@overload
def task(*, queue: str, key: KeySpec | None = None, policy: Literal["serial", "latest", "merge"] = "serial",
         name: str | None = None, max_attempts: int = 5, backoff: Backoff | float = ..., timeout: float | None = None,
         version: int = 1, upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
         merge: Merge | None = None, result_ttl: float | None = None,
         rate_limit: str | None = None, soft_timeout: float | None = None,
         retry_on: Sequence[type[BaseException]] | None = None) -> TaskDecorator: ...


def task(*, queue: str, key: KeySpec | None = None, policy: Policy = "serial", name: str | None = None,
         max_attempts: int = 5,
         backoff: Backoff | float = Backoff(), timeout: float | None = None, version: int = 1,  # noqa: B008
         upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
         merge: Merge | None = None, result_ttl: float | None = None,
         rate_limit: str | None = None, soft_timeout: float | None = None,
         retry_on: Sequence[type[BaseException]] | None = None) -> TaskDecorator | BatchTaskDecorator:
    """Declare a shared task: it belongs to the app that claims ``queue``, else to the default app
    (see the module docstring; ``App.task`` for the options; ``queue`` is required)."""
    made: list[AnyTask] = []  # the task, once the decorator has made it: its app is looked up on each use

    def register(declared: AnyTask) -> None:
        _DEFAULTS.add_shared(declared)
        made.append(declared)

    return declare(key=key, queue=queue, name=name, policy=policy, max_attempts=max_attempts, backoff=backoff,
                   timeout=timeout, version=version, upgrades=upgrades, max_batch=max_batch, merge=merge,
                   register=register, dispatcher=lambda: _DEFAULTS.owner(made[0]), result_ttl=result_ttl,
                   rate_limit=rate_limit, soft_timeout=soft_timeout, retry_on=retry_on)


OLD_CANCEL_ORDER_REMOVED_IN: Final = "0.3.0"
"""The version that drops ``App.cancel(queue, request_id)`` (deprecated: ``App.cancel(request_id, queue=...)``)."""


def _old_cancel_order(first: str, rest: tuple[str, ...], queue: str | None) -> tuple[str, str]:
    """``(request_id, queue)`` of a call in the old order ``cancel(queue, request_id)``, with its warning."""
    if len(rest) != 1 or queue is not None:
        raise TypeError("App.cancel takes the request id and, by keyword, queue=, seq= and key=: "
                        "App.cancel(request_id, queue=...)")
    request_id = rest[0]
    warnings.warn(f"App.cancel(queue, request_id) is deprecated and goes in keyqueue {OLD_CANCEL_ORDER_REMOVED_IN}: "
                  f"write app.cancel({request_id!r}, queue={first!r})", DeprecationWarning, stacklevel=3)
    return request_id, first


# --- the app -------------------------------------------------------------------------------------


class App:
    """One application: its tasks and processors by queue, its plugins, its NATS connection.

    It is the ``Dispatcher`` its tasks send through: ``publish``, ``ask`` and ``run_sync``.
    """

    def __init__(self, name: str, url: str | None = None, *,
                 settings: Settings | Callable[[], Settings] | None = None,
                 plugins: Sequence[object] = (), autoload_plugins: bool | None = None,
                 data_dir: str | Path | None = None, set_as_default: bool = True,
                 result_ttl: float | None = None) -> None:
        """``name`` is the app's name and its tasks' default queue.

        The connection comes from ``settings`` (else ``Settings.from_env()``, i.e. ``KEYQUEUE_*``
        variables), with ``url`` overriding its URL. ``settings`` may be a function returning
        them, called when the app first needs them rather than now: for a framework whose
        configuration is not loaded yet where the app is declared (``keyqueue.django.django_settings``
        reads Django's settings). With no URL at all the app uses its
        embedded server (``keyqueue.server.local``), kept under ``data_dir``. ``plugins`` are
        registered after the built-in and entry-point plugins; ``autoload_plugins=False`` skips
        the entry points (default: unless ``KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD`` is set).
        ``set_as_default=False``: this app is never the default app and takes no ``@keyqueue.task``
        task (for a second app in a process, a producer of another service, a test's app).
        ``result_ttl``: seconds the results of tasks without a ``result_ttl`` of their own are kept
        (None: only tasks that ask keep theirs; a task opts out with ``result_ttl=0``).
        """
        validate_queue_name(name)
        if result_ttl is not None and not result_ttl >= 1:
            raise ConfigError(f"app {name}: result_ttl must be at least 1 second, got {result_ttl}")
        self.name = name
        self.result_ttl = result_ttl
        """Default ``result_ttl`` of this app's tasks (seconds; None: keep no results by default)."""
        self._settings: Settings | None = None
        self._settings_source: Callable[[], Settings] = Settings.from_env if settings is None else (
            settings if not isinstance(settings, Settings) else lambda: settings)
        self._url_override = url
        if settings is None or isinstance(settings, Settings):
            self.settings  # noqa: B018 - KEYQUEUE_* variables are checked now, where the app is declared
        self._extra_plugins = list(plugins)
        self._autoload = not autoload_disabled() if autoload_plugins is None else autoload_plugins
        self._plugins: PluginManager | None = None
        self._tasks: dict[str, AnyTask] = {}
        self._processors: dict[str, ProcessorFactory] = {}
        self._queue_configs: dict[str, QueueConfig] = {}
        self._periodic: dict[str, Periodic] = {}
        self._routed: set[str] = set()
        """Queues declared with ``add_queue`` (tasks are sent there with ``options(queue=...)``)."""
        self._connections = Connections(f"keyqueue:{name}", self._settings_with_url, self._reconnected)
        self._local = LocalServer(name, Path(data_dir) if data_dir is not None else None)
        self._reconnect_listeners: list[Callable[[], None]] = []
        self._eager: Transport | None = None
        self._sync = SyncRunner(self._after_fork, self._connections.close)
        """The private loop of sync calls (``delay``, ``call_sync``, ...), remade in a forked child."""
        if set_as_default:
            _DEFAULTS.add_app(self)

    def __repr__(self) -> str:
        return f"<App {self.name} {self.settings!r}>" if self._settings is not None else f"<App {self.name}>"

    @property
    def settings(self) -> Settings:
        """How the app reaches NATS (resolved on first use when ``settings`` was given as a function)."""
        if self._settings is None:
            resolved = self._settings_source()
            if not isinstance(resolved, Settings):
                raise ConfigError(f"app {self.name}: its settings function returned {type(resolved).__name__}, "
                                  "not keyqueue.Settings")
            self._settings = resolved.with_url(self._url_override) if self._url_override is not None else resolved
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings

    # --- tasks and processors ---

    @overload
    def task(self, fn: _TaskFn, /) -> Task[_TaskFn]: ...
    @overload
    def task(self, /, *, key: KeySpec, policy: Literal["batch"], queue: str | None = None, name: str | None = None,
             max_attempts: int = 5, backoff: Backoff | float = ..., timeout: float | None = None, version: int = 1,
             upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
             result_ttl: float | None = None, rate_limit: str | None = None, soft_timeout: float | None = None,
         retry_on: Sequence[type[BaseException]] | None = None) -> BatchTaskDecorator: ...
    @overload
    def task(self, /, *, key: KeySpec | None = None, policy: Literal["serial", "latest", "merge"] = "serial",
             queue: str | None = None, name: str | None = None, max_attempts: int = 5,
             backoff: Backoff | float = ..., timeout: float | None = None, version: int = 1,
             upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
             merge: Merge | None = None, result_ttl: float | None = None,
             rate_limit: str | None = None, soft_timeout: float | None = None,
             retry_on: Sequence[type[BaseException]] | None = None) -> TaskDecorator: ...

    def task(self, fn: Callable[..., Any] | None = None, /, *, key: KeySpec | None = None, policy: Policy = "serial",
             queue: str | None = None, name: str | None = None,
             max_attempts: int = 5, backoff: Backoff | float = Backoff(), timeout: float | None = None,  # noqa: B008
             version: int = 1, upgrades: Mapping[int, Upgrade] | None = None, max_batch: int = 100,
             merge: Merge | None = None, result_ttl: float | None = None,
             rate_limit: str | None = None, soft_timeout: float | None = None,
             retry_on: Sequence[type[BaseException]] | None = None
             ) -> TaskDecorator | BatchTaskDecorator | Task[Any]:
        """Declare a task of this app: ``@app.task(...)`` with options, or ``@app.task`` alone for an
        unkeyed task with every default (as ``@app.task()``).

        ``key``: a template over the arguments (``"{order_id}"``, ``"{user}.{doc}"``) or a callable
        taking the task's arguments and returning the key: requests of one key run one at a time, in
        order. Without ``key`` (or ``key=None``) the task is *unkeyed*: no exclusivity and no order,
        each request runs on its own as soon as a worker has room, at the cost of a plain work queue
        (docs/tutorial.md, "Tasks without a key"); ``policy`` must then be ``serial``. ``queue``: defaults to the app's
        name. ``name``: the task's name on the wire (``X-MESSAGE-TYPE``), default the function's
        name. ``policy``: ``serial``, ``batch``, ``latest`` or ``merge`` (``keyqueue.task``).
        ``max_attempts`` and ``backoff`` (a ``Backoff``, or the first delay in seconds) govern
        retries; ``timeout`` is the hard limit of one attempt (it is stopped), ``soft_timeout`` raises
        ``SoftTimeout`` inside it first; ``retry_on``: only these exceptions are retried (others
        dead-letter at once, reason ``not-retried``). ``version`` is the message version; a task
        at version N > 1 declares ``upgrades={1: v1_to_v2, ..., N-1: ...}`` for older requests.
        ``max_batch`` caps the requests one run takes; ``merge`` folds them for ``merge``.
        ``result_ttl``: seconds each request's result (or final error) is kept, for
        ``receipt.result()`` / ``App.result`` (None: the app's ``result_ttl``; 0: none kept, whatever
        the app's default).
        ``rate_limit``: ``"N/s"``, ``"N/m"`` or ``"N/h"``, at most N runs per key per second, minute
        or hour across the fleet (a key's later requests wait, in order; other keys do not); for an
        unkeyed task, N runs of the task across the fleet.
        """
        decorator = declare(key=key, queue=queue or self.name, name=name, policy=policy,
                            max_attempts=max_attempts, backoff=backoff, timeout=timeout, version=version,
                            upgrades=upgrades, max_batch=max_batch, merge=merge, register=self._register,
                            dispatcher=lambda: self, result_ttl=result_ttl, rate_limit=rate_limit,
                            soft_timeout=soft_timeout, retry_on=retry_on)
        if fn is None:
            return decorator
        if not callable(fn) or not isinstance(decorator, TaskDecorator):
            raise TypeError(f"app.task takes its options by keyword (app.task(key=...)), not {fn!r}")
        return decorator(fn)

    def _register(self, task: AnyTask) -> None:
        tasks = self._all_tasks()
        if task.name in tasks:
            other = tasks[task.name]
            raise ConfigError(f"app {self.name} already has a task named {task.name!r} ({other.fn.__module__}."
                              f"{other.fn.__qualname__}); give one a name= of its own")
        self._check_queue(task.queue, [*[t for t in tasks.values() if t.queue == task.queue], task])
        self._tasks[task.name] = task

    def _check_queue(self, queue: str, tasks: Sequence[AnyTask]) -> None:
        if tasks and queue in self._processors:
            raise ConfigError(f"queue {queue!r} of app {self.name} has a processor registered; its tasks "
                              f"({', '.join(t.name for t in tasks)}) would never run: put them in another queue")
        keyed = [t for t in tasks if not t.spec.unkeyed]  # unkeyed requests never reach a key session
        special = [t for t in keyed if t.spec.policy != "serial"]
        if special and len(keyed) > 1:
            # The core hands a processor all available requests of a key and removes them all
            # after one success, so a batch of mixed tasks could not fail or retry one of them alone.
            raise ConfigError(
                f"task {special[0].name} (policy {special[0].spec.policy!r}) must be the only task of its queue "
                f"{queue!r}, which also has {', '.join(t.name for t in keyed if t is not special[0])}; "
                "give it a queue of its own (queue=...)"
            )

    def _all_tasks(self) -> dict[str, AnyTask]:
        tasks = dict(self._tasks)
        for shared in _DEFAULTS.shared:
            if not _DEFAULTS.belongs_to(shared, self):
                continue
            if shared.name in tasks and tasks[shared.name] is not shared:
                raise ConfigError(f"@keyqueue.task {shared.name!r} clashes with app {self.name}'s task of "
                                  "that name; give one a name= of its own")
            tasks[shared.name] = shared
        return tasks

    def claims(self, queue: str) -> bool:
        """Whether this app declared ``queue`` itself: its name, a task of its own there, a
        processor, or ``add_queue``. The ``@keyqueue.task`` tasks of a queue belong to the app that
        claims it (see the module docstring)."""
        return (queue == self.name or queue in self._routed or queue in self._processors
                or any(t.queue == queue for t in self._tasks.values()))

    @property
    def tasks(self) -> Mapping[str, AnyTask]:
        """Every task of the app by name (including the ``@keyqueue.task`` ones that belong to it)."""
        self.plugins  # noqa: B018 - plugins register their tasks when first loaded
        return MappingProxyType(self._all_tasks())

    def find_task(self, name: str) -> AnyTask:
        """The task named ``name`` (``ConfigError`` listing the known ones if there is none)."""
        tasks = self.tasks
        if name not in tasks:
            known = ", ".join(sorted(tasks)) or "none"
            raise ConfigError(f"app {self.name} has no task {name!r}; its tasks: {known}")
        return tasks[name]

    def queue_tasks(self, queue: str) -> dict[str, AnyTask]:
        """The tasks a worker of ``queue`` runs, by name: the queue's own and, unless one of them has a
        policy other than ``serial`` (then it is alone), every serial task of the app, which
        ``options(queue=...)`` may send there (checked: a non-serial task is alone in its queue)."""
        every = self.tasks
        tasks = {name: t for name, t in every.items() if t.queue == queue}
        self._check_queue(queue, list(tasks.values()))
        if all(t.spec.policy == "serial" for t in tasks.values()):
            tasks.update({name: t for name, t in every.items() if t.spec.policy == "serial" and name not in tasks})
        return tasks

    def unkeyed_tasks(self, queue: str) -> dict[str, AnyTask]:
        """The unkeyed tasks a worker of ``queue`` runs beside its keys, by name (none: the queue has no
        unkeyed lane). A queue has one when it has unkeyed tasks of its own, or was declared with
        ``add_queue``; it then runs every unkeyed task of the app, which ``options(queue=...)`` may
        send there."""
        every = {name: t for name, t in self.tasks.items() if t.spec.unkeyed}
        if not any(t.queue == queue for t in every.values()) and queue not in self._routed:
            return {}
        return every

    def add_queue(self, name: str) -> None:
        """Declare a queue that has no tasks of its own: ``options(queue=name)`` sends serial tasks'
        requests there, and its workers (``keyqueue worker app --queue name``) run them."""
        validate_queue_name(name)
        self._routed.add(name)

    def register_processor(self, queue: str, factory: ProcessorFactory, *, config: QueueConfig | None = None) -> None:
        """Serve ``queue`` with processors from ``factory(key)`` (a ``KeyProcessor``, maybe awaitable).

        ``config`` sets the queue's stream and consumer configuration (see ``configure_queue``).
        """
        validate_queue_name(queue)
        if queue in self._processors:
            raise ConfigError(f"queue {queue!r} of app {self.name} already has a processor")
        tasks = [t for t in self._all_tasks().values() if t.queue == queue]
        self._processors[queue] = factory
        try:
            self._check_queue(queue, tasks)
        except ConfigError:
            del self._processors[queue]
            raise
        if config is not None:
            self.configure_queue(config)

    def processor_factory(self, queue: str) -> ProcessorFactory | None:
        """The factory registered for ``queue`` with ``register_processor``, if any."""
        return self._processors.get(queue)

    def configure_queue(self, config: QueueConfig) -> None:
        """Use ``config`` for queue ``config.name``: its layout and, for a queue this app creates, its
        settings (on an existing queue the server's settings apply; see ``QueueConfig``)."""
        self._queue_configs[config.name] = config

    def queue_config(self, queue: str) -> QueueConfig:
        """The queue's configuration: as configured, else the defaults."""
        return self._queue_configs.get(queue) or QueueConfig(queue)

    # --- periodic schedules ---

    def periodic(self, name: str, task: AnyTask | str, *, cron: str | None = None,
                 every: float | datetime.timedelta | None = None, timezone: str = "UTC",
                 kwargs: Mapping[str, Any] | None = None) -> Periodic:
        """Declare a periodic schedule: every tick enqueues one request of ``task`` with ``kwargs``.

        ``cron``: a cron expression, five fields (``"0 9 * * mon-fri"``) or six with seconds first,
        or a name such as ``"@daily"``, read in ``timezone`` (an IANA name). ``every``: seconds (or a
        timedelta), at least 1. There is no beat process: the app's workers keep the server's
        schedules matching these declarations, and the server fires each tick once, whatever the
        number of workers (nats-server >= 2.14). ``InvalidSchedule`` for a bad schedule.
        """
        found = self.find_task(task) if isinstance(task, str) else task
        if name in self._periodic:
            raise ConfigError(f"app {self.name} already has a periodic schedule named {name!r}")
        declared = make_periodic(name, found, cron=cron, every=every, timezone=timezone, kwargs=kwargs)
        self._periodic[name] = declared
        return declared

    @property
    def periodics(self) -> Mapping[str, Periodic]:
        """The app's periodic schedules by name (``periodic``)."""
        return MappingProxyType(self._periodic)

    @property
    def queues(self) -> list[str]:
        """Every queue with tasks or a processor, sorted."""
        self.plugins  # noqa: B018 - plugins register their processors when first loaded
        return sorted({t.queue for t in self._all_tasks().values()} | set(self._processors) | self._routed)

    # --- plugins ---

    @property
    def plugins(self) -> PluginManager:
        """The app's plugin manager (built, and ``keyqueue_register`` called, on first use)."""
        if self._plugins is None:
            self._plugins = PluginManager(autoload=self._autoload, plugins=self._extra_plugins)
            self._plugins.hook.keyqueue_register(app=self)
        return self._plugins

    # --- where requests go ---

    def transport(self) -> Transport:
        """NATS, or the in-process runner while ``keyqueue.testing.eager`` is active."""
        if self._eager is not None:
            return self._eager
        return NatsTransport(self._connections, self.queue_config, self._keeps_result)

    def _keeps_result(self, request: TaskRequest) -> bool:
        return request.task is not None and request.task.kept_for(self.result_ttl) is not None

    def set_transport(self, transport: Transport | None) -> Transport | None:
        """Send requests through ``transport`` (``None``: NATS again); returns the one it replaces.

        ``keyqueue.testing.eager`` uses it to run tasks in process.
        """
        previous, self._eager = self._eager, transport
        return previous

    def run_sync(self, make: Callable[[], Awaitable[T]], *, bound: float | None = None,
                 what: str = "a sync call") -> T:
        """Run ``make()`` to completion from code without a running event loop, for at most ``bound``
        seconds (default :data:`~keyqueue.app.portal.SYNC_BOUND`; then ``SyncTimeout``).

        Safe in a forked child (gunicorn ``--preload``, uWSGI, ``multiprocessing``): the child gets a
        loop and a connection of its own (``keyqueue.app.portal``).
        """
        if self._eager is not None:
            require_sync_caller()

            async def run() -> T:
                return await make()

            return asyncio.run(run())
        return self._sync.run(make, bound=SYNC_BOUND if bound is None else bound, what=what)

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's connections and its embedded server (it is the parent's)."""
        self._connections.forget_all()
        self._local.forget_after_fork()

    # --- sending requests: the ``Dispatcher`` tasks send through (processor plugins may use it too) ---

    async def publish(self, requests: Sequence[TaskRequest]) -> list[Receipt]:
        """Store ``requests`` (of one queue, in order) inside their ``keyqueue_wrap_enqueue`` wrappers.

        One receipt per request; a single request that was not stored raises its ``EnqueueError``,
        several raise ``PartiallyEnqueued``, whose ``results`` hold each request's receipt or error
        (the others are stored).
        """
        self._check_routes(requests)
        async with AsyncExitStack() as stack:
            for request in requests:
                await self.plugins.enter_wrappers(stack, "keyqueue_wrap_enqueue", app=self, request=request)
            results = await self.transport().enqueue(requests)
            for request, result in zip(requests, results, strict=True):
                if not isinstance(result, EnqueueError):
                    request.receipt = result
            results = [dataclasses.replace(r, source=self) if isinstance(r, Receipt) else r for r in results]
            errors = [r for r in results if isinstance(r, EnqueueError)]
            if len(requests) == 1 and errors:
                raise errors[0]
            if errors:
                raise PartiallyEnqueued(
                    f"{len(errors)} of {len(requests)} {requests[0].message_type} requests were not stored "
                    f"(first: item {results.index(errors[0])}: {errors[0]}); the others are: the error's "
                    "receipts and results say which", list(results)
                ) from errors[0]
        return [r for r in results if isinstance(r, Receipt)]

    def _check_routes(self, requests: Sequence[TaskRequest]) -> None:
        for request in requests:
            if request.task is None or request.queue == request.task.queue:
                continue
            if request.queue not in self.queues:
                raise ConfigError(f"queue {request.queue!r} is not one of app {self.name}'s queues, so no worker of "
                                  f"the app would run {request.message_type} there: declare it with "
                                  f"app.add_queue({request.queue!r})")
            if request.task.unkeyed and not self.unkeyed_tasks(request.queue):
                raise ConfigError(f"queue {request.queue!r} has no unkeyed tasks of its own, so its workers take no "
                                  f"unkeyed requests and would not run {request.message_type} there: declare it with "
                                  f"app.add_queue({request.queue!r})")

    async def ask(self, request: TaskRequest, timeout: float) -> tuple[Mapping[str, str], bytes]:
        """Store ``request`` and wait up to ``timeout`` seconds for its reply: ``(headers, body)``.

        Inside its ``keyqueue_wrap_enqueue`` wrappers; ``KeyqueueTimeout`` if no reply came in time.
        """
        self._check_routes([request])
        async with AsyncExitStack() as stack:
            await self.plugins.enter_wrappers(stack, "keyqueue_wrap_enqueue", app=self, request=request)
            return await self.transport().call(request, timeout)

    def _message_request(self, queue: str, key: str, message: Message, request_id: str | None) -> TaskRequest:
        validate_queue_name(queue)
        validate_key(key)
        encoded = encode(message, request_id=None if request_id is None else validate_request_id(request_id))
        return TaskRequest(queue, key, message.TYPE, encoded.request_id, to_fields(message), encoded.headers,
                           encoded.body)

    async def enqueue_message(self, queue: str, key: str, message: Message, *,
                              request_id: str | None = None) -> Receipt:
        """Store a versioned message (``keyqueue.wire.Message``) for the processor of ``queue``.

        For queues served by a plugin's ``KeyProcessor`` rather than by tasks; the processor
        decodes it with ``keyqueue.wire.decode`` and its own ``Registry``.
        """
        [receipt] = await self.publish([self._message_request(queue, key, message, request_id)])
        return receipt

    async def call_message(self, queue: str, key: str, message: Message, *, request_id: str | None = None,
                           timeout: float = DEFAULT_CALL_TIMEOUT) -> Reply:
        """Like ``enqueue_message``, then wait for the processor's ``Reply`` (its body and headers).

        A dead-lettered or failed request raises ``DeadLettered`` / ``RemoteError`` as ``Task.call`` does.
        """
        request = self._message_request(queue, key, message, request_id)
        headers, body = await self.ask(request, timeout)
        if headers.get(H.STATUS) != H.STATUS_OK:
            decode_result(headers, body, request.request_id)  # raises the typed error
        return Reply(body, headers)

    # --- requests by id: kept results, cancels ---

    def lookup_queues(self, queue: str | None = None, task: str | None = None) -> list[str]:
        """Where to look for a request given by id: ``queue``; else the queue of ``task``; else every
        queue the app serves or sends to (its tasks' and processors'); else the app's name."""
        if queue is not None:
            return [validate_queue_name(queue)]
        if task:
            declared = self.tasks.get(task)
            if declared is not None:
                return [declared.queue]
        return self.queues or [self.name]

    async def result(self, request_id: str, *, queue: str | None = None, timeout: float = DEFAULT_CALL_TIMEOUT,
                     task: str | None = None) -> Any:
        """The result of request ``request_id``, from any process.

        ``queue``: where it was sent; without it, the queue of ``task=``, else every queue of the app
        whose tasks keep results (the first that has it answers). Waits up to ``timeout`` seconds for
        it to exist (``KeyqueueTimeout`` if it does not). A failed request's error is raised as
        ``call`` raises it (``DeadLettered``, ``Cancelled``, ...). ``ResultNotKept`` if the task
        (``task=``, or every task the app knows in the queue) keeps no results, ``ResultExpired`` if
        it was kept and its ``result_ttl`` has passed.
        """
        from keyqueue.app.results import fetch_result

        if is_workflow_id(request_id):
            store = await self._workflow(request_id, queue)
            if store is not None:
                tasks = self.tasks
                return await workflow_result(store, request_id, timeout,
                                             lambda name: tasks[name].result_type() if name in tasks else None)
        return await fetch_result(self, request_id, queue=queue, timeout=timeout, task=task)

    async def cancel(self, request_id: str, *deprecated: str, queue: str | None = None, seq: int | None = None,
                     key: str | None = None) -> CancelState:
        """Cancel request ``request_id`` unless it has started; what became of it.

        ``cancelled``: it never ran (its caller gets ``Cancelled``); ``pending``: it has not started
        and never will (its key's holder removes it when it gets there); ``running``: it had started
        and is not interrupted (``ctx.cancel_requested`` is true); ``done``: it had finished;
        ``unknown``: no such request was found, nothing was cancelled and the id stays usable.
        Without ``queue`` the app's queues are searched (``status``). A pending request is found by
        its id alone when its task keeps results; otherwise give ``seq`` (the receipt's inbox
        sequence) or ``key``. See docs/decisions.md.

        Deprecated: the first versions' order, ``cancel(queue, request_id)``, still works and warns
        (``DeprecationWarning``) with the new spelling, until :data:`OLD_CANCEL_ORDER_REMOVED_IN`.
        """
        if deprecated:
            request_id, queue = _old_cancel_order(request_id, deprecated, queue)
        validate_request_id(request_id)
        if is_workflow_id(request_id):
            store = await self._workflow(request_id, queue)
            if store is not None:
                return cast("CancelState", await self._cancel_workflow(store, request_id))
        if key is not None:
            validate_request_key(key)
        queues = self.lookup_queues(queue)
        if len(queues) > 1:
            found = await self._where(request_id, queues, seq, key)
            if found is None:
                return "unknown"
            queues = [found]
        state = await self.transport().cancel(queues[0], request_id, seq, CANCEL_ANSWER_WAIT, key)
        return cast("CancelState", state)

    @overload
    async def status(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                     key: str | None = None, progress: Literal[False] = False) -> RequestStatus: ...
    @overload
    async def status(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                     key: str | None = None, progress: Literal[True]) -> StatusReport: ...

    async def status(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                     key: str | None = None, progress: bool = False) -> RequestStatus | StatusReport:
        """Where request ``request_id`` is: ``unknown``, ``pending``, ``scheduled``, ``running``,
        ``done``, ``failed``, ``cancelled`` or ``expired`` (``keyqueue.app.status``).

        Without ``queue`` the app's queues are searched. By its id alone a request is found in every
        state when its task keeps results (``result_ttl``); otherwise a pending one is found only
        with ``seq`` (its receipt's inbox sequence) or ``key``. ``progress=True``: a
        ``StatusReport`` with the status and the request's last kept progress (``progress``), read
        at the same time.
        """
        validate_request_id(request_id)
        if key is not None:
            validate_request_key(key)
        if is_workflow_id(request_id):
            store = await self._workflow(request_id, queue)
            view = await read_workflow(store, request_id) if store is not None else None
            if view is not None:
                transport = self.transport()
                return cast("RequestStatus", await workflow_status(
                    view, lambda step: transport.status(step.queue or self.name, step.request_id, step.seq, step.key)))
        queues = self.lookup_queues(queue)
        asked = asyncio.gather(*(self.transport().status(q, request_id, seq, key) for q in queues))
        if progress:
            answers, kept = await asyncio.gather(asked, self._kept_progress(queues, request_id))
        else:
            answers, kept = await asked, None
        state = cast("RequestStatus", next((a for a in answers if a != "unknown"), "unknown"))
        return StatusReport(state, kept) if progress else state

    async def progress(self, request_id: str, *, queue: str | None = None) -> Progress | None:
        """The last progress request ``request_id``'s task reported (``ctx.progress(value)``), as the
        worker running it kept it: a ``keyqueue.Progress`` (``value``, ``task``, ``attempt``,
        ``reported_at``), or None if none is kept (it reported none, it has not started, its task
        has ``result_ttl=0``, or it was kept longer ago than a day). Any process may ask; without
        ``queue`` the app's queues are searched. See ``keyqueue.app.progress``.
        """
        validate_request_id(request_id)
        return await self._kept_progress(self.lookup_queues(queue), request_id)

    async def _kept_progress(self, queues: Sequence[str], request_id: str) -> Progress | None:
        found = await asyncio.gather(*(self.transport().kept_progress(q, request_id) for q in queues))
        return next((p for p in found if p is not None), None)

    # --- workflows: chain, group, chord (``keyqueue.tasks.canvas``) ---

    async def start_workflow(self, plan: WorkflowPlan, tasks: Mapping[str, Task[Any]]) -> WorkflowReceipt:
        """Store a compiled workflow and enqueue its first steps (what ``canvas.enqueue()`` calls)."""
        return await start_workflow(self, plan, tasks)

    async def workflow(self, workflow_id: str, *, queue: str | None = None) -> WorkflowView | None:
        """Workflow ``workflow_id`` as its records say it is (its steps, their keys and states), or None."""
        validate_workflow_id(workflow_id)
        store = await self._workflow(workflow_id, queue)
        return await read_workflow(store, workflow_id) if store is not None else None

    async def _cancel_workflow(self, store: WorkflowStore, workflow_id: str) -> str:
        transport = self.transport()
        assert isinstance(transport, NatsTransport)  # a workflow was found: not the eager mode
        state, count = await cancel_workflow(store, workflow_id, transport.records)
        if state == "cancelled" and count:
            await self.plugins.lifecycle.workflow_changed(app=self, queue=store.queue, workflow_id=workflow_id,
                                                          change="cancelled", reason=f"{count} step(s) not started")
        return state

    async def _workflow(self, workflow_id: str, queue: str | None) -> WorkflowStore | None:
        """Where workflow ``workflow_id`` is kept: in ``queue``, else wherever it is; None if nowhere."""
        return await locate_workflow(self, workflow_id, validate_queue_name(queue) if queue is not None else None)

    async def _where(self, request_id: str, queues: Sequence[str], seq: int | None, key: str | None) -> str | None:
        answers = await asyncio.gather(*(self.transport().status(q, request_id, seq, key) for q in queues))
        return next((q for q, a in zip(queues, answers, strict=True) if a != "unknown"), None)

    async def purge(self, queue: str | None = None, *, key: str | None = None, task: str | None = None) -> int:
        """Remove pending requests (of ``key``, of ``task``, or all) from ``queue`` (default: the queue
        of ``task``, else the app's name); how many. ``key="~"`` (``keyqueue.UNKEYED``): only the
        unkeyed requests. They never run; a request a worker has started or read ahead may still
        run (``keyqueue.app.purge``)."""
        from keyqueue.app.purge import PurgeFilter, purge_pending
        from keyqueue.jetstream.api import JetStreamApi

        which = PurgeFilter(self.lookup_queues(queue, task)[0] if queue or task else self.name, key, task)
        return await purge_pending(JetStreamApi(await self.connection()), which)

    # --- the sync face: the same, for code without an event loop (Django, Flask, a script) ---

    def result_sync(self, request_id: str, *, queue: str | None = None, timeout: float = DEFAULT_CALL_TIMEOUT,
                    task: str | None = None) -> Any:
        """``result`` for code without a running event loop (blocks up to ``timeout`` plus the sync bound)."""
        return self.run_sync(lambda: self.result(request_id, queue=queue, timeout=timeout, task=task),
                             bound=timeout + SYNC_BOUND, what=f"the result of request {request_id}")

    def cancel_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None) -> CancelState:
        """``cancel`` for code without a running event loop."""
        return self.run_sync(lambda: self.cancel(request_id, queue=queue, seq=seq, key=key),
                             what=f"cancelling request {request_id}")

    @overload
    def status_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None, progress: Literal[False] = False) -> RequestStatus: ...
    @overload
    def status_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None, progress: Literal[True]) -> StatusReport: ...

    def status_sync(self, request_id: str, *, queue: str | None = None, seq: int | None = None,
                    key: str | None = None, progress: bool = False) -> RequestStatus | StatusReport:
        """``status`` for code without a running event loop (``progress=True``: a ``StatusReport``)."""
        if progress:
            return self.run_sync(lambda: self.status(request_id, queue=queue, seq=seq, key=key, progress=True),
                                 what=f"the status of request {request_id}")
        return self.run_sync(lambda: self.status(request_id, queue=queue, seq=seq, key=key),
                             what=f"the status of request {request_id}")

    def progress_sync(self, request_id: str, *, queue: str | None = None) -> Progress | None:
        """``progress`` for code without a running event loop."""
        return self.run_sync(lambda: self.progress(request_id, queue=queue),
                             what=f"the progress of request {request_id}")

    def purge_sync(self, queue: str | None = None, *, key: str | None = None, task: str | None = None) -> int:
        """``purge`` for code without a running event loop."""
        return self.run_sync(lambda: self.purge(queue, key=key, task=task),
                             what=f"purging queue {queue or task or self.name}")

    # --- the connection ---

    async def url(self) -> str:
        """The NATS URL this app uses (starting or finding the embedded server when none is configured)."""
        return self.settings.url if self.settings.url is not None else await self._local.url()

    async def connection(self) -> Client:
        """The app's NATS connection in the running event loop (connecting on first use)."""
        state = await self._connections.current()
        assert state.nc is not None
        return state.nc

    async def _settings_with_url(self) -> Settings:
        return self.settings if self.settings.url is not None else self.settings.with_url(await self._local.url())

    async def _reconnected(self) -> None:
        for listener in list(self._reconnect_listeners):
            try:
                listener()
            except Exception:
                log.exception("reconnect listener failed")

    def on_reconnect(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every reconnect; returns a function that removes it."""
        self._reconnect_listeners.append(listener)
        return lambda: self._reconnect_listeners.remove(listener)

    @contextlib.asynccontextmanager
    async def lifespan(self, _server: object = None) -> AsyncIterator[None]:
        """Connected for as long as the block runs: a web app's start-up and shutdown.

        On entry, connect on the running loop now (``ConnectionFailed`` if the server cannot be
        reached: a web server then fails its start-up instead of its first request); on exit,
        ``close``. ``_server`` is ignored, so the method is an ASGI lifespan as it is::

            api = FastAPI(lifespan=app.lifespan)         # or Starlette(lifespan=app.lifespan)

            @contextlib.asynccontextmanager               # beside a lifespan of your own
            async def lifespan(api: FastAPI):
                async with app.lifespan():
                    yield
        """
        await self.connection()
        try:
            yield
        finally:
            await self.close()

    # --- workers ---

    def worker(self, *, queues: Sequence[str] | None = None, concurrency: int = 16, linger: float = 0.05,
               ack_wait: float | None = None, drain_timeout: float = 10.0, name: str | None = None,
               overflow_min_pending: int = 0, overflow_min_ack_pending: int = 0,
               priority: int | None = None, connect_timeout: float | None = None, watchdog: bool = False,
               sync_pool: str = "threads", app_spec: str | None = None) -> Worker:
        """A worker for ``queues`` (default: all of the app's); use it as ``async with app.worker():``.

        ``concurrency``: keys held at once per queue. ``linger``: seconds a key stays held with no
        new request. ``ack_wait``: seconds of the queue's lease, set on the server in place if it
        differs (``None``: hold keys for the lease the server has).
        ``drain_timeout``: seconds a stopping worker waits for requests in hand.
        ``overflow_min_pending`` / ``overflow_min_ack_pending``: on an ``overflow`` queue, take keys
        only while that many wait / are held. ``priority``: on a ``prioritized`` queue, 0 (served
        first) to 9. See docs/priority-groups.md. ``connect_timeout``: seconds to wait for an
        unreachable server at start, retrying with a backoff (None: wait forever). ``watchdog``:
        end this process before a run it cannot stop outlives its lease (an event loop blocked by a
        handler, a sync task's thread after a lost lease: exit status 75; C code holding the GIL, a
        stopped process: SIGKILL from a kernel timer, core/alarm.py), so no other worker runs its
        keys beside it (``keyqueue worker`` turns it on; off here, where the worker may be a guest
        in your process). ``sync_pool="processes"``: run serial
        sync tasks in child processes, which the hard limit and a drain's deadline can stop
        (``keyqueue.app.process_pool``; ``app_spec`` is the app as ``MODULE:APP`` for the children).
        """
        from keyqueue.app.worker import Worker

        return Worker(self, queues=queues, concurrency=concurrency, linger=linger, ack_wait=ack_wait,
                      drain_timeout=drain_timeout, name=name, overflow_min_pending=overflow_min_pending,
                      overflow_min_ack_pending=overflow_min_ack_pending, priority=priority,
                      connect_timeout=connect_timeout, watchdog=watchdog, sync_pool=sync_pool, app_spec=app_spec)

    # --- closing ---

    async def close(self) -> None:
        """Close the connection of the running loop and of ``delay``; stop an embedded server this app started."""
        await self._connections.close()
        await asyncio.to_thread(self._sync.close_sync)
        await self._local.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
