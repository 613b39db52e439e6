"""The application: ``App`` (tasks, processors, plugins, connection) and the ``Worker`` that serves it.

- ``application``: ``App``, the default app and the module-level ``task`` decorator.
- ``transport``: how an app's requests reach NATS (publish, request-reply, the shared connection).
- ``worker``: ``Worker``, an app's queues served from one process; it implements the core's
  ``SessionObserver`` by calling the lifecycle hooks.

May import ``tasks``, ``plugins``, ``server``, ``core``, ``jetstream``, ``wire``; nothing imports it
but the top-level API, the built-in plugins' type hints, the CLI and ``testing``.
"""

from keyqueue.app.application import App, default_app, task
from keyqueue.app.worker import Worker

__all__ = ["App", "Worker", "default_app", "task"]
