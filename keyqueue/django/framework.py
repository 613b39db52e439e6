"""Django's Tasks framework, wherever it is installed: ``django.tasks`` (Django >= 6.0) or the
``django_tasks`` backport (the same API, for older Django). Everything here is typed ``Any``: Django
ships no type information."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Final

from keyqueue.errors import ConfigError

__all__ = ["FRAMEWORK", "BaseTaskBackend", "InvalidTask", "Task", "TaskContext", "TaskError", "TaskResult",
           "TaskResultDoesNotExist", "TaskResultStatus", "normalize_json", "signals", "task", "task_backends"]


def _framework() -> str:
    for name in ("django.tasks", "django_tasks"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise ConfigError("keyqueue's Django Tasks backend needs Django >= 6.0 (django.tasks) or, before it, the "
                      "django-tasks backport: pip install 'keyqueue[django]'")


FRAMEWORK: Final = _framework()
"""The package of the Tasks framework in use: ``django.tasks`` or ``django_tasks``."""


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{FRAMEWORK}.{name}" if name else FRAMEWORK)


def _first(module: ModuleType, *names: str) -> Any:
    """The first of ``names`` that ``module`` has (Django and the backport spell a few differently)."""
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise ConfigError(f"{module.__name__} has none of {', '.join(names)}: an unsupported version of Django's Tasks")


_base = _module("base")
_exceptions = _module("exceptions")

task_backends: Any = _module("").task_backends
task: Any = _module("").task
"""Django's ``@task`` decorator."""
BaseTaskBackend: Any = _module("backends.base").BaseTaskBackend
Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
DEFAULT_TASK_PRIORITY: Final[int] = _base.DEFAULT_TASK_PRIORITY
DEFAULT_TASK_BACKEND_ALIAS: Final[str] = _base.DEFAULT_TASK_BACKEND_ALIAS
DEFAULT_TASK_QUEUE_NAME: Final[str] = _base.DEFAULT_TASK_QUEUE_NAME
InvalidTask: Any = _first(_exceptions, "InvalidTask", "InvalidTaskError")
TaskResultDoesNotExist: Any = _first(_exceptions, "TaskResultDoesNotExist", "ResultDoesNotExist")
signals: Any = _module("signals")
"""``task_enqueued``, ``task_started`` and ``task_finished``."""

try:
    from django.utils.json import normalize_json as _normalize  # Django >= 6.0
except ImportError:
    _normalize = _module("utils").normalize_json

normalize_json: Any = _normalize
"""Django's JSON normalization of task arguments and return values (tuples become lists, ...)."""
