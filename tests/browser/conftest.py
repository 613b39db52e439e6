"""The dashboard in a real browser: a nats-server, a worker and ``keyqueue dashboard`` as processes,
and headless Chromium (Debian's ``chromium`` and ``chromium-driver``; ``make chromium-check``
installs them) driven through Selenium at 1280x800.

Screenshots go to a temporary directory, or to ``docs/images`` with ``KEYQUEUE_SCREENSHOTS=1``
(how the pictures in docs/dashboard.md are made).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_pages import KEYQUEUE, ROOT, environment, make_browser, start_dashboard
from command_output import Command
from dashboard_app import build
from selenium.webdriver.remote.webdriver import WebDriver

import keyqueue


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    driver = make_browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shot(tmp_path: Path) -> Callable[[WebDriver, str], Path]:
    """``shot(driver, name)`` saves ``dashboard-<name>.png`` (in docs/images with KEYQUEUE_SCREENSHOTS=1)."""
    folder = ROOT / "docs" / "images" if os.environ.get("KEYQUEUE_SCREENSHOTS") == "1" else tmp_path

    def save(driver: WebDriver, name: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"dashboard-{name}.png"
        driver.save_screenshot(str(path))
        return path

    return save


@pytest.fixture
async def producer(nats_url: str) -> AsyncIterator[tuple[keyqueue.App, dict[str, Any]]]:
    """The browser tests' app (``dashboard_app``) on the test's server, to enqueue with: (app, tasks by name)."""
    app, tasks = build(nats_url)
    try:
        yield app, tasks
    finally:
        await app.close()


@pytest.fixture
async def worker(nats_url: str) -> AsyncIterator[Command]:
    """``keyqueue worker tests.browser.dashboard_app:app`` named ``web-1``, serving queue shop."""
    proc = await Command.start(str(KEYQUEUE), "worker", "tests.browser.dashboard_app:app", "--concurrency", "4",
                               "--name", "web-1", "--drain-timeout", "0", env=environment(KEYQUEUE_URL=nats_url),
                               cwd=ROOT)
    try:
        await proc.wait_for(r"serving queue shop")
        yield proc
    finally:
        await proc.stop()


@pytest.fixture
async def dashboard(nats_url: str, worker: Command) -> AsyncIterator[str]:
    """The base URL of a ``keyqueue dashboard`` on the test's server (with the worker running)."""
    proc, base = await start_dashboard(nats_url)
    try:
        yield base
    finally:
        await proc.stop()
