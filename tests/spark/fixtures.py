"""A known event history in the events-stream format (``keyqueue.events``), with the Rebaser's DVU runs."""

from __future__ import annotations

import random
from typing import Any

from keyqueue.events import SUPERSEDED_BY_CANCEL, ensure_events_stream, event, superseded_reason
from keyqueue_rebaser.events import DVU_FINISHED, DVU_STARTED
from keyqueue_spark.streams import connect_to, publish_events


def history(queue: str, *, requests: int = 600, seed: int = 7) -> list[dict[str, Any]]:
    """Events of ``requests`` requests over two tasks and 40 keys (key-3 hot), with retries,
    dead letters, superseded and cancelled requests (as a worker records them) and DVU runs of known sizes."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    t0 = 1_790_000_000.0
    for i in range(requests):
        task = "Reindex" if i % 3 else "Rebase"
        key = "key-3" if i % 4 == 0 else f"key-{rng.randrange(40)}"
        rid = f"r{i}"
        ts = t0 + i * 0.5
        common = {"key": key, "request_id": rid, "task": task, "worker": "w1"}
        events.append(event("enqueued", ts, queue, **common))
        if i % 25 == 0:  # a `latest` task's request, superseded by the next one
            events.append(event("superseded", ts + 0.1, queue, reason=superseded_reason(f"r{i + 1}"), **common))
            continue
        if i % 25 == 12:  # cancelled before it started: a cancelled event, then the session's superseded event
            events.append(event("cancelled", ts + 0.1, queue, reason="cancelled before it started", **common))
            events.append(event("superseded", ts + 0.2, queue, reason=SUPERSEDED_BY_CANCEL, **common))
            continue
        attempts = 2 if i % 10 == 1 else 1
        for attempt in range(1, attempts + 1):
            wait = round(rng.uniform(0.01, 3.0), 4)
            events.append(event("started", ts + wait, queue, attempt=attempt, wait=wait, **common))
            if attempt < attempts:
                events.append(event("retried", ts + wait + 0.1, queue, attempt=attempt, reason="TimeoutError: slow",
                                    **common))
        run = round(rng.uniform(0.001, 0.5), 4)
        if i % 50 == 7:
            events.append(event("dead_lettered", ts + 4, queue, attempt=attempts, run=run, reason="rejected", **common))
        else:
            events.append(event("succeeded", ts + 4, queue, attempt=attempts, run=run, **common))
    for n in range(20):  # workflows: 16 done, 3 stopped by a failed step (one resumed, then done), 1 cancelled
        wf, began = f"wf-{n}", t0 + n * 5
        events.append(event("workflow_started", began, queue, run_id=wf))
        if n < 16:
            events.append(event("workflow_done", began + 1 + n * 0.25, queue, run_id=wf))
        elif n < 19:
            events.append(event("workflow_failed", began + 2, queue, key=f"key-{n}", task="Rebase", run_id=wf,
                                request_id=f"{wf}_1", reason="max-attempts: ValueError: boom"))
            if n == 16:
                events.append(event("workflow_resumed", began + 30, queue, key=f"key-{n}", task="Rebase", run_id=wf))
                events.append(event("workflow_done", began + 31, queue, run_id=wf))
        else:
            events.append(event("workflow_cancelled", began + 1, queue, run_id=wf))
    for n in range(30):
        triggers = 1 + n % 5
        events.append(event(DVU_STARTED, t0 + n * 10, queue, key=f"key-{n}", run_id=f"d{n}"))
        events.append(event(DVU_FINISHED, t0 + n * 10 + 1, queue, key=f"key-{n}", run_id=f"d{n}",
                            run=0.25 * triggers, triggers=triggers))
    return events


async def publish_history(url: str, queue: str, events: list[dict[str, Any]]) -> None:
    nc = await connect_to(url)
    try:
        await ensure_events_stream(nc, queue)
        await publish_events(nc, queue, events)
    finally:
        await nc.close()


def plain_history(queue: str, *, per_burst: int = 20) -> list[dict[str, Any]]:
    """Events of task ``post`` in two bursts 200 s apart (a gap in the throughput), with key events
    (``acquired``/``released``: no task), one request with an empty task, and no DVU events."""
    events: list[dict[str, Any]] = []
    t0 = 1_790_000_000.0
    for burst in (0.0, 200.0):
        for i in range(per_burst):
            ts = t0 + burst + i
            key, rid = f"acct-{i % 4}", f"r{burst:.0f}-{i}"
            common = {"key": key, "request_id": rid, "task": "post", "worker": "w1"}
            events.append(event("acquired", ts, queue, key=key, worker="w1"))
            events.append(event("enqueued", ts, queue, **common))
            events.append(event("started", ts + 0.2, queue, attempt=1, wait=0.2, **common))
            events.append(event("succeeded", ts + 0.5, queue, attempt=1, run=0.3, **common))
            events.append(event("released", ts + 0.6, queue, key=key, worker="w1", reason="idle"))
    untyped = {"key": "acct-0", "request_id": "r-untyped", "task": "", "worker": "w1"}
    events.append(event("started", t0 + 1, queue, attempt=1, wait=0.1, **untyped))
    events.append(event("dead_lettered", t0 + 2, queue, attempt=1, run=0.1, reason="rejected", **untyped))
    return events
