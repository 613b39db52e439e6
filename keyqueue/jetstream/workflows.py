"""Where a workflow's state lives: the ``KQ_<queue>_WORKFLOWS`` stream of the queue of its first step.

One message per subject (the latest state), each with a per-message TTL of
:data:`WORKFLOW_TTL`; every record is a CBOR map except a slot's, which is the CBOR value itself.
Under ``kq.<queue>.wf.<id>.``:

- ``plan``: the compiled canvas (``keyqueue.tasks.canvas.WorkflowPlan``), written once by the
  producer, by compare-and-set on an empty subject, before any step is enqueued;
- ``start``: where the first steps were stored (``{"steps": {n: [queue, key, seq]}}``);
- ``step.<n>``: what became of step ``n``: ``done``, ``failed`` or ``cancelled``, with its request
  id, key, queue, attempt, times, and where the steps it enqueued were stored (``next``). Written
  by the worker that ran it, *after* everything that follows it was enqueued, so a step whose
  record says ``done`` has handed its result on;
- ``slot.<j>.<i>``: the value slot ``i`` of join ``j`` (a group) received; the join is complete
  when it has as many slot subjects as the group has parts, which a worker counts after writing
  its own (a part that ran twice writes its slot twice: one subject, counted once);
- ``join.<j>``: written by compare-and-set once join ``j``'s list was handed on (its callback enqueued);
- ``end``: ``done`` (with the workflow's result), ``failed`` (which step, why), ``cancelled``, or
  ``running`` again once a failed step's dead-letter replay succeeded.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import JetStreamError, StreamNotFound, TopologyMismatch, WireError
from keyqueue.jetstream.api import DESCRIPTION, STATUS, JetStreamApi, StoredMsg, parse_pub_ack, wait_stored
from keyqueue.jetstream.kv import EXPECTED_LAST_SUBJECT_SEQUENCE
from keyqueue.jetstream.subjects import validate_queue_name
from keyqueue.wire import CBOR, dumps, loads

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["WORKFLOW_TTL", "WorkflowStore", "decode_record", "existing_store", "find_workflow_queue"]

WORKFLOW_TTL: Final = 7 * 24 * 3600
"""Seconds a workflow's records are kept after their last write."""

TTL: Final = "Nats-TTL"


def decode_record(stored: StoredMsg | None) -> dict[str, Any] | None:
    """A stored record's map, or None (nothing stored, or not a map)."""
    if stored is None or not stored.data:
        return None
    try:
        value = loads(stored.data, CBOR)
    except WireError:
        return None
    return value if isinstance(value, dict) else None


