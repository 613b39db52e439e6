"""The ``keyqueue`` command line: one click group, one module per command or command group.

- ``group``: the top-level group, its one-line errors and the commands plugins add
  (``keyqueue_add_commands``).
- ``common``: what commands share: ``--url``, loading an app, a connection, output, logging.
- ``worker``: serve an app's queues (``supervisor``: ``--processes N``, a parent of N workers).
- ``enqueue``: enqueue a task by name.
- ``queues``: ``inspect``, ``configure``, ``unpin``, ``recreate-consumer``, ``delete-queue``, ``purge``.
- ``release``: hand on the keys of a worker that is gone.
- ``dlq``: list, show, replay, delete, purge.       ``watch``: follow a key's progress.
- ``plugins``: loaded plugins and their hooks.      ``server``: ``dev-server``, a local nats-server.
- ``requests``: ``result``, ``status``, ``cancel`` of a request (or a workflow) by its id.
- ``workflows``: ``workflow show``, ``workflow list``.
- ``events``: ``events tail``, added by the built-in events plugin.

``main`` is the console script (``keyqueue``, ``python -m keyqueue``, ``python -m keyqueue.cli``).
"""

from keyqueue.cli.group import main

__all__ = ["main"]
