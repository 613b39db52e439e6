"""Attribute functions: how a computed node's value follows from its inputs.

A function is a plain, pure, synchronous callable ``fn(inputs, args) -> value``: ``inputs`` are the
input nodes' values in the order the dependency lists them, ``args`` the dependency's fixed
arguments. Raising is how a function says it cannot compute a value; the DVU then records the
error on the node (its value becomes ``None``) and carries on. Functions run in a worker thread,
so a slow one does not stall the worker's event loop (which would cost it its keys' leases).

The registry starts with :data:`BUILTINS` and is extended through the ``rebaser`` pluggy hook
``rebaser_register_functions(functions)``: from plugin objects passed to :func:`load_functions`
and from the entry-point group ``keyqueue.rebaser``::

    from keyqueue_rebaser import hookimpl

    @hookimpl
    def rebaser_register_functions(functions):
        functions.register("double", lambda inputs, args: 2 * inputs[0])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import pluggy

from keyqueue import ConfigError

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "Function",
    "FunctionRegistry",
    "hookimpl",
    "hookspec",
    "load_functions",
]

Function = Callable[[Sequence[Any], Mapping[str, Any]], Any]
"""``fn(inputs, args) -> value``; raise to report that the value cannot be computed."""

PROJECT: Final = "rebaser"
"""pluggy project name of the Rebaser's own hooks."""

ENTRY_POINT_GROUP: Final = "keyqueue.rebaser"
"""Entry-point group of packages that add attribute functions."""

DISABLE_AUTOLOAD_ENV: Final = "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD"
"""keyqueue's switch for entry-point plugins; it turns these off too."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a Rebaser hook implementation (``rebaser_register_functions``)."""


class RebaserHooks:
    """The Rebaser's hook specifications."""

    @hookspec
    def rebaser_register_functions(self, functions: FunctionRegistry) -> None:
        """Add attribute functions with ``functions.register(name, fn)``.

        Fires once per :func:`load_functions` call (once per worker process). Sync. The return
        value is ignored.
        """


class FunctionRegistry:
    """Attribute functions by name."""

    def __init__(self, functions: Mapping[str, Function] | None = None) -> None:
        self._functions: dict[str, Function] = {}
        for name, fn in (functions or {}).items():
            self.register(name, fn)

    def register(self, name: str, fn: Function, *, replace: bool = False) -> None:
        """Add ``fn`` as ``name``; registering a taken name is an error unless ``replace``."""
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise ConfigError(f"function name {name!r} is not valid: start with a letter, then letters, digits, _.-")
        if not callable(fn):
            raise ConfigError(f"function {name!r} is not callable: {fn!r}")
        if name in self._functions and not replace and self._functions[name] is not fn:
            raise ConfigError(f"attribute function {name!r} is registered twice; pass replace=True to override it")
        self._functions[name] = fn

    def get(self, name: str) -> Function:
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(f"unknown function {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions


# --- the built-in functions ----------------------------------------------------------------------


def _numbers(inputs: Sequence[Any]) -> list[int | float]:
    for position, value in enumerate(inputs):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"input {position} is {value!r}, not a number")
    return list(inputs)


def identity(inputs: Sequence[Any], args: Mapping[str, Any]) -> Any:
    """The single input's value."""
    if len(inputs) != 1:
        raise ValueError(f"identity takes exactly one input, got {len(inputs)}")
    return inputs[0]


def sum_(inputs: Sequence[Any], args: Mapping[str, Any]) -> int | float:
    """The sum of numeric inputs (0 for none)."""
    return sum(_numbers(inputs), start=args.get("start", 0))


def concat(inputs: Sequence[Any], args: Mapping[str, Any]) -> str:
    """The inputs as text joined by ``args["sep"]`` (default empty); ``None`` is refused."""
    if any(value is None for value in inputs):
        raise ValueError("concat of a value that is None")
    return str(args.get("sep", "")).join(str(value) for value in inputs)


def min_(inputs: Sequence[Any], args: Mapping[str, Any]) -> int | float:
    """The smallest numeric input; no inputs is an error."""
    if not inputs:
        raise ValueError("min of no inputs")
    return min(_numbers(inputs))


def max_(inputs: Sequence[Any], args: Mapping[str, Any]) -> int | float:
    """The largest numeric input; no inputs is an error."""
    if not inputs:
        raise ValueError("max of no inputs")
    return max(_numbers(inputs))


_PLACEHOLDER: Final = re.compile(r"\{(\d+)\}")


def template(inputs: Sequence[Any], args: Mapping[str, Any]) -> str:
    """``args["text"]`` with each ``{i}`` replaced by input ``i`` (no other formatting: it is data)."""
    text = args.get("text")
    if not isinstance(text, str):
        raise ValueError('template needs args["text"], a string with {0}, {1}, ... placeholders')

    def fill(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index >= len(inputs):
            raise IndexError(f"template refers to input {index} but has {len(inputs)} input(s)")
        return str(inputs[index])

    return _PLACEHOLDER.sub(fill, text)


BUILTINS: Final[Mapping[str, Function]] = {
    "identity": identity,
    "sum": sum_,
    "concat": concat,
    "min": min_,
    "max": max_,
    "template": template,
}
"""The functions every Rebaser knows."""


def load_functions(plugins: Iterable[object] = (), *, autoload: bool = True,
                   environ: Mapping[str, str] | None = None) -> FunctionRegistry:
    """The built-ins plus what plugins add through ``rebaser_register_functions``.

    Entry-point plugins (group ``keyqueue.rebaser``) load unless ``autoload`` is false or
    ``KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD`` is set; ``plugins`` are registered after them.
    """
    import os

    registry = FunctionRegistry(BUILTINS)
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(RebaserHooks)
    switch = (os.environ if environ is None else environ).get(DISABLE_AUTOLOAD_ENV, "")
    if autoload and switch.strip().lower() in ("", "0", "false", "no"):
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in plugins:
        manager.register(plugin)
    manager.hook.rebaser_register_functions(functions=registry)
    return registry
