"""A retry's backoff and a rate limit's wait hold the key, not a worker slot (a parked key).

A ``keyqueue worker --concurrency 2``: two keys wait (a backoff, a rate limit) while an unrelated
key must run at once; the waiting keys stay held and ordered (nothing behind their requests runs
first, no other worker takes them)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from command_output import Command

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import keyqueue

app = keyqueue.App("parked", result_ttl=600, set_as_default=False)
seen: dict[str, int] = {}


@app.task(key="{key}", max_attempts=3, backoff=keyqueue.Backoff(base=600, jitter=0))
async def settle(key: str, n: int) -> str:
    seen[f"{key}-{n}"] = seen.get(f"{key}-{n}", 0) + 1
    print(f"attempt {key} {n} {seen[key + '-' + str(n)]}", flush=True)
    if n == 1 and seen[f"{key}-{n}"] == 1:
        raise ValueError("not yet")  # a 600 s backoff: the test never waits it out
    return f"{key}-{n}"


@app.task(key="{key}", rate_limit="1/h")
async def text(key: str, n: int) -> str:
    print(f"text {key} {n}", flush=True)
    return f"{key}-{n}"


@app.task(key="{key}")
async def quick(key: str) -> str:
    print(f"quick {key}", flush=True)
    return key
'''


def environment(nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


@pytest.fixture
async def parked(tmp_path: Path, nats_url: str) -> AsyncIterator[tuple[Any, Path]]:
    (tmp_path / "parked_app.py").write_text(APP)
    sys.path.insert(0, str(tmp_path))
    try:
        import parked_app

        parked_app.app.settings = parked_app.app.settings.with_url(nats_url)
        yield parked_app, tmp_path
        await parked_app.app.close()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("parked_app", None)


async def test_keys_in_backoff_or_rate_limited_lend_their_slots_and_stay_held(parked: tuple[Any, Path],
                                                                              nats_url: str) -> None:
    mod, folder = parked
    worker = await Command.start(KEYQUEUE, "worker", "parked_app:app", "--concurrency", "2", "--drain-timeout", "1",
                                 env=environment(nats_url), cwd=folder)
    other = None
    try:
        await worker.wait_for("serving queue parked")
        await mod.settle.enqueue(key="a", n=1)  # fails once: a 600 s backoff
        behind = await mod.settle.enqueue(key="a", n=2)  # must not overtake it
        await mod.text.enqueue(key="b", n=1)
        await mod.text.enqueue(key="b", n=2)  # waits an hour for its rate limit
        await worker.wait_for("attempt a 1 1")
        await worker.wait_for("text b 1")
        # Both slots' keys are waiting: an unrelated key runs now, not after a backoff or a rate limit.
        assert await mod.quick.call(key="c", timeout=20) == "c"
        # The waiting keys are still held: a second worker cannot take them, so a's second request
        # has not run (here or there), and neither has b's.
        other = await Command.start(KEYQUEUE, "worker", "parked_app:app", env=environment(nats_url), cwd=folder)
        await other.wait_for("serving queue parked")
        assert await mod.quick.call(key="d", timeout=20) == "d"
        assert not worker.matches(r"attempt a 2|text b 2") and not other.matches(r"attempt a|text b")
        assert await mod.app.status(behind.request_id) == "pending"
    finally:
        assert await worker.stop() == 0  # the drain cuts the waits short: the requests stay, in order
        if other is not None:
            await other.stop()
