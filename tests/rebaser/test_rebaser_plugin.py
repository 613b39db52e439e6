"""The Rebaser as a keyqueue plugin: its entry point, `keyqueue worker`, and its command.

The entry point is declared in contrib/rebaser/pyproject.toml; ``make`` installs that
distribution (``keyqueue-rebaser``, package ``keyqueue_rebaser``), so every app that loads
entry-point plugins here gets the ``keyqueue rebaser`` commands, and no app gets the queue
unless it asks for it with ``RebaserPlugin()``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import keyqueue
from keyqueue.cli import main
from keyqueue.plugins.manager import PluginManager
from keyqueue_rebaser import RebaserClient, RebaserPlugin, Update

KEYQUEUE = Path(sys.executable).with_name("keyqueue")


@pytest.fixture
def autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry-point plugins load (whatever the environment the tests run in says)."""
    monkeypatch.delenv("KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.fixture
async def host_app(nats_url: str, autoload: None) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("host", url=nats_url, set_as_default=False)
    yield app
    await app.close()


def test_the_entry_point_adds_the_commands_but_no_queue(host_app: keyqueue.App) -> None:
    listing = {info.name: info for info in PluginManager(autoload=True).listing()}
    assert listing["rebaser"].distribution == "keyqueue-rebaser 0.1.0"
    assert set(listing["rebaser"].hooks) == {"keyqueue_add_commands"}
    assert "rebaser" not in host_app.queues, "an installed plugin made every app serve its queue"
    assert "rebaser" in CliRunner().invoke(main, ["--help"]).output


async def test_an_app_that_asks_for_the_rebaser_serves_it(nats_url: str, autoload: None) -> None:
    app = keyqueue.App("host", url=nats_url, plugins=[RebaserPlugin()], set_as_default=False)
    assert "rebaser" in app.queues
    async with app, app.worker(queues=["rebaser"], name="host-worker"), \
            await RebaserClient.connect(nats_url) as client:
        response = await client.enqueue_updates("w", "cs", [Update.add_node("a", 1)], await_dvu=True)
        state = await client.snapshot("w", "cs")
    assert response.ok and response.dvu_run == 1
    assert state.dvu_history[0].worker == "host-worker", "the DVU run records the worker that ran it"


def test_registering_explicitly_and_by_entry_point_is_harmless(autoload: None) -> None:
    app = keyqueue.App("both", plugins=[RebaserPlugin()], set_as_default=False)
    assert app.queues == ["rebaser"]


async def test_the_show_command_prints_a_change_set(nats_url: str, autoload: None) -> None:
    app = keyqueue.App("host", url=nats_url, plugins=[RebaserPlugin()], set_as_default=False)
    async with app, app.worker(queues=["rebaser"]), await RebaserClient.connect(nats_url) as client:
        await client.enqueue_updates("w", "cs", [Update.add_node("a", 2), Update.add_node("b"),
                                                 Update.add_dependency("b", "sum", ["a", "a"])], await_dvu=True)
    # The command runs its own event loop: give it a thread.
    shown = await asyncio.to_thread(CliRunner().invoke, main, ["rebaser", "show", "w", "cs", "--url", nats_url])
    assert shown.exit_code == 0, shown.output
    assert "b = sum(a, a): 4" in shown.output and "DVU: 1 runs for 1 triggers" in shown.output


async def test_keyqueue_worker_serves_the_rebaser_app_from_any_directory(nats_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    worker = await asyncio.create_subprocess_exec(
        str(KEYQUEUE), "worker", "keyqueue_rebaser.app:app", "--url", nats_url, "--concurrency", "8", cwd=tmp_path,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async with await RebaserClient.connect(nats_url, timeout=30) as client:
            response = await client.enqueue_updates("w", "cli", [Update.add_node("a", 1)], await_dvu=True)
        assert response.ok and response.dvu_run == 1
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(worker.communicate(), 30)
    assert worker.returncode == 0, stderr.decode()[-2000:]
