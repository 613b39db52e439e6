"""``keyqueue result``, ``keyqueue status`` and ``keyqueue cancel``: a request by its id."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import click

from keyqueue.app.cancel import CANCEL_ANSWER_WAIT, request_cancel
from keyqueue.app.progress import read_progress
from keyqueue.app.status import request_status
from keyqueue.cli.common import connection, require_queue, to_json, url_option
from keyqueue.cli.key_inspection import progress_fields, progress_text
from keyqueue.cli.workflows import cancel_workflow_by_id, result_of_workflow, status_of_workflow
from keyqueue.errors import KeyqueueTimeout, RequestNotFound, ResultExpired
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.subjects import validate_request_id, validate_request_key
from keyqueue.jetstream.workflows import existing_store
from keyqueue.tasks.arguments import decode_result
from keyqueue.tasks.canvas import is_workflow_id
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["cancel", "result", "status"]


@click.command()
@click.argument("queue")
@click.argument("request_id")
@click.option("--timeout", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Seconds to wait for a result that does not exist yet.")
@url_option
def result(queue: str, request_id: str, timeout: float, url: str | None) -> None:
    """Print the kept result of a request (of a task with result_ttl), or of a workflow, as JSON.

    A failed request's error is the command's error (exit status 1), as is a result that is not
    there (not finished within --timeout, or its task keeps no results) or has expired.

    \b
    Example:
      $ keyqueue result shop charge-o17-1
      {"order_id": "o17", "charged": 5}
    """
    validate_request_id(request_id)
    if is_workflow_id(request_id) and _is_workflow(url, queue, request_id):

        async def of_workflow() -> Any:
            async with connection(url) as nc:
                return await result_of_workflow(nc, queue, request_id, timeout)

        click.echo(to_json(asyncio.run(of_workflow())))
        return

    async def run() -> None:
        async with connection(url) as nc:
            _, records = await _queue_records(nc, queue)
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


_SEQ_HELP = "The request's inbox sequence (its receipt's seq): finds a pending request of a task that keeps no results."
_KEY_HELP = ("The request's key: its backlog is searched for the id (a pending request of a task that keeps no "
             "results); '~' for an unkeyed request (the queue's unkeyed requests are searched).")


@click.command()
@click.argument("queue")
@click.argument("request_id")
@click.option("--seq", type=click.IntRange(1), help=_SEQ_HELP)
@click.option("--key", default=None, help=_KEY_HELP)
@click.option("--progress", "with_progress", is_flag=True,
              help="Also print the last progress its task reported (ctx.progress), as kept, on a second line.")
@click.option("--json", "as_json", is_flag=True, help='One JSON object: {"status": ..., "progress": ... or null}.')
@url_option
def status(queue: str, request_id: str, seq: int | None, key: str | None, with_progress: bool, as_json: bool,
           url: str | None) -> None:
    """Print where a request (or a workflow: REQUEST_ID is its wf-... id) is (with --progress, also how far it got).

    \b
    unknown    no trace of it (a pending request of a task without result_ttl needs --seq or --key)
    pending    stored, not started
    scheduled  delayed: waiting for its due time
    running    a live worker runs it now
    done       finished
    failed     dead-lettered
    cancelled  cancelled before it started: it never runs
    expired    its kept result's result_ttl has passed, or it expired (expires=) before it started

    \b
    Examples:
      $ keyqueue status shop charge-o17-1
      running
      $ keyqueue status shop import-7 --progress
      running
      progress: {"done": 420, "of": 1000} (attempt 1, 2026-11-27T10:04:31Z)
    """
    validate_request_id(request_id)
    if key is not None:
        validate_request_key(key)

    async def run() -> None:
        async with connection(url) as nc:
            if is_workflow_id(request_id) and await _kept_workflow(nc, queue, request_id):
                found = await status_of_workflow(nc, queue, request_id)  # a workflow: its steps' progress is theirs
                click.echo(to_json({"status": found, "progress": None}) if as_json else found)
                return
            api, records = await _queue_records(nc, queue)
            state, kept = await asyncio.gather(
                request_status(records, api, request_id, seq=seq, key=key),
                read_progress(records, request_id) if with_progress or as_json else _none())
        if as_json:
            click.echo(to_json({"status": state, "progress": None if kept is None else progress_fields(kept)}))
            return
        click.echo(state)
        if with_progress:
            click.echo(f"progress: {progress_text(kept)}")

    asyncio.run(run())


async def _none() -> None:
    return None


@click.command()
@click.argument("queue")
@click.argument("request_id")
@click.option("--seq", type=click.IntRange(1), help=_SEQ_HELP)
@click.option("--key", default=None, help=_KEY_HELP)
@url_option
def cancel(queue: str, request_id: str, seq: int | None, key: str | None, url: str | None) -> None:
    """Cancel a request that has not started, or every step of a workflow that has not; print what became of it.

    \b
    cancelled  it never ran (a waiting caller gets Cancelled)
    pending    it has not started and never will (its key's holder removes it)
    running    it had started: not interrupted (ctx.cancel_requested is true)
    done       it had finished
    unknown    no such request was found: nothing was cancelled (exit status 1) and the id stays
               usable; a pending request of a task without result_ttl is found with --seq or --key

    \b
    Example:
      $ keyqueue cancel shop 01J9ZQ4R3M5V6W7X8Y9Z0A1B2C --seq 42
      pending
    """
    validate_request_id(request_id)
    if key is not None:
        validate_request_key(key)

    async def run() -> str:
        async with connection(url) as nc:
            if is_workflow_id(request_id) and await _kept_workflow(nc, queue, request_id):
                return await cancel_workflow_by_id(nc, queue, request_id)
            api, records = await _queue_records(nc, queue)
            return await request_cancel(records, api, request_id, seq, CANCEL_ANSWER_WAIT, key=key)

    state = asyncio.run(run())
    click.echo(state)
    if state == "unknown":
        raise RequestNotFound(f"no request {request_id} found in queue {queue!r}: nothing was cancelled. A pending "
                              "request of a task that keeps no results is found only with --seq (its receipt's "
                              "seq) or --key")


def _is_workflow(url: str | None, queue: str, workflow_id: str) -> bool:
    async def run() -> bool:
        async with connection(url) as nc:
            return await _kept_workflow(nc, queue, workflow_id)

    return asyncio.run(run())


async def _kept_workflow(nc: Client, queue: str, workflow_id: str) -> bool:
    """Whether ``queue`` keeps a workflow of this id (a request id that looks like one may be a step's)."""
    store = await existing_store(nc, queue)
    return store is not None and await store.last(store.subject(workflow_id, "plan")) is not None


async def _queue_records(nc: Client, queue: str) -> tuple[JetStreamApi, RequestRecords]:
    """The queue's API and request records, once the queue is known to exist (else ``QueueNotFound``)."""
    api = JetStreamApi(nc)
    await require_queue(api, queue)
    records = RequestRecords(nc, queue)
    await records.ensure()
    return api, records
