"""The decorators ``App.task(...)`` and ``keyqueue.task(...)`` return, and what they record.

``TaskDecorator`` makes a ``Task[F]`` of any function; ``BatchTaskDecorator`` (``policy="batch"``)
makes a ``BatchTask[T, R]`` of a function taking ``list[T]``, its overloads telling mypy ``T`` and
``R``. Either registers the task with whoever asked (an app, or the default app's shared tasks)
and binds it to a callable returning its ``Dispatcher`` (the app, looked up when the task is used).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

from keyqueue.errors import ConfigError
from keyqueue.tasks.context import Context
from keyqueue.tasks.rate_limit import RateLimit, parse_rate_limit
from keyqueue.tasks.task import AnyTask, Backoff, BatchTask, Dispatcher, KeySpec, Merge, Policy, Task, TaskSpec

if TYPE_CHECKING:
    from keyqueue.tasks.arguments import Upgrade

__all__ = ["BatchTaskDecorator", "TaskDecorator", "declare"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class _Declaration:
    """What a decorator was given, before it sees the function."""

    key: KeySpec | None
    queue: str
    name: str | None
    policy: Policy
    max_attempts: int
    backoff: Backoff | float
    timeout: float | None
    version: int
    upgrades: Mapping[int, Upgrade] | None
    max_batch: int
    merge: Merge | None
    result_ttl: float | None = None
    rate_limit: RateLimit | None = None
    soft_timeout: float | None = None
    retry_on: tuple[type[BaseException], ...] | None = None

    def spec(self, fn: Callable[..., Any]) -> TaskSpec:
        backoff = self.backoff if isinstance(self.backoff, Backoff) else Backoff(base=float(self.backoff))
        return TaskSpec(
            name=self.name or fn.__name__, queue=self.queue, policy=self.policy, max_attempts=self.max_attempts,
            backoff=backoff, timeout=self.timeout, version=self.version, upgrades=dict(self.upgrades or {}),
            max_batch=self.max_batch, merge=self.merge, result_ttl=self.result_ttl, rate_limit=self.rate_limit,
            soft_timeout=self.soft_timeout, retry_on=self.retry_on, unkeyed=self.key is None,
        )


Register = Callable[[AnyTask], None]
"""Records a new task with whoever declared it (checking, say, that its name is free)."""


def _check_function(fn: Any) -> None:
    if not callable(fn) or isinstance(fn, (Task, BatchTask)):
        raise ConfigError(f"@task decorates a function, not {fn!r}")


class TaskDecorator:
    """What ``app.task(...)`` returns: apply it to a function to make a ``Task``."""

    def __init__(self, declaration: _Declaration, register: Register, dispatcher: Callable[[], Dispatcher]) -> None:
        self._declaration = declaration
        self._register = register
        self._dispatcher = dispatcher

    def __call__(self, fn: F) -> Task[F]:
        _check_function(fn)
        task = Task(fn, self._declaration.spec(fn), self._declaration.key, self._dispatcher)
        self._register(task)
        return task


class BatchTaskDecorator:
    """What ``app.task(policy="batch", ...)`` returns: apply it to a function to make a ``BatchTask``."""

    def __init__(self, declaration: _Declaration, register: Register, dispatcher: Callable[[], Dispatcher]) -> None:
        self._declaration = declaration
        self._register = register
        self._dispatcher = dispatcher

    @overload
    def __call__(self, fn: Callable[[Context, list[T]], Awaitable[Sequence[R]]]) -> BatchTask[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[Context, list[T]], Awaitable[None]]) -> BatchTask[T, None]: ...
    @overload
    def __call__(self, fn: Callable[[Context, list[T]], Sequence[R]]) -> BatchTask[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[Context, list[T]], None]) -> BatchTask[T, None]: ...
    @overload
    def __call__(self, fn: Callable[[list[T]], Awaitable[Sequence[R]]]) -> BatchTask[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[list[T]], Awaitable[None]]) -> BatchTask[T, None]: ...
    @overload
    def __call__(self, fn: Callable[[list[T]], Sequence[R]]) -> BatchTask[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[list[T]], None]) -> BatchTask[T, None]: ...

    def __call__(self, fn: Callable[..., Any]) -> BatchTask[Any, Any]:
        _check_function(fn)
        task: BatchTask[Any, Any] = BatchTask(fn, self._declaration.spec(fn), self._declaration.key, self._dispatcher)
        self._register(task)
        return task


def declare(
    *, key: KeySpec | None, queue: str, name: str | None, policy: Policy, max_attempts: int, backoff: Backoff | float,
    timeout: float | None, version: int, upgrades: Mapping[int, Upgrade] | None, max_batch: int, merge: Merge | None,
    register: Register, dispatcher: Callable[[], Dispatcher], result_ttl: float | None = None,
    rate_limit: str | None = None, soft_timeout: float | None = None,
    retry_on: Sequence[type[BaseException]] | None = None,
) -> TaskDecorator | BatchTaskDecorator:
    """The decorator for one task declaration (``App.task`` and ``keyqueue.task`` call this)."""
    declaration = _Declaration(key, queue, name, policy, max_attempts, backoff, timeout, version, upgrades,
                               max_batch, merge, result_ttl,
                               parse_rate_limit(rate_limit) if rate_limit is not None else None,
                               soft_timeout, tuple(retry_on) if retry_on is not None else None)
    if policy == "batch":
        return BatchTaskDecorator(declaration, register, dispatcher)
    return TaskDecorator(declaration, register, dispatcher)
