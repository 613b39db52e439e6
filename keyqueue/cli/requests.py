"""``keyqueue result QUEUE REQUEST_ID`` and ``keyqueue cancel QUEUE REQUEST_ID``: a request by its id."""

from __future__ import annotations

import asyncio

import click

from keyqueue.app.cancel import CANCEL_ANSWER_WAIT, request_cancel
from keyqueue.cli.common import connection, require_queue, to_json, url_option
from keyqueue.errors import KeyqueueTimeout, ResultExpired
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.subjects import QueueNames, validate_request_id
from keyqueue.tasks.arguments import decode_result
from keyqueue.wire import headers as H

__all__ = ["cancel", "result"]


@click.command()
@click.argument("queue")
@click.argument("request_id")
@click.option("--timeout", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Seconds to wait for a result that does not exist yet.")
@url_option
def result(queue: str, request_id: str, timeout: float, url: str | None) -> None:
    """Print the kept result of a request (of a task with result_ttl) as JSON.

    A failed request's error is the command's error (exit status 1), as is a result that is not
    there (not finished within --timeout, or its task keeps no results) or has expired.

    \b
    Example:
      $ keyqueue result shop charge-o17-1
      {"order_id": "o17", "charged": 5}
    """
    validate_request_id(request_id)

    async def run() -> None:
        async with connection(url) as nc:
            await require_queue(JetStreamApi(nc), queue)
            records = RequestRecords(nc, queue)
            await records.ensure()
            kept = await records.wait_result(request_id, timeout)
        if kept is None:
            raise KeyqueueTimeout(f"no result for request {request_id} of queue {queue!r}"
                                  + (f" within {timeout}s" if timeout else "")
                                  + ": it has not finished, or its task keeps no results (result_ttl)")
        headers, body = kept
        if not headers.get(H.STATUS):
            raise ResultExpired(f"the result of request {request_id} (queue {queue!r}) was kept, but its "
                                "result_ttl has passed", request_id, queue)
        click.echo(to_json(decode_result(headers, body, request_id)))

    asyncio.run(run())


@click.command()
@click.argument("queue")
@click.argument("request_id")
@click.option("--seq", type=click.IntRange(1), help="The request's inbox sequence (its receipt's seq): "
              "tells 'pending' from 'done' when no worker answers.")
@url_option
def cancel(queue: str, request_id: str, seq: int | None, url: str | None) -> None:
    """Cancel a request that has not started; print what became of it.

    \b
    cancelled  it never ran (a waiting caller gets Cancelled)
    pending    it has not started and never will (its key's holder removes it)
    running    it had started: not interrupted (ctx.cancel_requested is true)
    done       it had finished
    requested  it will not start from now on; whether it already ran is unknown (give --seq)

    \b
    Example:
      $ keyqueue cancel shop 01J9ZQ4R3M5V6W7X8Y9Z0A1B2C --seq 42
      pending
    """
    validate_request_id(request_id)

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            await require_queue(api, queue)
            records = RequestRecords(nc, queue)
            await records.ensure()
            state = await request_cancel(records, api, QueueNames(queue).inbox_stream, request_id, seq,
                                         CANCEL_ANSWER_WAIT)
        click.echo(state)

    asyncio.run(run())
