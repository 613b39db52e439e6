"""The app ``python -m bench.user_path`` serves with ``keyqueue worker``: one no-op keyed task."""

from __future__ import annotations

import keyqueue

app = keyqueue.App("userpath", set_as_default=False)  # a library of the bench: not the process's default app


@app.task(key="{k}")
async def note(k: str, i: int) -> None:
    """Does nothing: the figure is what keyqueue itself costs per request."""
