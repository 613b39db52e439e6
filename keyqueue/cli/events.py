"""``keyqueue events tail QUEUE``: print a queue's lifecycle events as they happen.

Added to the command line by the built-in events plugin (``keyqueue.builtins.events``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from keyqueue.cli import _connection, _run, follow, url_option
from keyqueue.errors import WireError
from keyqueue.wire import CBOR, loads

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["event_line", "events"]

_DETAIL = ("attempt", "wait", "run", "reason", "triggers", "run_id")


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


@click.group()
def events() -> None:
    """Lifecycle events of a queue (stream KQ_<queue>_EVENTS)."""


@events.command()
@click.argument("queue")
@click.option("--event", "-e", "names", multiple=True, metavar="EVENT",
              help="Only these events (enqueued, started, succeeded...); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@click.option("--count", type=click.IntRange(1), help="Exit after this many events.")
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

    def render(msg: Msg) -> str | None:
        try:
            fields = loads(msg.data, (msg.headers or {}).get("X-CONTENT-TYPE", CBOR))
        except WireError as exc:
            click.echo(f"<undecodable event on {msg.subject}: {exc}>", err=True)
            return None
        if not isinstance(fields, dict):
            return None
        return json.dumps(fields, default=str) if as_json else event_line(fields)

    async def run() -> None:
        subjects = [f"kq.{queue}.events.{name}" for name in names] or [f"kq.{queue}.events.>"]
        async with _connection(url) as nc:
            await follow(nc, subjects, render, count=count, timeout=timeout,
                         banner=f"tailing events of {queue} (Ctrl-C to stop)")

    _run(run)
