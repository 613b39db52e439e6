"""The ``keyqueue`` command line: one click group, one function per command.

Commands raise keyqueue's own errors; ``KeyqueueGroup`` turns any ``KeyqueueError`` into one
line on stderr and a non-zero exit, so no command needs its own error handling. Add a command
with ``@main.command()`` in its own section below (worker, enqueue, inspect, dlq, watch, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any, Final

import click

from keyqueue.errors import ConnectionFailed, KeyqueueError
from keyqueue.server import EmbeddedServer

__all__ = ["main"]

EXIT_ERROR: Final = 1
"""Exit status when a command fails with a keyqueue error (click uses 2 for usage errors)."""


# --- the group and its error handling ---------------------------------------------------------


class KeyqueueGroup(click.Group):
    """A click group whose commands report keyqueue errors as one line, without a traceback.

    ``KeyqueueError`` is what keyqueue raises for things the user can fix (a missing binary, a
    port in use, bad settings, an unreachable server); anything else is a bug and keeps its
    traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyqueueError as exc:
            raise KeyqueueClickError(exc) from exc


class KeyqueueClickError(click.ClickException):
    """A keyqueue error as click reports it: ``Error: <message>`` on stderr."""

    exit_code = EXIT_ERROR

    def __init__(self, error: KeyqueueError) -> None:
        super().__init__(f"{error}")
        self.error = error


@click.group(
    cls=KeyqueueGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="keyqueue", prog_name="keyqueue")
def main() -> None:
    """keyqueue runs tasks with exclusive, ordered work per key, on NATS JetStream.

    Requests for the same key never run at the same time and run in the order they were
    enqueued; requests for different keys run in parallel across workers.

    \b
    Start here:
      keyqueue dev-server            run a local nats-server with JetStream
      export KEYQUEUE_URL=...        point everything else at it (the URL it prints)

    The connection is configured with KEYQUEUE_* environment variables (KEYQUEUE_URL,
    KEYQUEUE_CREDS, KEYQUEUE_TLS_CA, ...). Run `keyqueue COMMAND --help` for a command's options.
    """


# --- dev-server --------------------------------------------------------------------------------


@main.command("dev-server")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=4222,
    show_default=True,
    help="Client port on 127.0.0.1; 0 picks a free one.",
)
@click.option(
    "--store-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep JetStream data in this directory across runs (default: a temporary one, deleted on exit).",
)
def dev_server(port: int, store_dir: Path | None) -> None:
    """Run a local nats-server with JetStream in the foreground, for development.

    It listens on 127.0.0.1 only and stops cleanly on Ctrl-C or SIGTERM.

    \b
    Example:
      $ keyqueue dev-server --store-dir .keyqueue-data
      nats-server with JetStream on nats://127.0.0.1:4222
      export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ # in another terminal: paste the export line, then run workers and enqueue tasks
    """
    asyncio.run(_serve(EmbeddedServer(port=port, store_dir=store_dir), persistent=store_dir is not None))


async def _serve(server: EmbeddedServer, *, persistent: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with server:
            kept = "kept" if persistent else "temporary, deleted on exit"
            click.echo(f"nats-server with JetStream on {server.url}")
            click.echo(f"store: {server.store_dir} ({kept}); log: {server.log_file}")
            click.echo(f"export KEYQUEUE_URL={server.url}")
            click.echo("Press Ctrl-C to stop.", err=True)
            while not stop.is_set() and server.running:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
            if not stop.is_set():
                raise ConnectionFailed(f"nats-server exited unexpectedly; see its log {server.log_file}")
            click.echo("stopping nats-server ...", err=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


if __name__ == "__main__":
    main()
