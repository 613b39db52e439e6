"""``keyqueue watch QUEUE KEY``: follow a key's live progress (what tasks publish with ``ctx.progress``)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from keyqueue.cli.common import connection, follow, to_json, url_option
from keyqueue.errors import WireError
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["watch"]


def _progress_line(msg: Msg) -> str:
    headers = msg.headers or {}
    try:
        value: Any = loads(msg.data, headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
    except WireError as exc:
        value = f"<undecodable: {exc}>"
    stamp = datetime.now(UTC).strftime("%H:%M:%S.%f")[:-3]
    key = msg.subject.split(".", 3)[-1]
    return f"{stamp} {key} {headers.get(H.REQUEST_ID, '-')} {to_json(value)}"


@click.command()
@click.argument("queue")
@click.argument("key")
@click.option("--count", type=click.IntRange(1), help="Exit after this many progress messages.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), help="Exit after this many seconds.")
@url_option
def watch(queue: str, key: str, count: int | None, timeout: float | None, url: str | None) -> None:
    """Follow a key's live progress (what tasks publish with ctx.progress(...)).

    KEY may end in NATS wildcards ('*' one token, '>' the rest) to follow many keys. Runs until
    Ctrl-C, --count messages or --timeout seconds.

    \b
    Example:
      $ keyqueue watch shop o1
      12:00:01.250 o1 01J... {"step": "authorising"}
    """

    async def run() -> None:
        async with connection(url) as nc:
            await follow(nc, [QueueNames(queue).progress(key)], _progress_line, count=count, timeout=timeout,
                         banner=f"watching {queue} {key} (Ctrl-C to stop)")

    asyncio.run(run())
