"""The Rebaser as a keyqueue plugin: its entry point, `keyqueue worker`, and its command.

The entry point is declared in contrib/rebaser/pyproject.toml. The tests install a wheel holding
just that distribution's metadata (the code is importable from the repository root, as in an
editable install) with ``pip install --target``, as keyqueue's own plugin-distribution tests do.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import signal
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import keyqueue
from contrib.rebaser import RebaserClient, RebaserPlugin, Update
from keyqueue.cli import main
from keyqueue.plugins.manager import PluginManager

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "contrib" / "rebaser" / "pyproject.toml"
KEYQUEUE = Path(sys.executable).with_name("keyqueue")


def metadata_wheel(out: Path) -> Path:
    """A wheel with the keyqueue-rebaser distribution's metadata and entry points (no code)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    dist, version = project["name"].replace("-", "_"), project["version"]
    info = f"{dist}-{version}.dist-info"
    entry_points = "".join(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
                           for group, points in project["entry-points"].items())
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: keyqueue-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": entry_points.encode(),
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for name, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = out / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture(scope="module")
def rebaser_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("rebaser-dist")
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-index", "--target", str(site), str(metadata_wheel(work))], check=True)
    return site


@pytest.fixture
def installed(rebaser_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(rebaser_site))
    monkeypatch.delenv("KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return rebaser_site


@pytest.fixture
async def host_app(nats_url: str, installed: Path) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("host", url=nats_url, set_as_default=False)
    yield app
    await app.close()


async def test_the_entry_point_adds_the_rebaser_queue_to_any_app(host_app: keyqueue.App, nats_url: str) -> None:
    listing = {info.name: info for info in PluginManager(autoload=True).listing()}
    assert listing["rebaser"].distribution == "keyqueue-rebaser 0.1.0"
    assert set(listing["rebaser"].hooks) == {"keyqueue_register", "keyqueue_build_processor", "keyqueue_add_commands"}
    assert "rebaser" in host_app.queues
    async with host_app.worker(queues=["rebaser"], name="host-worker"), await RebaserClient.connect(nats_url) as client:
        response = await client.enqueue_updates("w", "cs", [Update.add_node("a", 1)], await_dvu=True)
        state = await client.snapshot("w", "cs")
    assert response.ok and response.dvu_run == 1
    assert state.dvu_history[0].worker == "host-worker", "the DVU run records the worker that ran it"


def test_registering_explicitly_and_by_entry_point_is_harmless(installed: Path) -> None:
    app = keyqueue.App("both", plugins=[RebaserPlugin()], set_as_default=False)
    assert app.queues == ["rebaser"]


async def test_the_show_command_prints_a_change_set(host_app: keyqueue.App, nats_url: str) -> None:
    async with host_app.worker(queues=["rebaser"]), await RebaserClient.connect(nats_url) as client:
        await client.enqueue_updates("w", "cs", [Update.add_node("a", 2), Update.add_node("b"),
                                                 Update.add_dependency("b", "sum", ["a", "a"])], await_dvu=True)
    # The command runs its own event loop: give it a thread.
    shown = await asyncio.to_thread(CliRunner().invoke, main, ["rebaser", "show", "w", "cs", "--url", nats_url])
    assert shown.exit_code == 0, shown.output
    assert "b = sum(a, a): 4" in shown.output and "DVU: 1 runs for 1 triggers" in shown.output


async def test_keyqueue_worker_serves_the_rebaser_app(nats_url: str) -> None:
    env = {**os.environ, "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    worker = await asyncio.create_subprocess_exec(
        str(KEYQUEUE), "worker", "contrib.rebaser.app:app", "--url", nats_url, "--concurrency", "8", cwd=ROOT,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async with await RebaserClient.connect(nats_url, timeout=30) as client:
            response = await client.enqueue_updates("w", "cli", [Update.add_node("a", 1)], await_dvu=True)
        assert response.ok and response.dvu_run == 1
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(worker.communicate(), 30)
    assert worker.returncode == 0, stderr.decode()[-2000:]
