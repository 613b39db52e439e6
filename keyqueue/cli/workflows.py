"""``keyqueue workflow show|list``, and what ``keyqueue status|result|cancel`` do with a workflow id.

A workflow's records are in the ``KQ_<queue>_WORKFLOWS`` stream of the queue of its first step
(``keyqueue.jetstream.workflows``); ``keyqueue.app.workflows`` reads them into a view. These
commands find the queue themselves when it is not given, and print the view: a table for people,
``--json`` for scripts.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import TYPE_CHECKING, Any

import click

from keyqueue.app.status import request_status
from keyqueue.app.workflows import (
    StepView,
    WorkflowView,
    cancel_workflow,
    read_workflow,
    workflow_result,
    workflow_status,
)
from keyqueue.cli.common import connection, table, to_json, url_option
from keyqueue.errors import ConfigError, RequestNotFound
from keyqueue.events import EVENT_HEADERS, event, events_subject
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords
from keyqueue.jetstream.workflows import WorkflowStore, existing_store, find_workflow_queue
from keyqueue.tasks.canvas import validate_workflow_id
from keyqueue.wire import CBOR, dumps

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["cancel_workflow_by_id", "result_of_workflow", "status_of_workflow", "workflow", "workflow_store"]

_LIVE_LOOKUPS = 20
"""Pending steps ``show`` asks the workers about (running or waiting for their key)."""


async def workflow_store(nc: Client, workflow_id: str, queue: str | None) -> WorkflowStore:
    """Where workflow ``workflow_id`` is kept (in ``queue`` if given); ``RequestNotFound`` if nowhere."""
    validate_workflow_id(workflow_id)
    found = queue if queue is not None else await find_workflow_queue(JetStreamApi(nc), workflow_id)
    store = await existing_store(nc, found) if found is not None else None
    if store is None or await store.last(store.subject(workflow_id, "plan")) is None:
        where = f"in queue {queue!r}" if queue is not None else "in any queue of this server"
        raise RequestNotFound(f"no workflow {workflow_id} {where} (its records are kept 7 days after their last "
                              "change; check the id, and --url or KEYQUEUE_URL)")
    return store


def _status_of(nc: Client, api: JetStreamApi) -> Any:
    records: dict[str, RequestRecords] = {}

    async def status_of(step: StepView) -> str:
        assert step.queue is not None
        if step.queue not in records:
            records[step.queue] = RequestRecords(nc, step.queue)
        return await request_status(records[step.queue], api, step.request_id, seq=step.seq, key=step.key)

    return status_of


async def status_of_workflow(nc: Client, queue: str | None, workflow_id: str) -> str:
    """``keyqueue status`` of a workflow id."""
    store = await workflow_store(nc, workflow_id, queue)
    view = await read_workflow(store, workflow_id)
    if view is None:
        return "unknown"
    return await workflow_status(view, _status_of(nc, JetStreamApi(nc)))


async def result_of_workflow(nc: Client, queue: str | None, workflow_id: str, timeout: float) -> Any:
    """``keyqueue result`` of a workflow id: its result as plain values (or its error, raised)."""
    return await workflow_result(await workflow_store(nc, workflow_id, queue), workflow_id, timeout)


async def cancel_workflow_by_id(nc: Client, queue: str | None, workflow_id: str) -> str:
    """``keyqueue cancel`` of a workflow id; publishes its ``workflow_cancelled`` event."""
    store = await workflow_store(nc, workflow_id, queue)

    async def records_of(name: str) -> RequestRecords:
        records = RequestRecords(nc, name)
        await records.ensure()
        return records

    state, count = await cancel_workflow(store, workflow_id, records_of)
    if state == "cancelled" and count:
        body = event("workflow_cancelled", time.time(), store.queue, run_id=workflow_id,
                     reason=f"{count} step(s) not started")
        await nc.publish(events_subject(store.queue, "workflow_cancelled"), dumps(body, CBOR),
                         headers=dict(EVENT_HEADERS))
    return state


@click.group()
def workflow() -> None:
    """Look at workflows (chain, group, chord): their steps, keys, states and where they stopped.

    \b
    Examples:
      $ keyqueue workflow show wf-01J9ZQ4R3M5V6W7X8Y9Z0A1B2C
      $ keyqueue workflow list shop
      $ keyqueue status shop wf-01J9ZQ4R3M5V6W7X8Y9Z0A1B2C     # pending, running, done, failed, cancelled
      $ keyqueue result shop wf-01J9ZQ4R3M5V6W7X8Y9Z0A1B2C --timeout 10
      $ keyqueue cancel shop wf-01J9ZQ4R3M5V6W7X8Y9Z0A1B2C     # every step that has not started
    """


@workflow.command()
@click.argument("workflow_id")
@click.option("--queue", default=None, help="The queue of its first step, where it is kept (default: found).")
@click.option("--json", "as_json", is_flag=True, help="Print the view as JSON.")
@url_option
def show(workflow_id: str, queue: str | None, as_json: bool, url: str | None) -> None:
    """Print a workflow: each step's task, key, state, attempts and times, and where it stopped.

    \b
    A step's state:
      waiting    what comes before it has not finished
      pending    enqueued under its key, not started (running: a live worker runs it now)
      done, failed, cancelled
      not-run    it will not run; the note says why (the step that failed, or the cancel)

    A failed step is in its queue's dead-letter queue: `keyqueue dlq replay QUEUE --key KEY`
    runs it again, and the workflow goes on from there.

    \b
    Example:
      $ keyqueue workflow show wf-01J9ZQ4R3M5V6W7X8Y9Z0A1B2C
    """

    async def run() -> WorkflowView:
        async with connection(url) as nc:
            store = await workflow_store(nc, workflow_id, queue)
            view = await read_workflow(store, workflow_id)
            if view is None:
                raise RequestNotFound(f"no workflow {workflow_id}")
            status_of = _status_of(nc, JetStreamApi(nc))
            pending = [s for s in view.steps if s.state == "pending"][:_LIVE_LOOKUPS]
            answers = await asyncio.gather(*(status_of(s) for s in pending), return_exceptions=True)
            for step, answer in zip(pending, answers, strict=True):
                if answer == "running":
                    step.state = "running"
            return view

    view = asyncio.run(run())
    if as_json:
        click.echo(to_json(view.fields(), indent=2))
        return
    click.echo(describe(view))


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def describe(view: WorkflowView) -> str:
    """The view for people: a header and one row per step."""
    stopped = ""
    if view.stopped_at is not None:
        step = view.steps[view.stopped_at]
        stopped = f" (stopped at step {step.step}: {step.task} on key {step.key or '-'})"
    head = [f"workflow {view.workflow_id}  queue {view.queue}  {view.state}{stopped}",
            f"started {_when(view.started)}  finished {_when(view.finished)}  "
            + ", ".join(f"{n} {state}" for state, n in sorted(view.counts.items()))]
    rows = []
    for s in view.steps:
        took = f"{s.finished - s.started:.3f}s" if s.started is not None and s.finished is not None else "-"
        if s.state == "failed":
            note = f"{s.error_type}: {s.message} ({s.reason})"
        else:
            note = s.reason or ("" if s.role == "step" else s.role)
        rows.append([s.step, s.task, s.queue or "-", s.key or "-", s.state, s.attempt or "-", took, note])
    return "\n".join([*head, "", table(["STEP", "TASK", "QUEUE", "KEY", "STATE", "ATTEMPT", "TOOK", "NOTE"], rows)])


@workflow.command("list")
@click.argument("queue")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True, help="At most this many, newest last.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per workflow.")
@url_option
def list_command(queue: str, limit: int, as_json: bool, url: str | None) -> None:
    """List the workflows kept in QUEUE (those whose first step runs there), with their states.

    \b
    Example:
      $ keyqueue workflow list shop --limit 10
    """

    async def run() -> list[WorkflowView]:
        async with connection(url) as nc:
            store = await existing_store(nc, queue)
            if store is None:
                return []
            ids = await store.workflow_ids()
            views = [await read_workflow(store, i) for i in ids[-limit:]]
            return [v for v in views if v is not None]

    views = asyncio.run(run())
    if as_json:
        for view in views:
            fields = view.fields()
            del fields["steps"]
            click.echo(to_json(fields))
        return
    if not views:
        raise ConfigError(f"no workflows are kept in queue {queue!r}")
    rows = []
    for v in views:
        stopped = "-" if v.stopped_at is None else f"step {v.stopped_at} ({v.steps[v.stopped_at].task})"
        rows.append([v.workflow_id, v.state, len(v.steps), _when(v.started), stopped])
    click.echo(table(["WORKFLOW", "STATE", "STEPS", "STARTED", "STOPPED AT"], rows))
