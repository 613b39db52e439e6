"""``keyqueue dlq list|show|replay|delete|purge``: a queue's dead-lettered requests.

The work happens in ``keyqueue.admin.dead_letters``; these commands format its results: a table
or a readable view for people, ``--json`` (stable keys, numbers as numbers) for scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import click

from keyqueue.admin.dead_letters import (
    DeadLetter,
    count_dead_letters,
    dead_letters,
    delete_dead_letters,
    get_dead_letter,
    purge_dead_letters,
    replay,
    replay_id,
)
from keyqueue.cli.common import connection, no_such_queue, table, to_json, url_option
from keyqueue.errors import ConfigError, MessageNotFound, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["dlq", "letter_fields"]


@click.group()
def dlq() -> None:
    """List, show, replay and remove a queue's dead-lettered requests.

    \b
    Examples:
      $ keyqueue dlq list shop --key o1
      $ keyqueue dlq show shop 3
      $ keyqueue dlq replay shop --key o1
      $ keyqueue dlq purge shop --key o1
    """


@contextlib.asynccontextmanager
async def _dlq_api(url: str | None, queue: str) -> AsyncIterator[JetStreamApi]:
    """A JetStream API for the commands on ``queue``'s DLQ; a missing queue or entry is one line."""
    async with connection(url) as nc:
        api = JetStreamApi(nc)
        try:
            yield api
        except StreamNotFound:
            raise await no_such_queue(api, queue) from None
        except MessageNotFound as exc:
            raise ConfigError(exc.description) from None


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def letter_fields(letter: DeadLetter) -> dict[str, Any]:
    """A dead request as ``--json`` prints it in a list: the same keys always, numbers as numbers."""
    return {
        "seq": letter.seq,
        "key": letter.key,
        "request_id": letter.request_id,
        "task": letter.message_type,
        "version": _number(letter.version),
        "reason": letter.reason,
        "error_type": letter.error_type,
        "error_message": letter.error_message,
        "attempts": letter.attempts,
        "original_seq": letter.original_seq,
        "dead_lettered_at": letter.time or None,
        "truncated_from": letter.truncated_from,
    }


# --- list ----------------------------------------------------------------------------------------


@dlq.command("list")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True, help="Show at most this many.")
@click.option("--json", "as_json", is_flag=True,
              help='One JSON object: {"queue", "key", "total", "dead_letters": [...]}.')
@url_option
def dlq_list(queue: str, key: str | None, limit: int, as_json: bool, url: str | None) -> None:
    """List dead requests, oldest first.

    \b
    Example:
      $ keyqueue dlq list shop
      SEQ  KEY  TASK    REASON        ATTEMPTS  ERROR
      1    o3   charge  max-attempts  5         ValueError: negative amount
    """

    async def run() -> None:
        async with _dlq_api(url, queue) as api:
            letters = await dead_letters(api, queue, key=key, limit=limit)
            total = await count_dead_letters(api, queue, key=key) if len(letters) == limit else len(letters)
        # The count is read after the list: entries dead-lettered meanwhile may make it larger.
        total = max(total, len(letters))
        if as_json:
            click.echo(to_json({"queue": queue, "key": key, "total": total,
                                "dead_letters": [letter_fields(d) for d in letters]}))
            return
        if not letters:
            click.echo(f"no dead requests in queue {queue}" + (f" for key {key}" if key else ""))
            return
        rows = [[d.seq, d.key, d.message_type, d.reason, "-" if d.attempts is None else d.attempts,
                 f"{d.error_type}: {d.error_message}"] for d in letters]
        click.echo(table(["SEQ", "KEY", "TASK", "REASON", "ATTEMPTS", "ERROR"], rows))
        if total > len(letters):
            click.echo(f"... and {total - len(letters)} more; --limit to see them")

    asyncio.run(run())


# --- show ----------------------------------------------------------------------------------------


def _readable(letter: DeadLetter) -> str:
    """One dead request for people: a field a line, then the arguments and the traceback, indented."""
    version = f" (version {letter.version})" if letter.version else ""
    fields: list[tuple[str, object]] = [
        ("seq", letter.seq),
        ("key", letter.key),
        ("task", f"{letter.message_type or '?'}{version}"),
        ("request id", letter.request_id or "-"),
        ("reason", letter.reason or "-"),
        ("attempts", "-" if letter.attempts is None else letter.attempts),
        ("error", f"{letter.error_type or '?'}: {letter.error_message}"),
        ("dead-lettered", letter.time or "-"),
        ("inbox seq", "-" if letter.original_seq is None else letter.original_seq),
    ]
    if letter.truncated_from is not None:
        fields.append(("incomplete", f"the body was cut to fit the server's max_payload (original "
                                     f"{letter.truncated_from} bytes); replay leaves it in the DLQ"))
    width = max(len(name) for name, _ in fields) + 2
    lines = [f"{name + ':':<{width}}{value}" for name, value in fields]
    lines += ["arguments:", textwrap.indent(to_json(letter.body(), indent=2), "  ")]
    if letter.traceback is not None:
        lines += ["traceback:", textwrap.indent(letter.traceback.rstrip("\n"), "  ")]
    return "\n".join(lines)


@dlq.command("show")
@click.argument("queue")
@click.argument("seq", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True,
              help="The raw entry as one JSON object: every field, its decoded arguments and headers.")
