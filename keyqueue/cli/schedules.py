"""``keyqueue schedules QUEUE`` and ``keyqueue schedules remove QUEUE NAME``: a queue's periodic schedules."""

from __future__ import annotations

import asyncio
from typing import Any

import click

from keyqueue.admin.schedules import ScheduleRow, list_schedules, remove_schedule
from keyqueue.cli.common import connection, no_such_queue, table, to_json, url_option
from keyqueue.errors import ConfigError, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["schedules"]


class _ListByDefault(click.Group):
    """``keyqueue schedules QUEUE`` means ``keyqueue schedules list QUEUE``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_ListByDefault)
def schedules() -> None:
    """A queue's periodic schedules (declared with App.periodic), as the server keeps them.

    \b
    Examples:
      $ keyqueue schedules shop                 # NAME TASK KEY SCHEDULE TIMEZONE NEXT RUN (UTC)
      $ keyqueue schedules shop --json
      $ keyqueue schedules remove shop nightly
    """


@schedules.command("list")
@click.argument("queue")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (stable keys).")
@url_option
def list_command(queue: str, as_json: bool, url: str | None) -> None:
    """List QUEUE's periodic schedules with their next run, and how many delayed requests wait."""

    async def run() -> None:
        async with connection(url) as nc:
            try:
                rows, delayed = await list_schedules(nc, queue)
            except StreamNotFound:
                raise await _no_schedules(JetStreamApi(nc), queue) from None
        if as_json:
            click.echo(to_json({"queue": queue, "delayed": delayed, "schedules": [_fields(r) for r in rows]}))
            return
        if rows:
            click.echo(table(["NAME", "TASK", "KEY", "SCHEDULE", "TIMEZONE", "NEXT RUN (UTC)"],
                             [[r.name, r.task, r.key, r.schedule, r.timezone,
                               r.next_run.strftime("%Y-%m-%d %H:%M:%S") if r.next_run else "?"] for r in rows]))
        else:
            click.echo(f"queue {queue} has no periodic schedules")
        click.echo(f"{delayed} delayed request(s) wait for their due time")

    asyncio.run(run())


@schedules.command("remove")
@click.argument("queue")
@click.argument("name")
@url_option
def remove_command(queue: str, name: str, url: str | None) -> None:
    """Remove QUEUE's periodic schedule NAME (a worker whose app still declares it stores it again)."""

    async def run() -> None:
        async with connection(url) as nc:
            if not await remove_schedule(nc, queue, name):
                raise ConfigError(f"queue {queue} has no periodic schedule {name!r}; `keyqueue schedules {queue}` "
                                  "lists them")
        click.echo(f"removed periodic schedule {name} of queue {queue}")

    asyncio.run(run())


async def _no_schedules(api: JetStreamApi, queue: str) -> ConfigError:
    try:
        await api.stream_info(QueueNames(queue).inbox_stream)
    except StreamNotFound:
        return await no_such_queue(api, queue)
    return ConfigError(f"queue {queue} has no schedules: no worker or producer has used delays or periodic "
                       "schedules on it yet")


def _fields(row: ScheduleRow) -> dict[str, Any]:
    return {"name": row.name, "task": row.task, "key": row.key, "schedule": row.schedule, "timezone": row.timezone,
            "next_run": row.next_run.isoformat() if row.next_run else None, "kwargs": row.kwargs}