class WorkflowStore:
    """The workflows stream of one queue on one connection: ``ensure`` once, then read and write."""

    def __init__(self, nc: Client, queue: str, *, replicas: int = 1) -> None:
        self.nc = nc
        self.queue = validate_queue_name(queue)
        self.replicas = replicas
        self.api = JetStreamApi(nc)
        self.stream = f"KQ_{queue}_WORKFLOWS"
        self.direct = replicas == 1

    def subject(self, workflow_id: str, *parts: object) -> str:
        """``kq.<queue>.wf.<id>.<parts...>``."""
        return ".".join((f"kq.{self.queue}.wf.{workflow_id}", *map(str, parts)))

    def config(self) -> dict[str, Any]:
        return {
            "name": self.stream,
            "subjects": [f"kq.{self.queue}.wf.>"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_msgs_per_subject": 1,
            "discard": "old",
            "allow_msg_ttl": True,
            "allow_direct": self.direct,
        }

    async def ensure(self) -> None:
        """Create the stream if it is missing, else check what its readers rely on."""
        wanted = self.config()
        existing = await self.api.stream_or_create(wanted)
        for name in ("subjects", "max_msgs_per_subject", "allow_msg_ttl"):
            if existing.get(name) != wanted[name]:
                raise TopologyMismatch(f"stream {self.stream}", name, existing.get(name), wanted[name],
                                       f"delete it (nats stream rm {self.stream}); it holds only workflows' state")
        self.direct = bool(existing.get("allow_direct"))

    # --- writing ---

    async def put(self, subject: str, body: bytes, *, expected_last: int | None = None,
                  ttl: float = WORKFLOW_TTL) -> int:
        """Store ``body`` as the subject's record (``WrongLastSequence`` if ``expected_last`` is given
        and the subject's last sequence is another: 0 means "only if there is none")."""
        headers = {TTL: f"{max(1, math.ceil(ttl))}s"}
        if expected_last is not None:
            headers[EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last)
        return parse_pub_ack(await self.api._request(subject, body, None, headers)).seq

    async def put_record(self, subject: str, fields: Mapping[str, Any], *, expected_last: int | None = None) -> int:
        """Store a record map (CBOR)."""
        return await self.put(subject, dumps(dict(fields), CBOR), expected_last=expected_last)

    # --- reading ---

    async def last(self, subject: str) -> StoredMsg | None:
        return await self.api.get_msg(self.stream, last_by_subject=subject, direct=self.direct)

    async def lasts(self, subjects: Sequence[str]) -> dict[str, StoredMsg]:
        """The record of each subject that has one (the reads sent together)."""
        stored = await asyncio.gather(*(self.last(s) for s in subjects))
        return {m.subject: m for m in stored if m is not None}

    async def records(self, workflow_id: str) -> dict[str, StoredMsg]:
        """Every record of the workflow, by its subject after ``kq.<queue>.wf.<id>.`` (``plan``, ``step.3``...)."""
        prefix = self.subject(workflow_id) + "."
        found: dict[str, StoredMsg] = {}
        try:
            async for page in self.api.pages(self.stream, prefix + ">"):
                found.update((m.subject[len(prefix):], m) for m in page)
        except StreamNotFound:
            return {}
        return found

    async def workflow_ids(self) -> list[str]:
        """The ids of the workflows kept here, oldest first (by when their plan was stored)."""
        prefix = f"kq.{self.queue}.wf."
        ids: list[str] = []
        try:
            async for page in self.api.pages(self.stream, prefix + "*.plan"):
                ids.extend(m.subject[len(prefix):-len(".plan")] for m in page)
        except StreamNotFound:
            return []
        return ids

    async def count(self, subject_filter: str) -> int:
        """How many subjects matching ``subject_filter`` hold a record (each holds at most one).

        One request: a batched direct get of one message says how many more match after it
        (``Nats-Num-Pending``); its end-of-batch reply that follows is dropped unread."""
        if self.direct:
            payload = json.dumps({"seq": 1, "next_by_subj": subject_filter, "batch": 1}).encode()
            reply = await self.api._request(f"{self.api.prefix}.DIRECT.GET.{self.stream}", payload, None)
            headers = reply.headers or {}
            if headers.get(STATUS):
                if headers[STATUS] == "404":
                    return 0
                raise JetStreamError(f"counting {subject_filter} in {self.stream} failed: {headers.get(STATUS)} "
                                     f"{headers.get(DESCRIPTION, '')}")
            return 1 + int(headers.get("Nats-Num-Pending", "0") or 0)
        return len(await self.api.subjects(self.stream, subject_filter))

    async def slots(self, workflow_id: str, join: int) -> dict[int, bytes]:
        """The values join ``join``'s slots hold, by slot."""
        prefix = self.subject(workflow_id, "slot", join) + "."
        found: dict[int, bytes] = {}
        async for page in self.api.pages(self.stream, prefix + "*"):
            for m in page:
                found[int(m.subject[len(prefix):])] = m.data
        return found

    async def wait(self, subject: str, timeout: float, accept: Callable[[StoredMsg], bool]) -> StoredMsg | None:
        """The subject's record once ``accept`` takes it, waiting up to ``timeout`` seconds; else None
        (read back from the stream: :func:`~keyqueue.jetstream.api.wait_stored`)."""
        return await wait_stored(self.nc, subject, self.last, accept, timeout)


async def existing_store(nc: Client, queue: str) -> WorkflowStore | None:
    """The workflows stream of ``queue`` if it exists (never created: for readers), else None."""
    store = WorkflowStore(nc, queue)
    try:
        info = await store.api.stream_info(store.stream)
    except StreamNotFound:
        return None
    store.replicas = int(info["config"].get("num_replicas", 1))
    store.direct = bool(info["config"].get("allow_direct"))
    return store


async def find_workflow_queue(api: JetStreamApi, workflow_id: str) -> str | None:
    """The queue whose workflows stream holds workflow ``workflow_id``'s plan, or None."""
    body = await api.request("STREAM.NAMES", {"subject": f"kq.*.wf.{workflow_id}.plan"})
    for name in body.get("streams") or []:
        if name.startswith("KQ_") and name.endswith("_WORKFLOWS"):
            return str(name[len("KQ_"):-len("_WORKFLOWS")])
    return None
