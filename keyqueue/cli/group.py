"""The ``keyqueue`` group: its built-in commands, plugins' commands, and one-line errors.

``KeyqueueGroup`` turns any ``KeyqueueError`` a command raises (sub-groups' commands included)
into one line on stderr and exit status 1, so no command needs its own error handling. It also
finds the commands plugins add through the ``keyqueue_add_commands`` hook, on demand: only when
``keyqueue --help`` lists them or a command line names one.
"""

from __future__ import annotations

from typing import Any, Final

import click

from keyqueue.cli.dashboard import dashboard
from keyqueue.cli.dlq import dlq
from keyqueue.cli.enqueue import enqueue
from keyqueue.cli.plugins import plugins
from keyqueue.cli.queues import (
    configure,
    delete_queue_command,
    inspect_command,
    permissions_command,
    purge,
    recreate_consumer,
    unpin,
)
from keyqueue.cli.release import release
from keyqueue.cli.requests import cancel, result, status
from keyqueue.cli.schedules import schedules
from keyqueue.cli.server import dev_server
from keyqueue.cli.watch import watch
from keyqueue.cli.worker import worker
from keyqueue.cli.workflows import workflow
from keyqueue.errors import KeyqueueError
from keyqueue.plugins.manager import PluginManager, autoload_disabled

__all__ = ["EXIT_ERROR", "KeyqueueClickError", "KeyqueueGroup", "main"]

EXIT_ERROR: Final = 1
"""Exit status when a command fails with a keyqueue error (click uses 2 for usage errors)."""


class KeyqueueGroup(click.Group):
    """The top-level group: keyqueue errors as one line without a traceback; plugins' commands.

    ``KeyqueueError`` is what keyqueue raises for things the user can fix (a missing binary, a
    port in use, bad settings, an unreachable server); anything else is a bug and keeps its
    traceback. Commands that plugins add (``keyqueue_add_commands``) are found on demand and
    only here: a sub-group such as ``dlq`` is a plain ``click.Group``.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyqueueError as exc:
            raise KeyqueueClickError(exc) from exc

    def _plugin_commands(self) -> dict[str, click.Command]:
        collector = click.Group()
        PluginManager(autoload=not autoload_disabled()).hook.keyqueue_add_commands(cli=collector)
        return {name: cmd for name, cmd in collector.commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        try:
            extra = list(self._plugin_commands())
        except KeyqueueError as exc:
            click.echo(f"Warning: plugin commands are not listed: {exc}", err=True)
            extra = []
        return sorted([*super().list_commands(ctx), *extra])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or self._plugin_commands().get(cmd_name)


class KeyqueueClickError(click.ClickException):
    """A keyqueue error as click reports it: ``Error: <message>`` on stderr."""

    exit_code = EXIT_ERROR

    def __init__(self, error: KeyqueueError) -> None:
        super().__init__(f"{error}")
        self.error = error


@click.group(
    cls=KeyqueueGroup,
    commands=[worker, enqueue, inspect_command, unpin, configure, recreate_consumer, delete_queue_command, purge,
              permissions_command, dlq,
              watch, plugins, dev_server, dashboard, result, status, cancel, schedules, release, workflow],
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="keyqueue", prog_name="keyqueue")
def main() -> None:
    """keyqueue runs tasks with exclusive, ordered work per key, on NATS JetStream.

    Requests for the same key never run at the same time and run in the order they were
    enqueued; requests for different keys run in parallel across workers.

    \b
    Start here:
      keyqueue dev-server --store-dir nats-data   run a local nats-server with JetStream,
                                                  its data kept in nats-data/ across restarts
      export KEYQUEUE_URL=...                     point everything else at it (the URL it prints)
      keyqueue worker shop:app                    serve the tasks of `app` in shop.py

    The connection is configured with KEYQUEUE_* environment variables (KEYQUEUE_URL,
    KEYQUEUE_CREDS, KEYQUEUE_TLS_CA, ...) or --url. Run `keyqueue COMMAND --help` for a
    command's options and an example.
    """
