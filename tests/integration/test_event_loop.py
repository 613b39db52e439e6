"""``keyqueue worker --loop``: the worker runs its queues on the loop asked for (uvloop or asyncio's own)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from command_output import Command

from keyqueue.app.event_loop import resolve_loop

ROOT = Path(__file__).parents[2]
PROCS = ROOT / "tests" / "procs"
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

pytestmark = pytest.mark.skipif(resolve_loop("auto") != "uvloop", reason="uvloop is not installed here")


@pytest.mark.parametrize(("loop", "module"), [("uvloop", "uvloop"), ("auto", "uvloop"), ("asyncio", "asyncio")])
async def test_the_worker_serves_its_queues_on_the_loop_asked_for(nats_url: str, loop: str, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, PYTHONPATH=str(PROCS))
    worker = await Command.start(KEYQUEUE, "worker", "loop_app:app", "--loop", loop, env=env, cwd=ROOT)
    sys.path.insert(0, str(PROCS))
    from loop_app import app, which_loop  # type: ignore[import-not-found]

    app.settings = app.settings.with_url(nats_url)
    try:
        await worker.wait_for(r"queue loopq")
        answered = await which_loop.call(k="a", timeout=30)
        assert answered.split(".")[0] == module, answered
    finally:
        await app.close()
        with contextlib.suppress(ProcessLookupError):
            await worker.stop()
