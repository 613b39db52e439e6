"""Fixtures shared by every test: a real nats-server per test on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from keyqueue.errors import ConfigError
from keyqueue.server.embedded import EmbeddedServer, find_nats_server


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For ``make test``'s parallel run (pytest-xdist, ``--dist loadgroup``): each test file runs on
    one worker process, in order, its module fixtures made once; the Spark tests all on one (one
    JVM, their shared session). The browser tests are ``serial``: they run alone after the parallel
    part (a page waited on for 20 s timed out three times when beside it)."""
    for item in items:
        path = item.path.relative_to(item.config.rootpath)
        if path.parts[:2] == ("tests", "browser"):
            item.add_marker(pytest.mark.serial)
        if item.get_closest_marker("xdist_group") is None:
            group = "spark" if path.parts[:2] == ("tests", "spark") else str(path)
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fail the whole run (never skip) when there is no usable nats-server, with the fix."""
    try:
        find_nats_server()
    except ConfigError as exc:  # ServerNotFound is a ConfigError too
        pytest.exit(
            f"keyqueue's tests need nats-server >= 2.11: {exc}", returncode=pytest.ExitCode.USAGE_ERROR
        )


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """A started single nats-server with JetStream; store and log live in ``tmp_path``."""
    server = EmbeddedServer(store_dir=tmp_path / "nats-store", log_file=tmp_path / "nats-server.log")
    async with server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedServer) -> str:
    """The ``nats://127.0.0.1:<port>`` URL of ``nats_server``."""
    return nats_server.url


@pytest.fixture
async def nats_client(nats_url: str) -> AsyncIterator[NATS]:
    """A nats-py client connected to ``nats_server``, closed after the test."""
    client = await nats.connect(nats_url, connect_timeout=2)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A connection opened the way keyqueue opens its own (``keyqueue.jetstream.connect``)."""
    from keyqueue.jetstream.connect import connect

    client = await connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
