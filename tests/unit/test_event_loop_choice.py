"""``--loop``: which loop each value means, and what a missing uvloop does."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from keyqueue.app import event_loop
from keyqueue.errors import ConfigError


def test_asyncio_is_always_asyncio() -> None:
    assert event_loop.resolve_loop("asyncio") == "asyncio"
    assert event_loop.loop_factory("asyncio") is None


def test_auto_falls_back_to_asyncio_without_uvloop_and_uvloop_then_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert event_loop.resolve_loop("auto") == "asyncio"
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop.resolve_loop("uvloop")


def test_an_unknown_loop_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--loop must be one of auto, asyncio, uvloop"):
        event_loop.resolve_loop("trio")


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed here")
def test_run_runs_on_the_loop_named() -> None:
    async def module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(module(), "uvloop").startswith("uvloop")
    assert event_loop.run(module(), "auto").startswith("uvloop")
    assert event_loop.run(module(), "asyncio").startswith("asyncio")
