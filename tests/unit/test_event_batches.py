"""The events plugin's batching: a key's events wait for its session's end, or FLUSH_AFTER after the first."""

from __future__ import annotations

import time
from typing import Any

import pytest

from keyqueue.builtins import events as plugin


async def added(events: plugin._AppEvents, queue: str, body: dict[str, Any]) -> None:
    """Keep an event as the worker's hook does: await the send that is due, if any."""
    sent = events.add(queue, body)
    if sent is not None:
        await sent

class Sent(plugin._AppEvents):
    """The plugin's publisher with its sends recorded instead of published."""

    def __init__(self) -> None:
        self.sent: list[tuple[str | None, list[str]]] = []
        self._kept = {}
        self._since = {}
        self._timer = None
        self._flushing = None

    async def _send(self, queue: str, key: str | None, bodies: list[dict[str, Any]]) -> None:
        self.sent.append((key, [b["event"] for b in bodies]))


def event(name: str, key: str | None) -> dict[str, Any]:
    return {"event": name, "key": key}


async def test_a_sessions_events_go_out_together_when_it_gives_the_key_back() -> None:
    events = Sent()
    for name in ("acquired", "started", "succeeded"):
        await added(events, "q", event(name, "k1"))
    assert events.sent == []
    await added(events, "q", event("released", "k1"))
    assert events.sent == [("k1", ["acquired", "started", "succeeded", "released"])]
    await added(events, "q", event("paused", None))  # queue-wide: at once
    assert events.sent[-1] == (None, ["paused"])
    await events.close()


async def test_the_timer_sends_only_the_keys_kept_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    events = Sent()
    await added(events, "q", event("started", "old"))
    now[0] += plugin.FLUSH_AFTER * 0.75
    await added(events, "q", event("started", "young"))
    now[0] += plugin.FLUSH_AFTER * 0.25
    await events._flush_due()
    assert events.sent == [("old", ["started"])]  # "young" is in the middle of its session
    assert events._timer is not None  # armed again, for "young"
    await events.close()
    assert events.sent[-1] == ("young", ["started"])


async def test_a_full_batch_goes_out_at_once() -> None:
    events = Sent()
    for _ in range(plugin.BATCH_MAX):
        await added(events, "q", event("started", "hot"))
    assert events.sent == [("hot", ["started"] * plugin.BATCH_MAX)]
    await events.close()
