"""Attribute functions for tests: ``slow`` makes a DVU take as long as a test needs."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from keyqueue_rebaser import FunctionRegistry, hookimpl


def slow(inputs: Sequence[Any], args: Mapping[str, Any]) -> Any:
    """Sleep ``args["seconds"]`` (in the DVU's thread), then return the sum of the inputs."""
    time.sleep(float(args.get("seconds", 1.0)))
    return sum(inputs)


@hookimpl
def rebaser_register_functions(functions: FunctionRegistry) -> None:
    functions.register("slow", slow)
