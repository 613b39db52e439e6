"""The plugin manager: the ``hookimpl`` marker, entry-point loading, and the helper that awaits.

Every ``App`` (and the ``keyqueue`` command line) owns one ``PluginManager``; there is no
global one. It registers, in this order: the built-in plugins (``BUILTIN_PLUGINS``), the
entry-point group ``keyqueue`` (skipped when ``KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD`` is set), then
the plugins passed in. pluggy calls the most recent registration first, so explicit plugins run
before entry-point plugins, which run before the built-ins.

pluggy does not await; ``PluginManager.first``, ``collect`` and ``notify`` do, and ``notify``
also isolates observers (a failing lifecycle hook is logged, never raised) and runs closing
hooks in reverse. keyqueue calls the lifecycle hooks through ``PluginManager.lifecycle``
(:class:`LifecycleHooks`): one typed method per hook, so mypy checks every call's arguments.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import pluggy

from keyqueue.errors import ConfigError
from keyqueue.plugins import hookspecs
from keyqueue.plugins.hookspecs import PROJECT

if TYPE_CHECKING:
    from keyqueue.app.application import App
    from keyqueue.app.worker import Worker

__all__ = [
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "LifecycleHooks",
    "Observers",
    "PluginInfo",
    "PluginManager",
    "autoload_disabled",
    "hookimpl",
    "inline_observer",
    "maybe_await",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("keyqueue.plugins")

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a function as a hook implementation: ``@keyqueue.hookimpl`` (or with ``tryfirst=True``...)."""

ENTRY_POINT_GROUP: Final = "keyqueue"
"""Entry-point group third-party plugins are loaded from (``[project.entry-points.keyqueue]``)."""

DISABLE_AUTOLOAD_ENV: Final = "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD"
"""Set to anything but empty, ``0`` or ``false`` to skip the entry-point plugins."""

BUILTIN_PLUGINS: Final = ("keyqueue.builtins.processor", "keyqueue.builtins.lifecycle_log", "keyqueue.builtins.events",
                          "keyqueue.builtins.workflows")
"""keyqueue's own behaviour, as plugin modules: tasks and retries, lifecycle logging, events, workflows."""


INLINE_ATTRIBUTE: Final = "keyqueue_inline_observer"
"""The attribute :func:`inline_observer` sets on a hook implementation."""


def inline_observer(function: F) -> F:
    """Mark a lifecycle hook implementation (``@keyqueue.hookimpl``) as an inline observer: a worker
    calls it at the event itself, on the key session's path, instead of queueing the call for its
    hook dispatcher (docs/plugins.md, "Inline observers").

    For a plain function that returns at once and does no I/O: count, record a metric, keep an
    event for a batch. It may return an awaitable (a batch that is due to be sent), which the
    dispatcher awaits in order with the queued calls. Its exceptions are logged, as any lifecycle
    hook's; one that blocks blocks every key of the worker. Outside a worker's session events
    (``keyqueue_worker_started``, ``keyqueue_workflow_changed``...) the mark changes nothing.
    """
    setattr(function, INLINE_ATTRIBUTE, True)
    return function


class Observers(NamedTuple):
    """The implementations of one lifecycle hook a worker calls for an event, each list in call order."""

    hook_name: str
    inline: tuple[pluggy.HookImpl, ...]
    """Called at the event (:func:`inline_observer`)."""
    queued: tuple[pluggy.HookImpl, ...]
    """Called by the worker's hook dispatcher, after the event (:meth:`PluginManager.notify_each`)."""


def _call(impl: pluggy.HookImpl, kwargs: Mapping[str, Any]) -> Any:
    """Call one hook implementation with the arguments it names, as pluggy does."""
    # map over the dict's own lookup: no list comprehension's frame (several calls per request).
    return impl.function(*map(kwargs.__getitem__, impl.argnames))


async def maybe_await(value: T | Awaitable[T]) -> T:
    """``value``, awaited first if it is awaitable (how keyqueue runs hooks that may be async)."""
    if inspect.isawaitable(value):
        return await value
    return value


