"""``keyqueue dlq list|show|replay``: a queue's dead-lettered requests (``keyqueue.admin.dead_letters``)."""

from __future__ import annotations

import asyncio
import sys

import click

from keyqueue.admin.dead_letters import DeadLetter, dead_letters, get_dead_letter, replay
from keyqueue.cli.common import connection, table, to_json, url_option
from keyqueue.errors import ConfigError, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["dlq"]


@click.group()
def dlq() -> None:
    """List, show and replay a queue's dead-lettered requests.

    \b
    Examples:
      $ keyqueue dlq list shop --key o1
      $ keyqueue dlq show shop 3
      $ keyqueue dlq replay shop --key o1
    """


@dlq.command("list")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
@url_option
def dlq_list(queue: str, key: str | None, limit: int, url: str | None) -> None:
    """List dead requests, oldest first.

    \b
    Example:
      $ keyqueue dlq list shop
      SEQ  KEY  TASK    REASON        ATTEMPTS  ERROR
      1    o3   charge  max-attempts  5         ValueError: negative amount
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                letters = await dead_letters(api, queue, key=key, limit=limit)
            except StreamNotFound:
                raise ConfigError(f"queue {queue!r} has no dead-letter stream on this server") from None
            if not letters:
                click.echo(f"no dead requests in queue {queue}" + (f" for key {key}" if key else ""))
                return
            rows = [[d.seq, d.key, d.message_type, d.reason, d.attempts, f"{d.error_type}: {d.error_message}"]
                    for d in letters]
            click.echo(table(["SEQ", "KEY", "TASK", "REASON", "ATTEMPTS", "ERROR"], rows))

    asyncio.run(run())


def _show(letter: DeadLetter) -> str:
    fields = {
        "seq": letter.seq, "key": letter.key, "request_id": letter.request_id, "task": letter.message_type,
        "version": letter.version, "reason": letter.reason, "error": f"{letter.error_type}: {letter.error_message}",
        "attempts": letter.attempts, "original_seq": letter.original_seq, "dead_lettered_at": letter.time,
        "arguments": letter.body(),
    }
    if letter.truncated_from is not None:
        fields["truncated_from"] = letter.truncated_from
    return to_json(fields)


@dlq.command("show")
@click.argument("queue")
@click.argument("seq", type=click.IntRange(1))
@url_option
def dlq_show(queue: str, seq: int, url: str | None) -> None:
    """Show one dead request (by its DLQ sequence) as JSON, with its decoded arguments.

    \b
    Example:
      $ keyqueue dlq show shop 1
    """

    async def run() -> None:
        async with connection(url) as nc:
            click.echo(_show(await get_dead_letter(JetStreamApi(nc), queue, seq)))

    asyncio.run(run())


@dlq.command("replay")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@url_option
def dlq_replay(queue: str, key: str | None, url: str | None) -> None:
    """Enqueue dead requests again, in their original order, and remove them from the DLQ.

    Each gets a new request id (<id>.replay-<seq>) and joins the back of its key's backlog. Only
    the requests in the DLQ when the replay begins are replayed; an incomplete copy (its body cut
    to fit the server's max_payload) stays in the DLQ.

    \b
    Example:
      $ keyqueue dlq replay shop --key o3
      replayed 2 request(s)
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            names = QueueNames(queue)
            try:
                letters = await dead_letters(api, queue, key=key)
            except StreamNotFound:
                raise ConfigError(f"queue {queue!r} has no dead-letter stream on this server") from None
            skipped: list[DeadLetter] = []

            def skip(letter: DeadLetter) -> None:
                skipped.append(letter)
                bar.update(1)

            with click.progressbar(length=len(letters), label=f"replaying {queue}", file=sys.stderr) as bar:
                count = await replay(api, Publisher(nc, names), queue, key=key, on_replayed=lambda _: bar.update(1),
                                     on_skipped=skip)
            click.echo(f"replayed {count} request(s)")
            if skipped:
                click.echo(f"left {len(skipped)} incomplete dead request(s) in the DLQ (sequences "
                           f"{', '.join(str(d.seq) for d in skipped)}): their copies are truncated")

    asyncio.run(run())
