"""``keyqueue enqueue MODULE:APP TASK``: enqueue a task by name, one request or a file of them."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import IO, Any, Final

import click

from keyqueue.cli.common import load_app, to_json, url_option
from keyqueue.errors import ConfigError, InvalidSchedule, MalformedBody
from keyqueue.tasks.task import BatchTask, Receipt

__all__ = ["BULK_CHUNK", "enqueue"]

BULK_CHUNK: Final = 500
"""Requests ``keyqueue enqueue --from-file`` publishes per pipelined batch."""


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"invalid JSON in {where}: {exc}") from None


def _receipt_line(receipt: Receipt) -> str:
    due = {"due": receipt.due.isoformat()} if receipt.due is not None else {}
    return to_json({"request_id": receipt.request_id, "key": receipt.key, "seq": receipt.seq,
                    "duplicate": receipt.duplicate, **due})


def _eta(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise InvalidSchedule(f"--eta {text!r} is not an ISO 8601 time such as 2030-01-01T09:00:00+01:00") from None


def _read_lines(handle: IO[str]) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.argument("task_name", metavar="TASK")
@click.argument("arguments", metavar="[JSON]", required=False)
@click.option("--from-file", "from_file", type=click.File("r"), metavar="PATH",
              help="Enqueue one request per line of JSON ('-' reads stdin).")
@click.option("--wait", is_flag=True, help="Wait for the result and print it as JSON.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              help="Seconds --wait waits.")
@click.option("--request-id", metavar="ID", help="The request id (an idempotency key within the duplicate window).")
@click.option("--countdown", type=float, metavar="SECONDS", help="Delay the request(s): start no sooner than this.")
@click.option("--eta", metavar="TIME", help="Delay the request(s) until an ISO 8601 time with a zone (…+01:00, …Z).")
@url_option
def enqueue(app_spec: str, task_name: str, arguments: str | None, from_file: IO[str] | None, wait: bool,
            timeout: float, request_id: str | None, countdown: float | None, eta: str | None, url: str | None) -> None:
    """Enqueue a task of an app by name, with JSON arguments.

    JSON is an object of keyword arguments (for a batch task: the item). Prints the receipt
    (request id, key, inbox sequence) as JSON, or with --wait the result. --from-file takes JSON
    lines, one request each, with a progress bar; every line is checked before any is stored.

    \b
    Examples (MODULE:APP: `app` in shop.py in the current directory):
      $ keyqueue enqueue shop:app charge '{"order_id": "o1", "amount": 5}'
      {"request_id": "01J...", "key": "o1", "seq": 1, "duplicate": false}
      $ keyqueue enqueue shop:app charge '{"order_id": "o1", "amount": 5}' --wait
      $ keyqueue enqueue shop:app charge --from-file orders.jsonl
      $ keyqueue enqueue shop:app charge '{"order_id": "o1", "amount": 5}' --countdown 60
    """
    if (arguments is None) == (from_file is None):
        raise click.UsageError("give the arguments as JSON or --from-file, not both or neither")
    due_at = _eta(eta)
    app = load_app(app_spec, url)
    task = app.find_task(task_name)
    batch = isinstance(task, BatchTask)

    def check(value: Any, where: str) -> Any:
        if not batch and not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object of keyword arguments for {task_name}, "
                              f"not {type(value).__name__}")
        return value

    async def one(value: Any) -> None:
        bound = task.options(request_id=request_id, timeout=timeout, countdown=countdown, eta=due_at)
        args: tuple[Any, ...] = (value,) if batch else ()
        kwargs: dict[str, Any] = {} if batch else value
        try:
            if wait:
                click.echo(to_json(await bound.call(*args, **kwargs)))
            else:
                click.echo(_receipt_line(await bound.enqueue(*args, **kwargs)))
        finally:
            await app.close()

    def checked_line(number: int, line: str) -> Any:
        where = f"line {number}"
        value = check(_parse_json(line, where), where)
        try:
            task.fields_from_mapping(value)  # so a bad line is refused before any line is stored
        except (TypeError, MalformedBody, ConfigError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return value

    async def many(handle: IO[str]) -> None:
        items = [checked_line(number, line) for number, line in _read_lines(handle)]
        stored = duplicates = 0
        try:
            with click.progressbar(length=len(items), label=f"enqueueing {task_name}", file=sys.stderr) as bar:
                for start in range(0, len(items), BULK_CHUNK):
                    chunk = items[start:start + BULK_CHUNK]
                    receipts = await (task.options(countdown=countdown, eta=due_at).enqueue_many(chunk)
                                      if countdown is not None or due_at is not None else task.enqueue_many(chunk))
                    stored += len(receipts)
                    duplicates += sum(r.duplicate for r in receipts)
                    bar.update(len(chunk))
        finally:
            await app.close()
        click.echo(f"enqueued {stored} {task_name} request(s)" + (f", {duplicates} duplicate(s)" if duplicates else ""))

    try:
        if from_file is not None:
            asyncio.run(many(from_file))
        else:
            assert arguments is not None
            asyncio.run(one(check(_parse_json(arguments, "the arguments"), "the arguments")))
    except TypeError as exc:  # arguments that do not fit the task's signature
        raise ConfigError(str(exc)) from None
