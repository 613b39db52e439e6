"""A keyqueue plugin for tests: reports key and request lifecycle hooks to a sink, like the Rebaser's observer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keyqueue

Sink = Callable[[str, dict[str, Any]], None]


class SessionEvents:
    """Forwards ``acquired``, ``released`` (with its outcome) and ``dead_lettered`` as ``session:<event>``."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    @keyqueue.hookimpl
    def keyqueue_key_acquired(self, worker: keyqueue.Worker, key: str, fencing: tuple[int, int]) -> None:
        self.sink("session:acquired", {"worker": worker.name, "key": key, "fencing": list(fencing)})

    @keyqueue.hookimpl
    def keyqueue_key_released(self, worker: keyqueue.Worker, key: str, outcome: str) -> None:
        self.sink("session:released", {"worker": worker.name, "key": key, "outcome": outcome})

    @keyqueue.hookimpl
    def keyqueue_request_dead_lettered(self, key: str, request_id: str, reason: str, error: str) -> None:
        self.sink("session:dead_lettered", {"key": key, "request_id": request_id, "reason": reason, "error": error})
