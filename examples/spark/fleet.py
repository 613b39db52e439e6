"""A stand-in for the Rebaser fleet and the built-in events plugin, so the example has a history.

A real keyqueue worker (the core's QueueWorker) drains the queue with a processor shaped like the
Rebaser's: it applies each change-set request in order, fails some requests once (retried),
rejects poison ones (dead-lettered), and before releasing a key runs one DVU covering every
request it applied since the last DVU (coalescing). ``EventRecorder`` publishes what happens
to ``KQ_<queue>_EVENTS`` in the events-stream contract, as the built-in events plugin does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from nats.aio.client import Client

from keyqueue.core.observer import NullObserver, RequestAttempt, SessionObserver, describe
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext, SessionContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import Reject
from keyqueue.events import ensure_events_stream, event
from keyqueue.ext import QueueNames
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.wire import loads_map
from keyqueue_rebaser.events import DVU_FINISHED, DVU_STARTED
from keyqueue_spark.streams import connect_to, publish_events, stream_bounds


class EventRecorder:
    """Buffers events from the worker (a sync callback) and publishes them from one owned task."""

    def __init__(self, nc: Client, queue: str, enqueued_at: dict[str, float], task: str) -> None:
        self.nc, self.queue, self.enqueued_at, self.task = nc, queue, enqueued_at, task
        self.buffer: list[dict[str, Any]] = []
        self.published = 0
        self._flusher: asyncio.Task[None] | None = None

    def add(self, name: Any, **fields: Any) -> None:
        self.buffer.append(event(name, time.time(), self.queue, **fields))

    def observer(self, worker: str) -> SessionObserver:
        """The worker's session observer: map its steps onto the contract."""
        recorder = self

        class Steps(NullObserver):
            def _common(self, r: RequestAttempt) -> dict[str, Any]:
                return {"key": r.key, "request_id": r.request_id, "task": recorder.task, "worker": worker}

            def request_started(self, attempt: RequestAttempt) -> None:
                enqueued = recorder.enqueued_at.get(attempt.request_id)
                wait = time.time() - enqueued if enqueued is not None else None
                recorder.add("started", attempt=attempt.attempt, wait=wait, **self._common(attempt))

            def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
                recorder.add("succeeded", run=elapsed, **self._common(request))

            def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
                recorder.add("retried", attempt=attempt.attempt, reason=describe(error), **self._common(attempt))

            def request_dead_lettered(self, request: RequestAttempt, reason: str, error: BaseException) -> None:
                recorder.add("dead_lettered", attempt=request.attempt, reason=reason, **self._common(request))

        return Steps()

    async def _flush(self) -> None:
        batch, self.buffer = self.buffer, []
        if batch:
            self.published += await publish_events(self.nc, self.queue, batch)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            await self._flush()

    async def __aenter__(self) -> EventRecorder:
        self._flusher = asyncio.create_task(self._run(), name="event-recorder")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._flusher is not None
        self._flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._flusher
        await self._flush()


class ChangeSetProcessor(BaseProcessor):
    """Applies a change set's update requests in order; one coalesced DVU before the key is released."""

    def __init__(self, recorder: EventRecorder, failed_once: set[str]) -> None:
        self.recorder, self.failed_once = recorder, failed_once
        self.pending_triggers = 0
        self.runs = 0

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        fields = loads_map(request.data, "application/cbor")
        if fields.get("poison"):
            raise Reject(f"update {fields['n']} does not apply to the snapshot")
        if fields["n"] % 97 == 0 and request.request_id not in self.failed_once:
            self.failed_once.add(request.request_id)
            raise TimeoutError("snapshot store timed out")
        await asyncio.sleep(0)  # apply the updates (instant here)
        self.pending_triggers += 1
        return None

    async def idle(self, ctx: SessionContext) -> None:
        if not self.pending_triggers:
            return
        self.runs += 1
        run_id = f"{ctx.key}#{ctx.fencing[0]}.{self.runs}"
        self.recorder.add(DVU_STARTED, key=ctx.key, run_id=run_id)
        started = time.monotonic()
        await asyncio.sleep(0.002 * self.pending_triggers)  # DVU cost grows with the roots touched
        self.recorder.add(DVU_FINISHED, key=ctx.key, run_id=run_id, run=time.monotonic() - started,
                          triggers=self.pending_triggers)
        self.pending_triggers = 0


async def drain(url: str, queue: str, enqueued_at: dict[str, float], task: str, *, concurrency: int = 64,
                report_every: float = 5.0) -> int:
    """Run a worker until the queue's inbox is empty; returns how many events were published."""
    nc = await connect_to(url)
    try:
        await ensure_events_stream(nc, queue)
        failed_once: set[str] = set()
        async with EventRecorder(nc, queue, enqueued_at, task) as recorder:
            settings = SessionSettings(retry=RetryPolicy(max_attempts=3, base_delay=0.05, max_delay=0.2))
            worker = QueueWorker(nc, QueueConfig(queue), lambda key: ChangeSetProcessor(recorder, failed_once),
                                 concurrency=concurrency, settings=settings, name="example-worker",
                                 observer=recorder.observer("example-worker"))
            runner = asyncio.create_task(worker.run(), name="worker")
            try:
                await worker.started()
                last = time.monotonic()
                while (left := (await stream_bounds(nc, QueueNames(queue).inbox_stream)).messages) > 0:
                    if time.monotonic() - last >= report_every:
                        print(f"  worker: {left:,} requests left, {recorder.published:,} events published", flush=True)
                        last = time.monotonic()
                    await asyncio.sleep(0.5)
            finally:
                worker.stop()
                await runner
        return recorder.published
    finally:
        await nc.close()