def autoload_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD`` asks to skip entry-point plugins."""
    value = (os.environ if environ is None else environ).get(DISABLE_AUTOLOAD_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, as ``keyqueue plugins`` shows it."""

    name: str
    hooks: tuple[str, ...]
    distribution: str | None = None
    """``name version`` of the distribution that provided it (entry-point plugins)."""
    builtin: bool = False


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for keyqueue's hooks, with helpers that await and isolate."""

    def __init__(self, *, autoload: bool = True, plugins: Iterable[object] = ()) -> None:
        super().__init__(PROJECT)
        self._implementations: dict[str, tuple[pluggy.HookImpl, ...]] = {}
        """Hook name -> its implementations, until a plugin is registered or unregistered."""
        self._observers: dict[tuple[str, bool], Observers | None] = {}
        """(hook name, reverse) -> its observers (:meth:`observers`), as long as ``_implementations``."""
        self.add_hookspecs(hookspecs)
        self.distributions: dict[str, str] = {}
        """Plugin name -> ``distribution version`` for entry-point plugins."""
        self.lifecycle = LifecycleHooks(self)
        """The lifecycle hooks, one typed method each."""
        for module_name in BUILTIN_PLUGINS:
            self.register(importlib.import_module(module_name), name=module_name)
        if autoload:
            self._load_entry_points()
        for plugin in plugins:
            self.register(plugin)
        self._check()

    def register(self, plugin: object, name: str | None = None) -> str | None:
        try:
            return super().register(plugin, name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            shown = name or getattr(plugin, "__name__", None) or type(plugin).__qualname__
            detail = " ".join(str(exc).split())  # pluggy's message spans lines
            raise ConfigError(f"plugin {shown} cannot be registered: {detail}") from exc
        finally:
            self._implementations.clear()
            self._observers.clear()

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any | None:
        try:
            return super().unregister(plugin, name)
        finally:
            self._implementations.clear()  # set_blocked unregisters too
            self._observers.clear()

    def implementations(self, hook_name: str) -> tuple[pluggy.HookImpl, ...]:
        """The implementations of a hook, in registration order (pluggy calls them last first).

        Looked up once until a plugin is registered or unregistered, so the worker can skip, per
        request, what no plugin implements.
        """
        impls = self._implementations.get(hook_name)
        if impls is None:
            caller = getattr(self.hook, hook_name, None)
            impls = tuple(caller.get_hookimpls()) if isinstance(caller, pluggy.HookCaller) else ()
            self._implementations[hook_name] = impls
        return impls

    def observers(self, hook_name: str, *, reverse: bool = False) -> Observers | None:
        """The implementations of a lifecycle hook, inline and queued, in the order they are called
        (``reverse``: a closing hook's, see :meth:`notify`); None when no plugin implements it.
        Looked up once, as :meth:`implementations` is."""
        try:
            return self._observers[hook_name, reverse]
        except KeyError:
            pass
        impls = self.implementations(hook_name)
        ordered = impls if reverse else impls[::-1]
        observers = None
        if ordered:
            inline = tuple(impl for impl in ordered if getattr(impl.function, INLINE_ATTRIBUTE, False))
            observers = Observers(hook_name, inline, tuple(impl for impl in ordered if impl not in inline))
        self._observers[hook_name, reverse] = observers
        return observers

    def implemented_only_by(self, hook_name: str, function: Callable[..., Any]) -> bool:
        """Whether ``function`` is the one implementation of a hook (a built-in one, say, whose
        answer the caller can then compute without calling the hook)."""
        impls = self.implementations(hook_name)
        return len(impls) == 1 and impls[0].function is function

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self.get_plugin(ep.name) is not None or self.is_blocked(ep.name):
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else None
            try:
                plugin = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"plugin {ep.name!r} ({ep.value}{', from ' + dist if dist else ''}) failed to load: "
                    f"{type(exc).__name__}: {exc}; set {DISABLE_AUTOLOAD_ENV}=1 to start without plugins"
                ) from exc
            self.register(plugin, name=ep.name)
            if dist is not None:
                self.distributions[ep.name] = dist

    def _check(self) -> None:
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise ConfigError(f"{exc}; keyqueue's hooks are listed in keyqueue.plugins.hookspecs") from exc
        for caller in self.hook.__dict__.values():
            if not isinstance(caller, pluggy.HookCaller):
                continue
            for impl in caller.get_hookimpls():
                if impl.hookwrapper or impl.wrapper:
                    raise ConfigError(
                        f"plugin {impl.plugin_name}: {caller.name} is marked as a pluggy wrapper; keyqueue "
                        "hooks cannot be pluggy wrappers, use keyqueue_wrap_enqueue / keyqueue_wrap_process"
                    )

    # --- calling hooks ---------------------------------------------------------------------------

    async def first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a ``firstresult`` hook and await its result if it is awaitable."""
        impls = self.implementations(hook_name)
        if len(impls) == 1:  # the usual case (a built-in alone), per key or request: no pluggy machinery
            return await maybe_await(_call(impls[0], kwargs))
        return await maybe_await(getattr(self.hook, hook_name)(**kwargs))

    async def collect(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call a hook and await each result that is awaitable; results in call order (a result of
        None left out, as pluggy leaves it out)."""
        impls = self.implementations(hook_name)
        if len(impls) == 1:
            result = _call(impls[0], kwargs)
            return [] if result is None else [await maybe_await(result)]
        return [await maybe_await(result) for result in getattr(self.hook, hook_name)(**kwargs)]

    async def notify(self, hook_name: str, *, reverse: bool = False, **kwargs: Any) -> None:
        """Call a lifecycle hook, awaiting each implementation in turn; never raises.

        ``reverse`` runs the implementations in the opposite of pluggy's order (closing hooks).
        A failing implementation is logged with its plugin's name and the rest still run.
        """
        impls = self.implementations(hook_name)
        # Listed in registration order; pluggy calls them last first.
        await self.notify_each(hook_name, impls if reverse else impls[::-1], kwargs)

    async def notify_each(self, hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        """Call ``impls`` of a lifecycle hook in that order, awaiting each; never raises (see :meth:`notify`)."""
        for impl in impls:
            try:
                result = _call(impl, kwargs)
                # Most implementations are coroutine functions or return None: both are told
                # apart without inspect's checks (this runs several times per request).
                if type(result) is CoroutineType or (result is not None and inspect.isawaitable(result)):
                    await result
            except Exception:
                log.exception("plugin %s failed in %s; carrying on", impl.plugin_name, hook_name)

    def wrappers(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """The context managers an around-style hook returned, in call order (one implementation,
        such as the OpenTelemetry plugin's around each attempt, is called directly, as in :meth:`first`)."""
        impls = self.implementations(hook_name)
        if len(impls) == 1:
            wrapper = _call(impls[0], kwargs)
            return [] if wrapper is None else [wrapper]
        return [w for w in getattr(self.hook, hook_name)(**kwargs) if w is not None]

    async def enter_wrappers(self, stack: AsyncExitStack, hook_name: str, **kwargs: Any) -> None:
        """Enter every context manager of an around-style hook on ``stack`` (exited in reverse)."""
        await self.enter_each(stack, hook_name, self.wrappers(hook_name, **kwargs))

    @staticmethod
    async def enter_each(stack: AsyncExitStack, hook_name: str, wrappers: Iterable[Any]) -> None:
        """Enter ``wrappers`` (what an around-style hook returned) on ``stack``, in order."""
        for wrapper in wrappers:
            if hasattr(wrapper, "__aenter__"):
                await stack.enter_async_context(wrapper)
            elif hasattr(wrapper, "__enter__"):
                stack.enter_context(wrapper)
            else:
                raise ConfigError(f"{hook_name} must return a context manager or None, not {wrapper!r}")

    # --- listing ---------------------------------------------------------------------------------

    def listing(self) -> list[PluginInfo]:
        """Every registered plugin and the hooks it implements, built-ins last."""
        hooks_of: dict[str, list[str]] = {}
        for caller in self.hook.__dict__.values():
            if isinstance(caller, pluggy.HookCaller):
                for impl in caller.get_hookimpls():
                    hooks_of.setdefault(impl.plugin_name, []).append(caller.name)
        infos = []
        for name, _plugin in self.list_name_plugin():
            infos.append(
                PluginInfo(
                    name=name,
                    hooks=tuple(sorted(hooks_of.get(name, []))),
                    distribution=self.distributions.get(name),
                    builtin=name in BUILTIN_PLUGINS,
                )
            )
        return sorted(infos, key=lambda info: (info.builtin, info.name))


class LifecycleHooks:
    """The lifecycle hooks (``keyqueue.plugins.hookspecs``), one typed method each.

    Each method takes exactly its hook's arguments, by keyword, and returns the call of the hook
    through :meth:`PluginManager.notify` to await: isolated, closing hooks in reverse order. (Plain
    methods returning that coroutine: an ``async def`` around it would add one per event.)
    """

    def __init__(self, manager: PluginManager) -> None:
        self._notify = manager.notify

    def worker_started(self, *, worker: Worker) -> Awaitable[None]:
        return self._notify("keyqueue_worker_started", worker=worker)

    def worker_stopping(self, *, worker: Worker) -> Awaitable[None]:
        return self._notify("keyqueue_worker_stopping", reverse=True, worker=worker)

    def worker_pinned(self, *, worker: Worker, queue: str, pin_id: str) -> Awaitable[None]:
        return self._notify("keyqueue_worker_pinned", worker=worker, queue=queue, pin_id=pin_id)

    def worker_unpinned(self, *, worker: Worker, queue: str, pin_id: str) -> Awaitable[None]:
        return self._notify("keyqueue_worker_unpinned", reverse=True, worker=worker, queue=queue, pin_id=pin_id)

    def key_acquired(self, *, worker: Worker, queue: str, key: str, fencing: tuple[int, int]) -> Awaitable[None]:
        return self._notify("keyqueue_key_acquired", worker=worker, queue=queue, key=key, fencing=fencing)

    def key_released(self, *, worker: Worker, queue: str, key: str, outcome: str) -> Awaitable[None]:
        return self._notify("keyqueue_key_released", reverse=True, worker=worker, queue=queue, key=key,
                            outcome=outcome)

    def request_started(self, *, worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                        attempt: int, enqueued_at: float | None = None) -> Awaitable[None]:
        return self._notify("keyqueue_request_started", worker=worker, queue=queue, key=key, request_id=request_id,
                            message_type=message_type, attempt=attempt, enqueued_at=enqueued_at)

    def request_failed(self, *, worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                       attempt: int, error: BaseException, elapsed: float) -> Awaitable[None]:
        return self._notify("keyqueue_request_failed", reverse=True, worker=worker, queue=queue, key=key,
                            request_id=request_id, message_type=message_type, attempt=attempt, error=error,
                            elapsed=elapsed)

    def request_retried(self, *, worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                        attempt: int, delay: float, error: str) -> Awaitable[None]:
        return self._notify("keyqueue_request_retried", reverse=True, worker=worker, queue=queue, key=key,
                            request_id=request_id, message_type=message_type, attempt=attempt, delay=delay,
                            error=error)

    def request_succeeded(self, *, worker: Worker, queue: str, key: str, request_id: str, message_type: str,
                          elapsed: float) -> Awaitable[None]:
        return self._notify("keyqueue_request_succeeded", reverse=True, worker=worker, queue=queue, key=key,
                            request_id=request_id, message_type=message_type, elapsed=elapsed)

    def request_superseded(self, *, worker: Worker, queue: str, key: str, request_id: str,
                           message_type: str, superseded_by: str) -> Awaitable[None]:
        return self._notify("keyqueue_request_superseded", reverse=True, worker=worker, queue=queue, key=key,
                            request_id=request_id, message_type=message_type, superseded_by=superseded_by)

    def workflow_changed(self, *, app: App, queue: str, workflow_id: str, change: str, step: int | None = None,
                         task: str | None = None, key: str | None = None,
                         reason: str | None = None) -> Awaitable[None]:
        return self._notify("keyqueue_workflow_changed", app=app, queue=queue, workflow_id=workflow_id, change=change,
                            step=step, task=task, key=key, reason=reason)

    def request_dead_lettered(self, *, worker: Worker, queue: str, key: str, request_id: str,
                              message_type: str, reason: str, attempts: int, error: str) -> Awaitable[None]:
        return self._notify("keyqueue_request_dead_lettered", reverse=True, worker=worker, queue=queue, key=key,
                            request_id=request_id, message_type=message_type, reason=reason, attempts=attempts,
                            error=error)
