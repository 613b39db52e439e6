"""Checking a task's arguments against simple annotations when they are enqueued, not when they run.

A request whose arguments do not fit the function would otherwise be stored, fail on every
attempt and be dead-lettered; checked here, ``enqueue`` refuses it at once with a ``TypeError``
naming the parameter (like a missing argument).

Checked annotations: ``int`` (not ``bool``), ``float`` (an ``int`` too), ``str``, ``bool``,
``bytes``, ``datetime``, ``None``, unions of these (``X | None``), ``list[X]`` / ``tuple[X, ...]``
(a list or a tuple: either travels as an array), ``dict[str, X]``, bare ``list`` / ``tuple`` /
``dict``, and frozen dataclasses (an instance, or a map of its fields). Anything else (``Any``,
``Sequence[int]``, a ``Literal``, a class keyqueue does not encode...) is not checked, and neither
is a union with such an arm or a container's items of such a type. The checks are built once per
task.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

__all__ = ["ArgumentTypes", "check_value", "type_check"]

_Mismatch = tuple[str, str, Any]
"""Where in the value the mismatch is (``"[2]"``; ``""`` for the value itself), the type expected
there, and the value found there."""

_Check = Callable[[Any], _Mismatch | None]

_SCALARS: Final[dict[Any, Callable[[Any], bool]]] = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, bytes),
    datetime: lambda v: isinstance(v, datetime),
    type(None): lambda v: v is None,
    None: lambda v: v is None,
}


class ArgumentTypes:
    """The checks of one function's parameters, built from its resolved annotations."""

    def __init__(self, task: str, parameters: Mapping[str, inspect.Parameter], hints: Mapping[str, Any]) -> None:
        self.task = task
        self.checks: dict[str, _Check] = {}
        for name, param in parameters.items():
            if name not in hints:
                continue
            check = type_check(hints[name])
            if check is None:
                continue
            # The annotation of *args / **kwargs is each item's: the argument is their tuple / dict.
            if param.kind is param.VAR_POSITIONAL:
                check = _items(check, "tuple")
            elif param.kind is param.VAR_KEYWORD:
                check = _values(check, "dict")
            self.checks[name] = check

    def check(self, arguments: Mapping[str, Any]) -> None:
        """Raise ``TypeError`` naming the first argument that does not fit its annotation."""
        for name, value in arguments.items():
            check = self.checks.get(name)
            if check is not None:
                check_value(check, value, f"{self.task}(): argument {name!r}")


def check_value(check: _Check, value: Any, what: str) -> None:
    """Raise ``TypeError`` (``<what>[2] must be int, not str``) unless ``value`` passes ``check``."""
    mismatch = check(value)
    if mismatch is not None:
        where, expected, found = mismatch
        raise TypeError(f"{what}{where} must be {expected}, not {type(found).__name__}")


def type_check(hint: Any) -> _Check | None:
    """A check of values against ``hint``, or ``None`` if ``hint`` is not one that is checked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    shown = _show(hint)
    if hint is None or (isinstance(hint, type) and not args and hint in _SCALARS):
        return _is(_SCALARS[hint], shown)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        accepted = (hint, Mapping)
        return _is(lambda v: isinstance(v, accepted), f"{shown} (or a map of its fields)")
    if origin in (typing.Union, types.UnionType):
        arms = [type_check(arm) for arm in args]
        if any(arm is None for arm in arms):
            return None
        return _union(typing.cast(list[_Check], arms), shown)
    if hint in (list, tuple) or origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return _items(type_check(args[0]) if args else None, shown)
    if origin is tuple:
        return _items(None, shown)
    if hint is dict or (origin is dict and args and args[0] is str):
        return _values(type_check(args[1]) if args else None, shown)
    return None


def _show(hint: Any) -> str:
    """``hint`` as it reads in code (``list[Reading] | None``), without module paths."""
    if hint is None or hint is type(None):
        return "None"
    if hint is Ellipsis:
        return "..."
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_show(arm) for arm in args)
    if origin is not None and args:
        return f"{_show(origin)}[{', '.join(_show(arg) for arg in args)}]"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _is(test: Callable[[Any], bool], shown: str) -> _Check:
    return lambda value: None if test(value) else ("", shown, value)


def _union(arms: list[_Check], shown: str) -> _Check:
    def check(value: Any) -> _Mismatch | None:
        mismatches = []
        for arm in arms:
            if (mismatch := arm(value)) is None:
                return None
            mismatches.append(mismatch)
        # An arm that took the value itself but not one of its items says best what is wrong.
        inside = [mismatch for mismatch in mismatches if mismatch[0]]
        return inside[0] if len(inside) == 1 else ("", shown, value)

    return check


def _items(item: _Check | None, shown: str) -> _Check:
    def check(value: Any) -> _Mismatch | None:
        if not isinstance(value, list | tuple):
            return "", shown, value
        if item is not None:
            for index, element in enumerate(value):
                if (mismatch := item(element)) is not None:
                    return f"[{index}]{mismatch[0]}", mismatch[1], mismatch[2]
        return None

    return check


def _values(item: _Check | None, shown: str) -> _Check:
    def check(value: Any) -> _Mismatch | None:
        if not isinstance(value, dict):
            return "", shown, value
        if item is not None:
            for key, element in value.items():
                if (mismatch := item(element)) is not None:
                    return f"[{key!r}]{mismatch[0]}", mismatch[1], mismatch[2]
        return None

    return check
