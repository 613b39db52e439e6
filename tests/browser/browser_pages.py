"""Helpers of the dashboard's browser tests: starting Chromium and the dashboard, waiting on pages."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from command_output import Command
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

ROOT = Path(__file__).resolve().parents[2]
KEYQUEUE = Path(sys.executable).with_name("keyqueue")
WIDTH, HEIGHT = 1280, 800


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(values)
    return env


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.fail("the dashboard's browser tests need Debian's chromium and chromium-driver: run `make "
                    "chromium-check` (or apt-get install chromium chromium-driver)")
    return browser, driver


def make_browser(*, javascript: bool = True, args: tuple[str, ...] = ()) -> WebDriver:
    """Headless Chromium at WIDTH x HEIGHT; ``args`` are more command-line switches (a host resolver rule...)."""
    browser, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars", "--force-device-scale-factor=1", *args):
        options.add_argument(arg)
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def wait_until(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str, timeout: float = 15) -> Any:
    """Wait for ``condition`` (an explicit wait on what the page shows), failing with ``what``."""
    # The page's live region is replaced on each refresh: an element found a moment ago may be gone.
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(condition, message=what)


async def until(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str, timeout: float = 20) -> Any:
    """``wait_until`` from a test's event loop (the browser is driven in a thread meanwhile)."""
    return await asyncio.to_thread(wait_until, driver, condition, what, timeout)


def click(driver: WebDriver, css: str, what: str) -> None:
    """Click what ``css`` selects, finding it again if a live refresh replaced it meanwhile."""

    def clicked(d: WebDriver) -> bool:
        d.find_element(By.CSS_SELECTOR, css).click()
        return True

    WebDriverWait(driver, 15, poll_frequency=0.1,
                  ignored_exceptions=(StaleElementReferenceException, NoSuchElementException)).until(clicked, what)


def text_of(driver: WebDriver, css: str) -> str:
    """The text of the first element ``css`` selects ("" if none), read again if a live refresh
    replaced the element while it was read."""
    for _ in range(10):
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            return found[0].text if found else ""
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{css!r} kept being replaced while it was read")


def texts_of(driver: WebDriver, css: str) -> list[str]:
    """The text of every element ``css`` selects, read in one step of the page's own script: a live
    refresh replaces the region between two WebDriver calls, and a row of cells read one call each
    can go stale on every try under load (seen: 20 s of tries, none whole)."""
    texts = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText.trim());", css)
    return [str(t) for t in texts]


def number_in(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


async def start_dashboard(nats_url: str, *args: str, env: dict[str, str] | None = None) -> tuple[Command, str]:
    """A running ``keyqueue dashboard`` on a free port, and its base URL."""
    proc = await Command.start(str(KEYQUEUE), "dashboard", "--port", "0", "--refresh", "0.5", *args,
                               env=environment(KEYQUEUE_URL=nats_url, **(env or {})), cwd=ROOT)
    [match] = await proc.wait_for(r"keyqueue dashboard on (http://\S+/)")
    return proc, match.group(1).rstrip("/")
