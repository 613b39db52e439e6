"""Which event loop a worker runs on: ``--loop auto|asyncio|uvloop`` (``keyqueue worker``).

uvloop (libuv under asyncio's API) runs keyqueue's I/O-bound worker markedly faster: nats-py's own
tests and benchmarks run under it, and a worker's per-request cost is mostly loop work (callbacks,
timers, socket reads). It is a dependency where it installs (CPython on Linux and macOS); ``auto``
uses it when it imports and falls back to asyncio's own loop otherwise.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, Final, Literal, TypeVar

from keyqueue.errors import ConfigError

__all__ = ["LOOPS", "LoopName", "loop_factory", "resolve_loop", "run"]

LoopName = Literal["auto", "asyncio", "uvloop"]

LOOPS: Final[tuple[LoopName, ...]] = ("auto", "asyncio", "uvloop")
"""The values ``--loop`` takes."""

T = TypeVar("T")


def resolve_loop(name: str) -> Literal["asyncio", "uvloop"]:
    """The loop ``name`` means here: ``auto`` is uvloop where it is installed, else asyncio.

    ``ConfigError`` for ``uvloop`` where it is not installed, or for an unknown name."""
    if name not in LOOPS:
        raise ConfigError(f"--loop must be one of {', '.join(LOOPS)}, not {name!r}")
    available = importlib.util.find_spec("uvloop") is not None
    if name == "uvloop" and not available:
        raise ConfigError("--loop uvloop: uvloop is not installed (pip install uvloop; it needs CPython on Linux "
                          "or macOS); --loop asyncio runs without it")
    if name == "asyncio" or not available:
        return "asyncio"
    return "uvloop"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for ``asyncio.Runner`` (None: asyncio's default loop)."""
    if resolve_loop(name) == "asyncio":
        return None
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``loop`` names."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)
