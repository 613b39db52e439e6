"""The sync face against a ``keyqueue worker`` process, from threads as a Django view calls it
(docs/web.md): call, result by id, cancel and status without an event loop; a
status that tells every state apart; lookups without the queue name; cancelling an unknown id;
``call`` with a kept result made again."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from command_output import Command

import keyqueue

T = TypeVar("T")

APP = '''
import time
from pathlib import Path

import keyqueue

app = keyqueue.App("views", result_ttl=600, set_as_default=False)
GATE = Path(__file__).with_name("gate")
RUNS = Path(__file__).with_name("runs")


@app.task(key="{order}", max_attempts=1)
def charge(order: str, amount: int) -> dict:
    with RUNS.open("a") as runs:
        runs.write(f"{order} {amount}\\n")
    if amount < 0:
        raise ValueError(f"cannot charge {amount}")
    return {"order": order, "charged": amount}


@app.task(key="{order}")
def hold(order: str) -> str:
    while not GATE.exists():  # the test opens the gate
        time.sleep(0.02)
    return "released"


@app.task(key="{order}", queue="notes")
def note(order: str) -> str:
    return order
'''


def _env(nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


@pytest.fixture
async def views(tmp_path: Path, nats_url: str) -> AsyncIterator[tuple[Any, Path]]:
    """The app module (imported here too, as a web process imports it) and a worker process serving it."""
    (tmp_path / "views_app.py").write_text(APP)
    sys.path.insert(0, str(tmp_path))
    os.environ["KEYQUEUE_URL"] = nats_url
    try:
        import views_app

        worker = await Command.start(str(Path(sys.executable).with_name("keyqueue")), "worker", "views_app:app",
                                     env=_env(nats_url), cwd=tmp_path)
        await worker.wait_for(r"serving queue views")
        await worker.wait_for(r"serving queue notes")
        try:
            yield views_app, tmp_path
        finally:
            await worker.stop()
            views_app.app._sync.close_sync()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("views_app", None)
        del os.environ["KEYQUEUE_URL"]


async def in_thread(fn: Callable[[], T]) -> T:
    """Run sync code in a thread, as a threaded web server runs a view."""
    return await asyncio.to_thread(fn)


def wait_for_status(app: keyqueue.App, request_id: str, wanted: str) -> None:
    deadline = time.monotonic() + 20
    while (now := app.status_sync(request_id)) != wanted:
        assert time.monotonic() < deadline, f"request {request_id} stayed {now!r}, never {wanted!r}"


async def test_a_sync_view_calls_waits_cancels_and_asks_the_status_of_requests(views: tuple[Any, Path]) -> None:
    mod, folder = views
    app, charge, hold = mod.app, mod.charge, mod.hold

    def view() -> None:
        assert charge.call_sync(order="o1", amount=5, timeout=20) == {"order": "o1", "charged": 5}
        # Threads of one process share the app's sync connection.
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda n: charge.call_sync(order=f"t{n}", amount=n, timeout=20), range(8)))
        assert [r["charged"] for r in results] == list(range(8))

        held = hold.delay(order="o2")
        wait_for_status(app, held.request_id, "running")
        behind = charge.delay(order="o2", amount=7)
        # By id alone, in whichever of the app's queues it is (views or notes).
        assert app.status_sync(behind.request_id) == "pending"
        assert behind.status_sync() == "pending"
        later = charge.delay(order="o2", amount=8)
        assert app.cancel_sync(later.request_id) == "pending"
        assert app.status_sync(later.request_id) == "cancelled"
        scheduled = charge.options(countdown=600).delay(order="o3", amount=1)
        assert app.status_sync(scheduled.request_id) == "scheduled"
        assert app.status_sync("never-seen") == "unknown"

        (folder / "gate").touch()
        assert held.result_sync(timeout=20) == "released"
        assert app.result_sync(behind.request_id, timeout=20) == {"order": "o2", "charged": 7}
        with pytest.raises(keyqueue.Cancelled):
            app.result_sync(later.request_id, timeout=20)
        failed = charge.delay(order="o4", amount=-1)
        with pytest.raises(keyqueue.DeadLettered, match="cannot charge -1"):
            failed.result_sync(timeout=20)
        assert [app.status_sync(r.request_id) for r in (held, behind, later, failed)] == [
            "done", "done", "cancelled", "failed"]

    await in_thread(view)


async def test_cancelling_an_unknown_id_says_so_and_leaves_the_id_usable(views: tuple[Any, Path],
                                                                         nats_url: str) -> None:
    mod, _ = views
    app, charge = mod.app, mod.charge

    def view() -> None:
        assert app.cancel_sync("order-9-charge", queue="views") == "unknown"
        # The id was not poisoned: enqueued later, it runs (the workers forgot the withdrawn cancel).
        receipt = charge.options(request_id="order-9-charge").delay(order="o9", amount=9)
        assert receipt.duplicate is False
        assert receipt.result_sync(timeout=20) == {"order": "o9", "charged": 9}

    await in_thread(view)
    cli = await Command.start(str(Path(sys.executable).with_name("keyqueue")), "cancel", "views", "no-such-id",
                              env=_env(nats_url))
    assert await cli.wait() == 1
    assert cli.lines[0] == "unknown"
    assert "no request no-such-id found in queue 'views': nothing was cancelled" in cli.output


async def test_call_made_again_with_the_same_request_id_returns_the_kept_result(views: tuple[Any, Path]) -> None:
    mod, folder = views
    charge = mod.charge

    def view() -> None:
        first = charge.options(request_id="pay-o5-1").call_sync(order="o5", amount=5, timeout=20)
        again = charge.options(request_id="pay-o5-1").call_sync(order="o5", amount=5, timeout=20)
        assert first == again == {"order": "o5", "charged": 5}

    await in_thread(view)
    assert (folder / "runs").read_text().splitlines().count("o5 5") == 1  # it ran once
