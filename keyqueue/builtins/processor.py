"""The default processor, which runs a queue's ``@task`` functions, and the built-in plugin around it.

``TaskProcessor`` is a ``KeyProcessor``: the request's ``X-MESSAGE-TYPE`` names the task, its
body holds the arguments. Anything it cannot read (an unknown task, a newer version, a malformed
body) raises a ``WireError``, which the key session dead-letters at once with the reason. A
queue whose task has policy ``batch``, ``latest`` or ``merge`` gets ``batch_size`` = the task's
``max_batch``, so the session hands it every available request of the key in one call; each of
those requests is read on its own, and one that cannot be read is dead-lettered alone (returned
in its place) while the others run.

Bodies are decoded on the event loop, where the key sessions' lease renewals run too, unless
they are large (:data:`DECODE_OFF_LOOP_BYTES`, summed over a batch): those are decoded in a
thread, so one key's big batch cannot starve every other key's renewals.

As a plugin module (``keyqueue.plugins.manager.BUILTIN_PLUGINS``) it builds processors, retry policies
and merged arguments, each ``trylast`` so any other plugin can take over.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Final, cast

from keyqueue.core.processor import BaseProcessor, BatchOutcome, KeyProcessor, Reply, Request, RequestContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import MalformedBody, Reject, UnknownMessageType, WireError
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.plugins.manager import hookimpl
from keyqueue.tasks.arguments import encode_result, result_headers, upgrade_arguments
from keyqueue.tasks.context import Context
from keyqueue.tasks.task import BatchTask, Task, TaskSpec
from keyqueue.wire import Envelope, loads_map, peek
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from keyqueue.app.application import App
    from keyqueue.app.process_pool import ProcessPool
    from keyqueue.app.worker import Worker
    from keyqueue.tasks.task import AnyTask

__all__ = ["ABSORBED_BY", "TaskProcessor"]

log = logging.getLogger("keyqueue.task")

ABSORBED_BY: Final = "X-KQ-Absorbed-By"
"""On the replies of a ``merge`` run: the request id of the run (its newest request) that answered them."""

DECODE_OFF_LOOP_BYTES: Final = 16 * 1024
"""Bodies larger than this (together, for a batch) are decoded in a thread, off the event loop.
Structured CBOR (maps, arrays, small values) decodes at roughly 5-10 MB/s, validation included,
so a decode left on the loop takes a few milliseconds at most; a thread hop costs about 0.1 ms."""


_POLICIES: weakref.WeakKeyDictionary[Any, tuple[TaskSpec, RetryPolicy]] = weakref.WeakKeyDictionary()
"""Task -> (its spec, the retry policy built from it): built once per task, not per request."""


def _task_retry_policy(task: AnyTask) -> RetryPolicy:
    """``task.spec.retry_policy()``, remembered for as long as the task keeps its spec."""
    cached = _POLICIES.get(task)
    if cached is None or cached[0] is not task.spec:
        cached = _POLICIES[task] = (task.spec, task.spec.retry_policy())
    return cached[1]


class TaskProcessor(BaseProcessor):
    """Runs the ``@task`` functions of one queue for one key session.

    ``tasks`` are the queue's tasks by name; ``executor`` runs the sync ones (None: asyncio's
    default threads). The built-in plugin takes both from the worker (``Worker.queue_tasks``,
    ``Worker.executor``).
    """

    def __init__(self, app: App, queue: str, key: str, tasks: Mapping[str, AnyTask],
                 executor: Executor | None = None, pool: ProcessPool | None = None) -> None:
        self.app = app
        self.pool = pool
        """Where serial sync tasks run when the worker has a process pool (``keyqueue.app.process_pool``)."""
        self.queue = queue
        self.key = key
        self.tasks = tasks
        self.executor = executor
        special = [t for t in tasks.values() if t.spec.policy != "serial"]
        self.special = special[0] if special else None
        self.batch_size = self.special.spec.max_batch if self.special is not None else 0
        self._peeked: tuple[Request, Envelope, AnyTask | None] | None = None
        """The last request whose headers were read, what they say, and its task once looked up (see
        :meth:`envelope`)."""

    # --- reading requests ---

    def envelope(self, request: Request) -> Envelope:
        """``peek(request.headers)``, read once per request: the session asks for a request's retry
        policy and then hands it over, and each step needs what its headers say."""
        peeked = self._peeked
        if peeked is not None and peeked[0] is request:
            return peeked[1]
        envelope = peek(request.headers)
        self._peeked = (request, envelope, None)
        return envelope

    def task_of(self, request: Request) -> AnyTask:
        """The task a request names (``UnknownMessageType`` if the queue has none of that name); looked
        up once per request, as its headers are read once."""
        peeked = self._peeked
        if peeked is not None and peeked[0] is request and peeked[2] is not None:
            return peeked[2]
        envelope = self.envelope(request)
        task = self.tasks.get(envelope.message_type)
        if task is None:
            raise UnknownMessageType(envelope.message_type, tuple(sorted(self.tasks)))
        self._peeked = (request, envelope, task)
        return task

    def arguments(self, task: AnyTask, request: Request) -> dict[str, Any]:
        spec = task.spec
        envelope = self.envelope(request)
        fields = loads_map(request.data, envelope.content_type)
        return upgrade_arguments(spec.name, spec.version, spec.upgrades, envelope.version, fields)

    def decode(self, task: AnyTask, request: Request) -> Any:
        """What ``request`` carries for ``task``: a batch task's item, or a task's argument map
        checked against its function's signature. ``WireError`` if it cannot be read."""
        fields = self.arguments(task, request)
        if isinstance(task, BatchTask):
            return task.item_from_fields(fields)
        task.codec.to_call(fields)
        return fields

    async def read(self, requests: Sequence[Request]) -> list[tuple[AnyTask, Any] | WireError]:
        """Each request's task and content (see :meth:`decode`), or the ``WireError`` that rejects it alone.

        Decoded in a thread when the bodies are larger than :data:`DECODE_OFF_LOOP_BYTES` together.
        """
        if sum(len(r.data) for r in requests) > DECODE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(self._read_now, requests)
        return self._read_now(requests)

    def _read_now(self, requests: Sequence[Request]) -> list[tuple[AnyTask, Any] | WireError]:
        readings: list[tuple[AnyTask, Any] | WireError] = []
        for request in requests:
            try:
                task = self.task_of(request)
                readings.append((task, self.decode(task, request)))
            except WireError as exc:
                readings.append(exc)
        return readings

    def retry_policy(self, request: Request) -> RetryPolicy | None:
        try:
            task: AnyTask | None = self.task_of(request)
        except WireError:
            task = None  # dead-lettered on its first attempt anyway
        spec = task.spec if task is not None else None
        plugins = self.app.plugins
        if task is not None and plugins.implemented_only_by("keyqueue_retry_policy", keyqueue_retry_policy):
            # Only the built-in implementation answers: the task's own policy, built once per task.
            return _task_retry_policy(task)
        policy: RetryPolicy | None = plugins.hook.keyqueue_retry_policy(
            app=self.app, queue=self.queue, task=spec, request=request)
        return policy

    # --- replies ---

    def encodes_result(self, task: AnyTask, request: Request) -> bool:
        """Whether the reply carries the result: when a caller waits for it (a subclass may keep it too)."""
        return request.reply_inbox is not None

    def reply(self, task: AnyTask, request: Request, result: Any, extra: Mapping[str, str] | None = None) -> Reply:
        headers = {**result_headers(task.name, task.spec.version), **(extra or {})}
        if not self.encodes_result(task, request):
            return Reply(b"", headers)
        try:
            return Reply(encode_result(result, task.name), headers)
        except MalformedBody as exc:
            # The work is done; only the result cannot travel. Tell the caller, keep the request done.
            log.error("task %s (key %s): %s", task.name, self.key, exc)
            return Reply(b"", {**headers, H.STATUS: H.STATUS_ERROR, H.ERROR_TYPE: type(exc).__name__,
                               H.ERROR_MESSAGE: H.header_safe(str(exc))})

    # --- serial ---

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        task = self.task_of(request)
        if not isinstance(task, Task) or task.spec.policy != "serial":
            outcome = (await self.handle_batch(ctx, [request]))[0]
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        if self.pool is not None and not inspect.iscoroutinefunction(task.fn):
            # In a child process: the plain fields cross (keyqueue.app.process_pool), not the objects.
            fields = self.arguments(task, request)
            task.codec.to_call(fields)  # a request that cannot bind is rejected here, as in a thread
            context = {"task": task.name, "queue": ctx.queue, "key": ctx.key, "request_id": request.request_id,
                       "attempt": ctx.attempt, "fencing": list(ctx.fencing)}
            return self.reply(task, request, await self.pool.run(task, fields, context))
        # Decoded and bound once: for a serial task, decode()'s check of the arguments against the
        # function's signature is the binding itself, so it is not done twice.
        if len(request.data) > DECODE_OFF_LOOP_BYTES:
            args, kwargs = await asyncio.to_thread(self._call_arguments, task, request)
        else:
            args, kwargs = self._call_arguments(task, request)
        result = await self._run(task, Context(ctx, task.name, (request.request_id,)), args, kwargs)
        return self.reply(task, request, result)

    # --- batch, latest, merge ---

    async def handle_batch(self, ctx: RequestContext, requests: list[Request]) -> Sequence[BatchOutcome]:
        # A request that cannot be read is rejected alone (its WireError in its place); the others run.
        readings = await self.read(requests)
        outcomes: list[BatchOutcome] = [r if isinstance(r, WireError) else None for r in readings]
        good = [(i, *r) for i, r in enumerate(readings) if not isinstance(r, WireError)]
        if not good:
            return outcomes
        task = good[0][1]
        if any(t is not task for _, t, _ in good) or task.spec.policy == "serial":
            # Only possible when a serial task was mixed in by hand: run each on its own, in order.
            for i, _, _ in good:
                outcomes[i] = await self.handle(ctx, requests[i])
            return outcomes
        chosen = [requests[i] for i, _, _ in good]
        values = [value for _, _, value in good]
        replies: list[Reply | None]
        if isinstance(task, BatchTask):
            replies = await self._batch(ctx, task, chosen, values)
        elif task.spec.policy == "latest":
            replies = await self._latest(ctx, task, chosen, values)
        else:
            replies = await self._merge(ctx, task, chosen, values)
        for (i, _, _), reply in zip(good, replies, strict=True):
            outcomes[i] = reply
        return outcomes

    async def _batch(self, ctx: RequestContext, task: BatchTask[Any, Any], requests: list[Request],
                     items: list[Any]) -> list[Reply | None]:
        context = Context(ctx, task.name, tuple(r.request_id for r in requests))
        results = await self._run(task, context, [items], {})
        if results is None:
            return [self.reply(task, r, None) for r in requests]
        if not isinstance(results, Sequence) or isinstance(results, str | bytes) or len(results) != len(requests):
            count = len(results) if isinstance(results, Sequence) else type(results).__name__
            raise Reject(f"batch task {task.name} must return one result per item ({len(requests)}) or None, "
                         f"got {count}")
        return [self.reply(task, r, result) for r, result in zip(requests, results, strict=True)]

    async def _latest(self, ctx: RequestContext, task: Task[Any], requests: list[Request],
                      arguments: list[dict[str, Any]]) -> list[Reply | None]:
        newest = requests[-1]
        args, kwargs = task.codec.to_call(arguments[-1])
        ids = tuple(r.request_id for r in requests)
        result = await self._run(task, Context(ctx, task.name, ids, request_id=newest.request_id), args, kwargs)
        superseded = {H.STATUS: H.STATUS_SUPERSEDED, H.SUPERSEDED_BY: newest.request_id}
        replies: list[Reply | None] = [Reply(b"", {**result_headers(task.name, task.spec.version), **superseded})
                                       for _ in requests[:-1]]
        return [*replies, self.reply(task, newest, result)]

    async def _merge(self, ctx: RequestContext, task: Task[Any], requests: list[Request],
                     arguments: list[dict[str, Any]]) -> list[Reply | None]:
        if len(arguments) == 1:
            merged: dict[str, Any] | None = arguments[0]
        else:
            merged = self.app.plugins.hook.keyqueue_merge_arguments(task=task.spec, arguments=arguments)
        if merged is None:
            raise Reject(f"nothing merges the requests of task {task.name}: give it merge=... or implement "
                         "keyqueue_merge_arguments in a plugin")
        if not isinstance(merged, dict):
            raise Reject(f"merging {task.name} returned {type(merged).__name__}, not a dict of arguments")
        args, kwargs = task.codec.to_call(merged)
        newest = requests[-1]
        ids = tuple(r.request_id for r in requests)
        result = await self._run(task, Context(ctx, task.name, ids, request_id=newest.request_id), args, kwargs)
        return [self.reply(task, r, result, {ABSORBED_BY: newest.request_id}) for r in requests]

    def _call_arguments(self, task: Task[Any], request: Request) -> tuple[list[Any], dict[str, Any]]:
        """The call of a serial task's function for ``request``; ``WireError`` if it cannot be read."""
        return task.codec.to_call(self.arguments(task, request))

    async def _run(self, task: AnyTask, context: Context, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Call the task's function (a sync one in :attr:`executor`)."""
        return await task.run(context, args, kwargs, self.executor)


# --- the built-in plugin ---------------------------------------------------------------------------


@hookimpl(trylast=True)
def keyqueue_build_processor(app: App, worker: Worker, queue: str, key: str) -> KeyProcessor | None:
    """The processor registered for the queue, else the queue's tasks (for the key ``~``: its unkeyed tasks)."""
    factory = app.processor_factory(queue)
    if factory is not None:
        # A processor or an awaitable of one; the worker awaits it.
        return cast("KeyProcessor | None", factory(key))
    tasks = worker.unkeyed_tasks(queue) if key == UNKEYED else worker.queue_tasks(queue)
    if not tasks:
        return None
    from keyqueue.builtins.request_records import RecordingTaskProcessor  # a subclass: imported late

    return RecordingTaskProcessor(app, queue, key, tasks, worker.executor, pool=worker.process_pool)


@hookimpl(trylast=True)
def keyqueue_retry_policy(task: TaskSpec | None) -> RetryPolicy | None:
    """The task's ``max_attempts`` and ``backoff``."""
    return task.retry_policy() if task is not None else None


@hookimpl(trylast=True)
def keyqueue_merge_arguments(task: TaskSpec, arguments: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The task's own ``merge=`` function."""
    return task.merge(arguments) if task.merge is not None else None
