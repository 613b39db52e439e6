"""``keyqueue release``: hand on the keys of a worker that is gone, now rather than when its leases end.

The work happens in ``keyqueue.admin.release``; this command formats what it released and what
it skipped (a holder that looks alive), and exits with status 1 if it skipped any.
"""

from __future__ import annotations

import asyncio
import dataclasses

import click

from keyqueue.admin.release import HolderAlive, Released, Skipped, describe, release_keys
from keyqueue.cli.common import connection, require_queue, to_json, url_option
from keyqueue.errors import ConfigError
from keyqueue.jetstream.api import JetStreamApi

__all__ = ["release"]


@click.command("release")
@click.argument("queue")
@click.argument("key", required=False)
@click.option("--worker", "worker", metavar="NAME",
              help="Release every key this worker holds (its name as `keyqueue inspect` shows it).")
@click.option("--force", is_flag=True,
              help="Release even though the holder looks alive (its heartbeat is live, or it renewed its "
                   "lease record moments ago). Only when you know it is gone: a live holder would run the "
                   "key beside the next one until its next renewal.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per released key.")
@url_option
def release(queue: str, key: str | None, worker: str | None, force: bool, as_json: bool, url: str | None) -> None:
    """Release KEY, or every key of a --worker, held by a worker that is gone.

    A worker that dies keeps its keys until its leases run out (the queue's ack_wait, 30 s by
    default). When you know it is gone, this hands its keys on at once: it deletes the key's
    lease record, removes the holder's token and, if requests wait, schedules the key for the
    next free worker. It skips a key whose holder process looks alive (that process's heartbeat
    is live, or it renewed the key's lease record within a renewal interval), judged by the
    server's clock, says which and why, and exits with status 1; the other keys are released.
    `--force` overrides that. `keyqueue worker --processes N` does this by itself for a child
    that dies.

    \b
    Examples:
      $ keyqueue release shop order-17
      $ keyqueue release shop --worker host-a:4711
      $ keyqueue release shop --worker host-a:4711 --force
    """
    if (key is None) == (worker is None):
        raise ConfigError("give a KEY or --worker NAME (one of them): `keyqueue release QUEUE KEY` or "
                          "`keyqueue release QUEUE --worker NAME`")

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            await require_queue(api, queue)
            try:
                released = await release_keys(api, queue, key=key, worker=worker, force=force)
            except HolderAlive as alive:
                show(alive.released, alive.skipped)
                raise
        show(released, [])
        if not released and not as_json:
            click.echo(f"nothing to release: worker {worker} holds no key of queue {queue}" if worker
                       else f"nothing to release: nobody holds key {key} of queue {queue}")

    def show(released: list[Released], skipped: list[Skipped]) -> None:
        if as_json:
            for item in released:
                click.echo(to_json(dataclasses.asdict(item)))
            for skip in skipped:
                click.echo(to_json({**dataclasses.asdict(skip), "skipped": True}))
            return
        for item in released:
            click.echo(f"released {describe(item)}")
        for skip in skipped:
            click.echo(f"skipped {skip.key}: {skip.why}", err=True)

    asyncio.run(run())
