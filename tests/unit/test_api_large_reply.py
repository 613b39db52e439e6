"""A big JetStream API reply (a page of many subjects) is parsed off the event loop."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from keyqueue.jetstream.api import LARGE_REPLY, JetStreamApi


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.headers: dict[str, str] = {}


class _FakeClient:
    """Answers every request with one canned reply (pure logic: no server needed)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()
        self.is_connected = True
        self.is_closed = False
        self.is_reconnecting = False

    async def request(self, subject: str, data: bytes, timeout: float, headers: Any = None) -> _Reply:
        return _Reply(self.data)


@pytest.fixture
def parsed_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads ``json.loads`` ran in during the test."""
    threads: list[str] = []
    original = json.loads

    def recording_loads(data: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", recording_loads)
    return threads


async def test_a_large_reply_is_parsed_in_a_thread(parsed_in: list[str]) -> None:
    subjects = {f"kq.q.in.key-{i}": 1 for i in range(20_000)}
    client = _FakeClient({"state": {"subjects": subjects}, "total": len(subjects)})
    assert len(client.data) > LARGE_REPLY
    body = await JetStreamApi(client).request("STREAM.INFO.KQ_q_INBOX")  # type: ignore[arg-type]
    assert body["total"] == 20_000
    assert parsed_in and all(name != "MainThread" for name in parsed_in)


async def test_a_small_reply_is_parsed_on_the_loop(parsed_in: list[str]) -> None:
    client = _FakeClient({"state": {"messages": 1}})
    await JetStreamApi(client).request("STREAM.INFO.KQ_q_INBOX")  # type: ignore[arg-type]
    assert parsed_in == ["MainThread"]
