"""The application: ``App`` (tasks, processors, plugins, connection) and the ``Worker`` that serves it.

- ``application``: ``App``, the default app and the module-level ``task`` decorator. ``App`` is
  the ``keyqueue.tasks.task.Dispatcher`` its tasks send through.
- ``transport``: how an app's requests reach NATS (publish, request-reply, the shared connection),
  behind the ``Transport`` protocol that ``keyqueue.testing.eager`` also implements.
- ``worker``: ``Worker``, an app's queues served from one process; it implements the core's
  ``SessionObserver`` by calling the lifecycle hooks.

May import ``plugins``, ``tasks``, ``core``, ``jetstream``, ``server``, ``wire``, ``settings`` and
``errors``. Only the layers above it import it (``builtins``, ``admin``, the public façades, the
CLI, ``testing``, ``chaos``); below it, only the hook specs name it, in type hints.
``tests/unit/test_layers.py`` checks these directions for every package.
"""

from keyqueue.app.application import App, default_app, task
from keyqueue.app.worker import Worker

__all__ = ["App", "Worker", "default_app", "task"]
