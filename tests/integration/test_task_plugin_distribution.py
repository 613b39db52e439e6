"""Plugins installed as distributions, found through the ``keyqueue`` entry-point group.

``tests/fixtures/kq_demo_plugin`` is a tiny third-party distribution. The session fixture builds
its wheel (with the standard library: the test environment has no build backend offline) and
installs it with ``pip install --target`` into a temporary directory, which tests put on the
path. keyqueue's own plugins (keyqueue-otel, keyqueue-spark, keyqueue-rebaser) are installed by
``make``; the last test checks that an application's own packages cannot shadow them.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import keyqueue
from keyqueue.cli import main
from keyqueue.ext import OutgoingRequest, Publisher, QueueNames
from keyqueue.plugins.manager import PluginManager
from keyqueue.wire import headers as H

SOURCE = Path(__file__).parents[1] / "fixtures" / "kq_demo_plugin"
KEYQUEUE = Path(sys.executable).with_name("keyqueue")


def build_wheel(source: Path, out: Path) -> Path:
    """A pure-Python wheel of the fixture distribution, from its pyproject.toml."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    dist, version = project["name"].replace("-", "_"), project["version"]
    info = f"{dist}-{version}.dist-info"
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
        for group, points in project["entry-points"].items()
    )
    files = {
        "kq_demo_plugin.py": (source / "kq_demo_plugin.py").read_bytes(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: keyqueue-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": entry_points.encode(),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = out / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the demo plugin distribution is pip-installed into."""
    work = tmp_path_factory.mktemp("demo-plugin")
    wheel = build_wheel(SOURCE, work)
    site = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--no-index",
         "--target", str(site), str(wheel)],
        check=True,
    )
    return site


@pytest.fixture
def installed(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv("KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return plugin_site


def test_the_plugin_loads_from_its_entry_point_unless_autoload_is_off(installed: Path) -> None:
    listing = {info.name: info for info in PluginManager(autoload=True).listing()}
    assert listing["demo"].distribution == "keyqueue-demo-plugin 0.1.0"
    assert listing["demo"].hooks == ("keyqueue_add_commands", "keyqueue_register")
    assert "demo" not in {info.name for info in PluginManager(autoload=False).listing()}


@pytest.fixture
async def plugged_app(nats_url: str, installed: Path) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("host", url=nats_url, set_as_default=False)
    yield app
    await app.close()


async def test_the_plugin_registers_a_processor_that_serves_its_queue(plugged_app: keyqueue.App) -> None:
    assert "demo-plugin" in plugged_app.queues
    nc = await plugged_app.connection()
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    async with plugged_app.worker(queues=["demo-plugin"]):
        publisher = Publisher(nc, QueueNames("demo-plugin"))
        for n in range(2):
            headers = {H.MSG_ID: f"r{n}", H.REPLY_INBOX: inbox}
            await publisher.enqueue(OutgoingRequest("k1", headers, b"hi%d" % n, f"r{n}"))
        first, second = [await replies.next_msg(timeout=10) for _ in range(2)]
    assert (first.data, second.data) == (b"echo:hi0", b"echo:hi1")
    assert (first.headers or {}).get("X-Demo-Count") == "1"
    assert (second.headers or {}).get("X-Demo-Count") == "2"  # one processor for the key's session


def test_the_plugin_adds_a_command_and_autoload_off_removes_it(installed: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(main, ["plugins"])
    assert listed.exit_code == 0 and "demo (keyqueue-demo-plugin 0.1.0)" in listed.output
    assert "demo-hello" in runner.invoke(main, ["--help"]).output
    hello = runner.invoke(main, ["demo-hello", "tests"])
    assert (hello.exit_code, hello.output) == (0, "hello tests from kq_demo_plugin\n")

    off = {"KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    listed = runner.invoke(main, ["plugins"], env=off)
    assert "demo" not in listed.output and "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD is set" in listed.output
    missing = runner.invoke(main, ["demo-hello"], env=off)
    assert missing.exit_code == 2 and "No such command 'demo-hello'" in missing.output


def test_the_installed_console_script_runs_the_plugin_command(plugin_site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_site)}
    env.pop("KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD", None)
    done = subprocess.run([str(KEYQUEUE), "demo-hello"], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "hello world from kq_demo_plugin\n")


LIST_PLUGINS = """
from pathlib import Path

import contrib
import plugins

import keyqueue

for package in (plugins, contrib):  # the application's own packages are the ones on the path
    assert Path(package.__file__).resolve().parent.parent == Path.cwd().resolve(), package.__file__
for info in keyqueue.App("shop", set_as_default=False).plugins.listing():
    print(info.name, info.distribution)
"""


def test_an_apps_own_plugins_package_does_not_shadow_keyqueues_plugins(tmp_path: Path) -> None:
    """keyqueue's plugins have import names of their own (``keyqueue_otel``, ...), not ``plugins.*``."""
    for package in ("plugins", "contrib"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f'"""The application\'s own {package}."""\n')
    env = {name: value for name, value in os.environ.items() if name != "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD"}

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    listed = run("-c", LIST_PLUGINS).splitlines()
    for line in ("otel keyqueue-otel 0.1.0", "spark keyqueue-spark 0.1.0", "rebaser keyqueue-rebaser 0.1.0"):
        assert line in listed, listed
    shown = run("-m", "keyqueue", "plugins")
    assert "otel (keyqueue-otel 0.1.0)" in shown and "spark (keyqueue-spark 0.1.0)" in shown
    commands = run("-m", "keyqueue", "--help")
    assert all(command in commands for command in ("report", "backfill", "rebaser")), commands
