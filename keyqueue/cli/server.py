"""``keyqueue dev-server``: a local nats-server with JetStream in the foreground, for development."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import click

from keyqueue.errors import ConfigError, ConnectionFailed
from keyqueue.server.embedded import EmbeddedServer, check_sync_interval

__all__ = ["dev_server"]


@click.command("dev-server")
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
    help="Keep JetStream data (stored requests, results, dead letters) in this directory across runs "
         "(default: a temporary one, deleted on exit with everything stored in it).",
)
@click.option(
    "--sync",
    "sync_interval",
    metavar="always|DURATION",
    help="How often JetStream fsyncs (nats-server's sync_interval): 'always' writes every message to disk "
         "before acknowledging it, so an acknowledged write survives a power loss; a duration such as 10s; "
         "default: the server's (every 2 minutes). See docs/decisions.md, \"Durability\".",
)
def dev_server(port: int, store_dir: Path | None, sync_interval: str | None) -> None:
    """Run a local nats-server with JetStream in the foreground, for development.

    It listens on 127.0.0.1 only and stops cleanly on Ctrl-C or SIGTERM.

    \b
    Example:
      $ keyqueue dev-server --store-dir .keyqueue-data
      nats-server with JetStream on nats://127.0.0.1:4222
      export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ # in another terminal: paste the export line, then run workers and enqueue tasks
    """
    try:
        check_sync_interval(sync_interval)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--sync") from None
    server = EmbeddedServer(port=port, store_dir=store_dir, sync_interval=sync_interval)
    asyncio.run(_serve(server, persistent=store_dir is not None))


async def _serve(server: EmbeddedServer, *, persistent: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with server:
            kept = ("kept" if persistent else
                    "temporary: deleted on exit, with every request stored in it; --store-dir DIR keeps them")
            click.echo(f"nats-server with JetStream on {server.url}")
            click.echo(f"store: {server.store_dir} ({kept}); log: {server.log_file}")
            sync = server.sync_interval or "the server's default, every 2 minutes"
            click.echo(f"fsync: {sync}; monitoring: {server.monitoring_url}")
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
