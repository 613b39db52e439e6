"""An app whose one task answers with the event loop its worker runs on (``tests/integration/test_event_loop.py``)."""

from __future__ import annotations

import asyncio

import keyqueue

app = keyqueue.App("loopq", set_as_default=False, autoload_plugins=False)


@app.task(key="{k}")
async def which_loop(k: str) -> str:
    return type(asyncio.get_running_loop()).__module__
