"""keyqueue's OpenTelemetry metrics (instrument names and units are listed in docs/observability.md).

Every instrument carries ``keyqueue.queue``; request instruments also ``keyqueue.task``.
``OtelPlugin`` creates them from its meter provider, else from the global one once an SDK has
set it (until then nothing is counted, at no cost).
"""

from __future__ import annotations

import time
from typing import Any, Final

from opentelemetry import metrics

__all__ = ["INSTRUMENTS", "Metrics"]

INSTRUMENTS: Final = {
    "keyqueue.requests.enqueued": ("counter", "{request}", "Requests stored (duplicates not counted)"),
    "keyqueue.requests.succeeded": ("counter", "{request}", "Requests processed and removed"),
    "keyqueue.requests.failed": ("counter", "{attempt}", "Attempts that raised (each is retried or dead-lettered)"),
    "keyqueue.requests.retried": ("counter", "{attempt}", "Failed attempts that will run again after a backoff"),
    "keyqueue.requests.dead_lettered": ("counter", "{request}", "Requests moved to the dead-letter queue"),
    "keyqueue.requests.superseded": ("counter", "{request}", "Requests replaced by a newer one (policy latest)"),
    "keyqueue.request.wait": ("histogram", "s", "Seconds from enqueue to the start of the first attempt"),
    "keyqueue.request.run": ("histogram", "s", "Seconds the successful attempt ran"),
    "keyqueue.keys.held": ("updowncounter", "{key}", "Keys this process holds (key sessions open)"),
}
"""name -> (kind, unit, description)."""


class Metrics:
    """The instruments, and one method per thing counted."""

    def __init__(self, meter_provider: Any = None) -> None:
        from .plugin import INSTRUMENTATION, _version

        meter = metrics.get_meter(INSTRUMENTATION, _version(), meter_provider=meter_provider)
        made: dict[str, Any] = {}
        for name, (kind, unit, description) in INSTRUMENTS.items():
            create: Any = {"counter": meter.create_counter, "histogram": meter.create_histogram,
                      "updowncounter": meter.create_up_down_counter}[kind]
            made[name] = create(name, unit=unit, description=description)
        self._enqueued = made["keyqueue.requests.enqueued"]
        self._succeeded = made["keyqueue.requests.succeeded"]
        self._failed = made["keyqueue.requests.failed"]
        self._retried = made["keyqueue.requests.retried"]
        self._dead_lettered = made["keyqueue.requests.dead_lettered"]
        self._superseded = made["keyqueue.requests.superseded"]
        self._wait = made["keyqueue.request.wait"]
        self._run = made["keyqueue.request.run"]
        self._held = made["keyqueue.keys.held"]

    @staticmethod
    def _attrs(queue: str, task: str) -> dict[str, str]:
        return {"keyqueue.queue": queue, "keyqueue.task": task}

    def enqueued(self, queue: str, task: str) -> None:
        self._enqueued.add(1, self._attrs(queue, task))

    def started(self, queue: str, task: str, enqueued_at: float | None) -> None:
        """An attempt started; ``enqueued_at`` is when the server stored its request (Unix seconds)."""
        if enqueued_at is not None:
            self._wait.record(max(0.0, time.time() - enqueued_at), self._attrs(queue, task))

    def succeeded(self, queue: str, task: str, elapsed: float) -> None:
        attrs = self._attrs(queue, task)
        self._succeeded.add(1, attrs)
        self._run.record(elapsed, attrs)

    def failed(self, queue: str, task: str, error_type: str) -> None:
        self._failed.add(1, {**self._attrs(queue, task), "error.type": error_type})

    def retried(self, queue: str, task: str) -> None:
        self._retried.add(1, self._attrs(queue, task))

    def superseded(self, queue: str, task: str) -> None:
        self._superseded.add(1, self._attrs(queue, task))

    def dead_lettered(self, queue: str, task: str, reason: str) -> None:
        self._dead_lettered.add(1, {**self._attrs(queue, task), "keyqueue.reason": reason})

    def keys_held(self, queue: str, delta: int) -> None:
        self._held.add(delta, {"keyqueue.queue": queue})
