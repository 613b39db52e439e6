"""``keyqueue events tail QUEUE``: print a queue's lifecycle events as they happen.

Added to the command line by the built-in events plugin (``keyqueue.builtins.events``); the
subjects and fields it reads are the contract in ``keyqueue.events``. The event names it takes
are the contract's (``event_names()``: keyqueue's own and those the loaded plugins registered)
and any others the queue's events stream already holds (a plugin installed elsewhere).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from keyqueue.cli.common import connection, follow, require_queue, url_option
from keyqueue.errors import ConfigError, StreamNotFound
from keyqueue.events import (
    BATCH,
    EVENT_FIELD_NAMES,
    decode_events,
    event_batch_subject,
    event_names,
    events_stream,
    events_subject,
)
from keyqueue.jetstream.api import JetStreamApi

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["event_line", "events"]

_LEADING = ("event", "ts", "queue", "key", "request_id", "task", "worker")
_DETAIL = tuple(name for name in EVENT_FIELD_NAMES if name not in _LEADING)
"""The fields an event line shows as ``name=value`` after its leading columns (queue is not shown)."""


def event_line(fields: dict[str, Any]) -> str:
    """One event as a line: ``time event key request task worker detail...``."""
    ts = fields.get("ts")
    stamp = datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S.%f")[:-3] if isinstance(ts, int | float) else "-"
    parts = [stamp, str(fields.get("event", "?")), str(fields.get("key") or "-"),
             str(fields.get("request_id") or "-"), str(fields.get("task") or "-"), str(fields.get("worker") or "-")]
    for name in _DETAIL:
        value = fields.get(name)
        if value is not None:
            parts.append(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}")
    return " ".join(parts)


async def _known_event_names(api: JetStreamApi, queue: str, wanted: tuple[str, ...]) -> list[str]:
    """The event names ``tail --event`` accepts for ``queue``: the contract's, then those only its
    stream holds (queue-wide ones are listed; an event of keys is found when it is asked for)."""
    names = dict.fromkeys(event_names())
    prefix = events_subject(queue, "")
    stream = events_stream(queue)
    try:
        stored = await api.subjects(stream, events_subject(queue, "*"))
        names.update(dict.fromkeys(sorted(subject.removeprefix(prefix) for subject in stored
                                          if subject.removeprefix(prefix) != BATCH)))
        for name in wanted:
            if name not in names and await api.get_msg(stream, seq=1, next_by_subject=events_subject(queue, name, ">"),
                                                       direct=False) is not None:
                names[name] = None
    except StreamNotFound:
        pass
    return list(names)


@click.group()
def events() -> None:
    """Lifecycle events of a queue (stream KQ_<queue>_EVENTS)."""


@events.command()
@click.argument("queue")
@click.option("--event", "-e", "names", multiple=True, metavar="EVENT",
              help="Only these events (enqueued, started, succeeded...); repeatable. An unknown name is "
                   "refused with the list of known ones.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@click.option("--count", type=click.IntRange(1), help="Exit after printing this many events.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), help="Exit after this many seconds.")
@url_option
def tail(queue: str, names: tuple[str, ...], as_json: bool, count: int | None, timeout: float | None,
         url: str | None) -> None:
    """Print QUEUE's lifecycle events live, one line each, until Ctrl-C.

    \b
    Example:
      $ keyqueue events tail shop
      12:00:01.250 started o1 01J... charge host:123 attempt=1 wait=0.004
    """

    def render(msg: Msg) -> list[str] | None:
        found = decode_events(msg.headers, msg.data)
        if not found:
            click.echo(f"<undecodable event on {msg.subject}>", err=True)
            return None
        # A batch of a key's events arrives on its own subject: keep the names asked for.
        lines = [json.dumps(fields, default=str) if as_json else event_line(fields)
                 for fields in found if not names or fields["event"] in names]
        return lines or None

    async def run() -> None:
        subjects = ([s for name in names for s in (events_subject(queue, name), events_subject(queue, name, ">"))]
                    + [event_batch_subject(queue, ">"), event_batch_subject(queue, None)]
                    if names else [events_subject(queue, ">")])
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            await require_queue(api, queue)
            if names:
                known = await _known_event_names(api, queue, names)
                if unknown := [name for name in names if name not in known]:
                    raise ConfigError(f"unknown event {', '.join(map(repr, unknown))}; the events of queue {queue} "
                                      f"are: {', '.join(known)}")
            await follow(nc, subjects, render, count=count, timeout=timeout,
                         banner=f"tailing events of {queue} (Ctrl-C to stop)")

    asyncio.run(run())