@url_option
def dlq_show(queue: str, seq: int, as_json: bool, url: str | None) -> None:
    """Show one dead request (by its DLQ sequence): why it died, its arguments, its traceback.

    \b
    Example:
      $ keyqueue dlq show shop 1
      seq:            1
      key:            o3
      task:           charge (version 1)
      ...
      error:          ValueError: negative amount
      arguments:
        {
          "order_id": "o3",
          "amount": -1
        }
    """

    async def run() -> None:
        async with _dlq_api(url, queue) as api:
            letter = await get_dead_letter(api, queue, seq)
        if as_json:
            click.echo(to_json({**letter_fields(letter), "arguments": letter.body(), "traceback": letter.traceback,
                                "headers": dict(letter.headers)}))
        else:
            click.echo(_readable(letter))

    asyncio.run(run())


# --- replay --------------------------------------------------------------------------------------


@dlq.command("replay")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@click.option("--seq", "seqs", type=click.IntRange(1), multiple=True, metavar="SEQ",
              help="Only the dead request at this DLQ sequence; repeatable (still replayed oldest first).")
@click.option("--dry-run", is_flag=True, help="Print what would be replayed; change nothing.")
@url_option
def dlq_replay(queue: str, key: str | None, seqs: tuple[int, ...], dry_run: bool, url: str | None) -> None:
    """Enqueue dead requests again, in their original order, and remove them from the DLQ.

    Each gets a new request id (<id>.replay-<seq>; a replayed id's old suffix is replaced) and
    joins the back of its key's backlog. Only the requests in the DLQ when the replay begins are
    replayed; an incomplete copy (its body cut to fit the server's max_payload) stays in the DLQ.

    \b
    Examples:
      $ keyqueue dlq replay shop --key o3
      replayed 2 request(s)
      $ keyqueue dlq replay shop --seq 4 --seq 7 --dry-run
    """

    async def run() -> None:
        async with _dlq_api(url, queue) as api:
            selected = seqs or None
            if dry_run:
                await _dry_run(api, queue, key, selected)
                return
            length = len(set(seqs)) if seqs else await count_dead_letters(api, queue, key=key)
            skipped: list[DeadLetter] = []

            def skip(letter: DeadLetter) -> None:
                skipped.append(letter)
                bar.update(1)

            with click.progressbar(length=length, label=f"replaying {queue}", file=sys.stderr) as bar:
                count = await replay(api, Publisher(api.nc, QueueNames(queue)), queue, key=key, seqs=selected,
                                     on_replayed=lambda _: bar.update(1), on_skipped=skip)
        click.echo(f"replayed {count} request(s)")
        if skipped:
            click.echo(f"left {len(skipped)} incomplete dead request(s) in the DLQ (sequences "
                       f"{', '.join(str(d.seq) for d in skipped)}): their copies are truncated")

    asyncio.run(run())


async def _dry_run(api: JetStreamApi, queue: str, key: str | None, seqs: tuple[int, ...] | None) -> None:
    rows: list[list[object]] = []

    def would_replay(letter: DeadLetter) -> None:
        rows.append([letter.seq, letter.key, letter.message_type, replay_id(letter.request_id, letter.seq)])

    def would_skip(letter: DeadLetter) -> None:
        rows.append([letter.seq, letter.key, letter.message_type, "(stays: incomplete copy)"])

    # The Publisher is never used: a dry run stores nothing.
    count = await replay(api, Publisher(api.nc, QueueNames(queue)), queue, key=key, seqs=seqs, dry_run=True,
                         on_replayed=would_replay, on_skipped=would_skip)
    if rows:
        click.echo(table(["SEQ", "KEY", "TASK", "REPLAYED AS"], rows))
    click.echo(f"would replay {count} request(s); nothing was changed (--dry-run)")


# --- delete and purge ----------------------------------------------------------------------------


@dlq.command("delete")
@click.argument("queue")
@click.argument("seqs", type=click.IntRange(1), nargs=-1, required=True, metavar="SEQ...")
@url_option
def dlq_delete(queue: str, seqs: tuple[int, ...], url: str | None) -> None:
    """Remove dead requests by their DLQ sequence, without replaying them.

    If one of them is not in the DLQ, none is removed.

    \b
    Example:
      $ keyqueue dlq delete shop 3 4
      deleted 2 dead request(s) from queue shop
    """

    async def run() -> None:
        async with _dlq_api(url, queue) as api:
            await delete_dead_letters(api, queue, seqs)
        click.echo(f"deleted {len(set(seqs))} dead request(s) from queue {queue}")

    asyncio.run(run())


@dlq.command("purge")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@url_option
def dlq_purge(queue: str, key: str | None, yes: bool, url: str | None) -> None:
    """Remove every dead request of a queue (or of one key), without replaying them.

    \b
    Example:
      $ keyqueue dlq purge shop --key o3 --yes
      removed 2 dead request(s) from queue shop (key o3)
    """
    whose = f" (key {key})" if key is not None else ""

    async def count() -> int:
        async with _dlq_api(url, queue) as api:
            return await count_dead_letters(api, queue, key=key)

    async def purge() -> int:
        async with _dlq_api(url, queue) as api:
            return await purge_dead_letters(api, queue, key=key)

    found = asyncio.run(count())
    if not found:
        click.echo(f"no dead requests in queue {queue}{whose}")
        return
    if not yes:
        click.confirm(f"Remove {found} dead request(s) from queue {queue}{whose}? They cannot be replayed "
                      "afterwards", abort=True)
    click.echo(f"removed {asyncio.run(purge())} dead request(s) from queue {queue}{whose}")
