"""Commands on a queue as a whole: ``inspect`` what it holds, ``unpin`` and ``recreate-consumer``.

The work happens in ``keyqueue.admin`` (and, for recreating the consumer, the topology); these
commands format its results. A queue that does not exist is one line naming it and the queues
the server has.
"""

from __future__ import annotations

import asyncio

import click

from keyqueue.admin.consumers import unpin as unpin_queue
from keyqueue.admin.inspection import KEY_LIMIT, QueueReport, inspect_queue, list_queues
from keyqueue.cli.common import connection, load_app, table, url_option
from keyqueue.errors import ConfigError, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.topology import QueueConfig, Topology

__all__ = ["inspect_command", "recreate_consumer", "unpin"]


async def _no_such_queue(api: JetStreamApi, queue: str) -> ConfigError:
    known = ", ".join(await list_queues(api)) or "none"
    return ConfigError(f"queue {queue!r} does not exist on this server; queues: {known} "
                       "(check the name, and --url or KEYQUEUE_URL)")


async def _report(api: JetStreamApi, queue: str) -> QueueReport:
    try:
        return await inspect_queue(api, queue)
    except StreamNotFound:
        raise await _no_such_queue(api, queue) from None


@click.command("inspect")
@click.argument("queue", required=False)
@url_option
def inspect_command(queue: str | None, url: str | None) -> None:
    """Show what a queue holds: keys with backlog, keys held, pending tokens, DLQ, consumer.

    Without QUEUE, one line per queue on the server.

    \b
    Examples:
      $ keyqueue inspect                 # every queue
      $ keyqueue inspect shop            # keys of queue shop, most backlog first
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            if queue is None:
                queues = await list_queues(api)
                if not queues:
                    click.echo("no queues on this server")
                    return
                rows = []
                for name in queues:
                    r = await _report(api, name)
                    rows.append([name, r.requests, r.keys_with_backlog, r.keys_held, r.pending_tokens, r.dlq_size])
                click.echo(table(["QUEUE", "REQUESTS", "KEYS", "HELD", "PENDING TOKENS", "DLQ"], rows))
                return
            r = await _report(api, queue)
            c = r.consumer
            click.echo(f"queue {r.queue}: {r.requests} request(s) on {r.keys_with_backlog} key(s); "
                       f"{r.keys_held} key(s) held; {r.pending_tokens} pending token(s); DLQ {r.dlq_size}")
            click.echo(f"consumer: ack_pending={c['ack_pending']} redelivered={c['redelivered']} "
                       f"waiting_pulls={c['waiting_pulls']} ack_wait={c['ack_wait_s']:g}s "
                       f"max_ack_pending={c['max_ack_pending']} priority={c['priority_policy']}")
            if c.get("pinned"):
                click.echo(f"pinned: {c['pinned']}")
            if r.keys:
                click.echo()
                click.echo(table(["KEY", "BACKLOG", "TOKEN"], [[k.key, k.backlog, k.token] for k in r.keys]))
                if r.truncated:
                    click.echo(f"(first {KEY_LIMIT} keys)")

    asyncio.run(run())


@click.command()
@click.argument("queue")
@url_option
def unpin(queue: str, url: str | None) -> None:
    """Move the pin of a pinned_client queue: the server drops it and pins a worker afresh.

    \b
    Example:
      $ keyqueue unpin shop
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                groups = await unpin_queue(api, queue)
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None
            click.echo(f"unpinned queue {queue} (group {', '.join(groups)}); the next delivery pins a worker afresh")

    asyncio.run(run())


@click.command("recreate-consumer")
@click.argument("queue")
@click.option("--app", "app_spec", metavar="MODULE:APP", default=None,
              help="Take the queue's configuration (priority policy, ack wait) from this app.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@url_option
def recreate_consumer(queue: str, app_spec: str | None, yes: bool, url: str | None) -> None:
    """Delete and recreate a queue's token consumer, to change its priority policy or lease.

    Stop every worker of the queue first: the new consumer delivers every remaining token again,
    so a worker still holding a key would share it. Requests are kept.

    \b
    Example:
      $ keyqueue recreate-consumer shop --app shop:app --yes
    """
    config = load_app(app_spec, url).queue_config(queue) if app_spec else QueueConfig(queue)
    if not yes:
        click.confirm(f"Recreate the token consumer of queue {queue!r} (policy {config.priority_policy})? "
                      "Every worker of the queue must be stopped", abort=True)

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                await Topology(api, config).recreate_consumer()
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None
        click.echo(f"recreated consumer {config.names.consumer} of queue {queue} "
                   f"(priority policy {config.priority_policy})")

    asyncio.run(run())
