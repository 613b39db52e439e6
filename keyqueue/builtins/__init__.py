"""keyqueue's own behaviour, shipped as plugins (``keyqueue.plugins.BUILTIN_PLUGINS``).

- ``processor``: builds the processor that runs ``@task`` functions (policies, retries, merging).
- ``lifecycle_log``: logs what a human should see (a failed attempt, a worker's queues).
- ``events``: publishes lifecycle events to ``KQ_<queue>_EVENTS``.
- ``workflows``: the worker that finishes a workflow's step enqueues what follows it
  (``keyqueue_request_settled``).

Each module is a plugin: hook implementations over ``tasks``, ``core`` and ``jetstream``. They
import ``keyqueue.app`` for type hints only, and ``keyqueue.cli`` only inside
``keyqueue_add_commands`` (which the CLI calls).
"""
