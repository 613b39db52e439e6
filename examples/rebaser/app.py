"""The demo's worker app: the Rebaser plugin, plus one costly attribute function.

    keyqueue worker examples.rebaser.app:app --url nats://127.0.0.1:4222

``digest`` stands for the expensive functions a real graph has (a template render, a schema
check): it takes a few milliseconds, so a DVU takes long enough for a burst of requests to land
while it runs, and coalescing shows.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import keyqueue
from keyqueue_rebaser import FunctionRegistry, RebaserPlugin, hookimpl, load_functions

DIGEST_SECONDS = 0.05
"""What one ``digest`` costs."""


def digest(inputs: Sequence[Any], args: Mapping[str, Any]) -> str:
    """A short hash of the inputs' text; slow on purpose (it runs in the DVU's thread)."""
    time.sleep(DIGEST_SECONDS)
    return hashlib.sha256(repr(list(inputs)).encode()).hexdigest()[:12]


class DemoFunctions:
    """A plugin of the Rebaser's own hook: it adds ``digest``."""

    @hookimpl
    def rebaser_register_functions(self, functions: FunctionRegistry) -> None:
        functions.register("digest", digest)


FUNCTIONS = load_functions([DemoFunctions()], autoload=False)
"""The built-ins and ``digest``: what the workers run and what the demo checks against."""

app = keyqueue.App("rebaser-demo", plugins=[RebaserPlugin(functions=FUNCTIONS)], autoload_plugins=False,
                   set_as_default=False)
