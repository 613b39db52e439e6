"""A process whose wall clock is wrong: a chaos worker's ``--clock-offset``.

Hosts' clocks disagree; keyqueue's safety must not depend on them agreeing (docs/architecture.md,
"Fencing"). :func:`skew_wall_clock` moves this process's wall clock by ``offset`` seconds, the way
a host whose clock is ahead (positive) or behind (negative) sees time:

- ``time.time`` and ``time.time_ns`` return the true time plus the offset;
- ``datetime.datetime.now`` and ``utcnow`` do too: the ``datetime`` module's class and every
  loaded ``keyqueue`` module's own ``datetime`` name are replaced by a subclass that only
  overrides those two methods (``isinstance`` with it still accepts every ``datetime``).

Monotonic clocks are left alone: they measure intervals, and a host's do not jump. The chaos run
log must stay on the true clock (one time base for every process): take :data:`TRUE_TIME`,
captured when this module is imported, before any skew.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["TRUE_TIME", "skew_wall_clock"]

TRUE_TIME: Final[Callable[[], float]] = time.time
"""``time.time`` as it was on import: the true wall clock, whatever offset is applied later."""

_TRUE_TIME_NS: Final = time.time_ns
_REAL_DATETIME: Final[type[_dt.datetime]] = _dt.datetime


class _AnyDatetime(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _REAL_DATETIME)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _REAL_DATETIME)


def skew_wall_clock(offset: float) -> None:
    """Make this process's wall clock run ``offset`` seconds ahead (negative: behind) of the true one."""
    if not offset:
        return
    shift = _dt.timedelta(seconds=offset)
    offset_ns = int(offset * 1_000_000_000)

    class SkewedDatetime(_dt.datetime, metaclass=_AnyDatetime):
        """``datetime`` whose ``now`` and ``utcnow`` read the skewed clock."""

        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> Any:
            return _REAL_DATETIME.now(tz) + shift

        @classmethod
        def utcnow(cls) -> Any:
            return _REAL_DATETIME.now(_dt.UTC).replace(tzinfo=None) + shift

    time.time = lambda: TRUE_TIME() + offset
    time.time_ns = lambda: _TRUE_TIME_NS() + offset_ns
    _dt.datetime = SkewedDatetime  # type: ignore[misc]
    for name, module in list(sys.modules.items()):
        if (name == "keyqueue" or name.startswith("keyqueue.")) and getattr(module, "datetime", None) is _REAL_DATETIME:
            module.datetime = SkewedDatetime  # type: ignore[attr-defined]
