"""The dashboard's view of workflows: one workflow's steps, and the workflows a queue keeps.

A workflow's records are in the ``KQ_<queue>_WORKFLOWS`` stream of the queue of its first step;
``keyqueue.app.workflows`` reads them. Read when a page asks, as ``keyqueue workflow show`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from keyqueue.app.workflows import WorkflowView, read_workflow
from keyqueue.errors import InvalidRequestId
from keyqueue.jetstream.workflows import existing_store
from keyqueue.tasks.canvas import validate_workflow_id

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["LISTED", "queue_workflows", "workflow_view"]

LISTED: Final = 50
"""Workflows a queue's page lists: the most recently started."""


async def workflow_view(nc: Client, queue: str, workflow_id: str) -> WorkflowView | None:
    """Workflow ``workflow_id`` kept in ``queue``, or None."""
    try:
        validate_workflow_id(workflow_id)
    except InvalidRequestId:
        return None
    store = await existing_store(nc, queue)
    return await read_workflow(store, workflow_id) if store is not None else None


async def queue_workflows(nc: Client, queue: str, limit: int = LISTED) -> tuple[list[WorkflowView], int]:
    """The last ``limit`` workflows ``queue`` keeps, most recent first, and how many it keeps."""
    store = await existing_store(nc, queue)
    if store is None:
        return [], 0
    ids = await store.workflow_ids()
    views = [await read_workflow(store, i) for i in reversed(ids[-limit:])]
    return [v for v in views if v is not None], len(ids)
