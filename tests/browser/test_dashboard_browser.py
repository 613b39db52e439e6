"""The dashboard as a person sees it: headless Chromium on pages served by ``keyqueue dashboard``,
with a real nats-server and a real worker. Each test waits for what the page shows (explicit
waits on a condition), never for a fixed time."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from browser_pages import click, make_browser, number_in, start_dashboard, text_of, texts_of, until
from command_output import Command
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

Shot = Callable[[WebDriver, str], Path]


def seconds_in(driver: WebDriver, css: str) -> float | None:
    """The ``data-seconds`` of what ``css`` selects, when it holds a number (read again if a live
    refresh replaced the element while it was read)."""
    for _ in range(10):
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            return float(found[0].get_attribute("data-seconds") or "") if found else None
        except StaleElementReferenceException:
            continue
        except ValueError:
            return None
    raise AssertionError(f"{css!r} kept being replaced while it was read")


async def test_overview_counts_move_live(browser: WebDriver, dashboard: str, producer: Any, shot: Shot) -> None:
    _, tasks = producer
    browser.get(dashboard + "/")
    await until(browser, lambda d: text_of(d, '[data-queue="shop"] [data-testid="workers"]') == "1",
                "the overview shows the queue with its one live worker")
    await until(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "connected",
                "the page listens for live updates")
    before = number_in(text_of(browser, '[data-queue="shop"] [data-testid="dlq"]'))
    assert before == 0
    await tasks["hold"].enqueue(order_id="o-held", seconds=20)
    await tasks["pay"].enqueue(order_id="o-dead", amount=5)
    # No reload: the counters change on the page that is already open.
    await until(browser, lambda d: text_of(d, '[data-queue="shop"] [data-testid="dlq"]') == "1",
                "the DLQ count moves to 1 without a reload")
    await until(browser, lambda d: text_of(d, '[data-queue="shop"] [data-testid="held"]') == "1",
                "the held-keys count moves to 1 without a reload")
    for i in range(40):
        await tasks["touch"].enqueue(order_id=f"o{i}")
    await until(browser, lambda d: float(text_of(d, '[data-queue="shop"] [data-testid="done-rate"]') or 0) > 0,
                "requests per second move above zero")
    # Wait (enqueue to start) and run (start to finish) percentiles, from the requests that ran.
    timings = '#timings [data-queue="shop"]'
    for figure in ("wait-p50", "wait-p99", "run-p50", "run-p99"):
        await until(browser, lambda d, f=figure: seconds_in(d, f'{timings} [data-testid="{f}"]') is not None,
                    f"the overview shows the {figure} figure")
        assert number_in(text_of(browser, f'{timings} [data-testid="{figure}"]')) is not None
    assert seconds_in(browser, f'{timings} [data-testid="wait-p50"]') <= seconds_in(  # type: ignore[operator]
        browser, f'{timings} [data-testid="wait-p99"]')
    await until(browser, lambda d: (number_in(text_of(d, f'{timings} [data-testid="runs"]')) or 0) >= 40,
                "the 40 touches that ran count")
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"{timings} svg.latency"), "the timing charts")
    shot(browser, "overview")


async def test_held_key_shows_its_holder(browser: WebDriver, dashboard: str, producer: Any, worker: Command,
                                         shot: Shot) -> None:
    _, tasks = producer
    await tasks["hold"].enqueue(order_id="o-held", seconds=30)
    await tasks["hold"].enqueue(order_id="o-held", seconds=0)
    await tasks["hold"].enqueue(order_id="o-other", seconds=30)
    browser.get(dashboard + "/queues/shop/keys")
    row = '[data-key="o-held"]'
    await until(browser, lambda d: text_of(d, f'{row} [data-testid="holder"]') == "web-1",
                "the held key shows the worker that holds it")
    cells = await until(browser, lambda d: texts_of(d, f"{row} td"), "the held key's row")
    assert cells[2] == "held" and cells[5].isdigit() and cells[9].endswith("ago"), cells

    # The search and the filter are a GET form: the URL of what is shown can be shared.
    browser.get(dashboard + "/queues/shop/keys?q=other&state=held")
    await until(browser, lambda d: text_of(d, '[data-key="o-other"] [data-testid="holder"]') == "web-1",
                "the filtered list shows the other held key")
    assert not browser.find_elements(By.CSS_SELECTOR, row)

    click(browser, '[data-key="o-other"] a', "the key's link")
    await until(browser, lambda d: text_of(d, '[data-testid="key-holder"]').startswith("web-1"),
                "the key's page names its holder")
    browser.get(dashboard + "/queues/shop/keys/o-held")
    await until(browser, lambda d: "hold" in text_of(d, "#pending tbody"), "the key's page lists its pending request")
    await until(browser, lambda d: "acquired" in text_of(d, "#events tbody"), "the key's page shows its events")


async def test_a_failing_key_is_filtered_with_its_attempts(browser: WebDriver, dashboard: str, producer: Any,
                                                           shot: Shot) -> None:
    _, tasks = producer
    await tasks["ship"].enqueue(order_id="o-ship")
    await tasks["hold"].enqueue(order_id="o-fine", seconds=30)
    browser.get(dashboard + "/queues/shop/keys?state=failing")
    row = '[data-key="o-ship"]'
    await until(browser, lambda d: text_of(d, f'{row} [data-testid="failing"]') == "failing",
                "the key whose head request is retried is listed as failing")
    await until(browser, lambda d: (number_in(text_of(d, f'{row} [data-testid="attempts"]')) or 0) >= 3,
                "its head request's attempts go up without a reload")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-key="o-fine"]'), "a held key that is not failing"
    browser.get(dashboard + "/queues/shop/keys")
    await until(browser, lambda d: text_of(d, '[data-key="o-fine"] [data-testid="holder"]') == "web-1",
                "every key, the failing one and the held one")
    await until(browser, lambda d: text_of(d, f'{row} [data-testid="failing"]') == "failing", "still failing")
    shot(browser, "keys")
    browser.get(dashboard + "/queues/shop/keys/o-ship")
    await until(browser, lambda d: "carrier unreachable" in text_of(d, '[data-testid="key-attempts"]'),
                "the key's page names the head request's last error")


async def test_a_key_page_shows_progress_live(browser: WebDriver, dashboard: str, producer: Any, shot: Shot) -> None:
    _, tasks = producer
    browser.get(dashboard + "/queues/shop/keys/o-pack")
    await until(browser, lambda d: "No progress message" in text_of(d, "#progress tbody"), "no progress yet")
    await until(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "connected",
                "the page listens for live updates")
    # Enqueued once the page is open: progress is not stored, only followed from then on.
    await tasks["pack"].enqueue(order_id="o-pack", seconds=20)
    await tasks["pack"].enqueue(order_id="o-pack", seconds=0)
    await tasks["pack"].options(countdown=3600).enqueue(order_id="o-pack", seconds=0)
    await until(browser, lambda d: '"step": "packing"' in text_of(d, "#progress tbody"),
                "the task's progress message appears without a reload")
    await until(browser, lambda d: "pack" in text_of(d, "#pending tbody"), "the request waiting behind it")
    await until(browser, lambda d: "started" in text_of(d, "#events tbody"), "the key's events")
    await until(browser, lambda d: "(in 59m" in text_of(d, '#pending [data-testid="delayed"]'),
                "the delayed request, with the time it is delayed until")
    shot(browser, "key")


async def test_workers_page_lists_the_live_worker(browser: WebDriver, dashboard: str, producer: Any,
                                                  shot: Shot) -> None:
    _, tasks = producer
    await tasks["hold"].enqueue(order_id="o-held", seconds=20)
    browser.get(dashboard + "/workers")
    row = '#live-workers [data-worker="web-1"]'
    await until(browser, lambda d: text_of(d, f'{row} [data-testid="slots"]') == "1/4",
                "the worker shows one of its four slots in use")
    await until(browser, lambda d: "shop" in text_of(d, row) and "live" in text_of(d, row), "queue and state")
    assert text_of(browser, f'{row} [data-testid="role"]') == "none", "queue shop has no priority policy"
    shot(browser, "workers")


async def test_dead_letter_appears_and_leaves_after_a_replay(browser: WebDriver, dashboard: str, producer: Any,
                                                             shot: Shot) -> None:
    _, tasks = producer
    browser.get(dashboard + "/queues/shop/dlq")
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-testid="dlq-empty"]'), "an empty DLQ")
    await tasks["pay"].enqueue(order_id="o-dead", amount=5)
    entry = '#dlq [data-key="o-dead"]'
    await until(browser, lambda d: "card declined" in text_of(d, entry),
                "the dead-lettered request appears with its error, without a reload")
    await until(browser, lambda d: "ValueError" in text_of(d, entry) and "max-attempts" in text_of(d, entry),
                "the entry names the error type and the reason")
    click(browser, f"{entry} details summary", "the traceback's toggle")
    await until(browser, lambda d: "Traceback" in text_of(d, f"{entry} details pre"), "its traceback opens")
    shot(browser, "dlq")

    click(browser, f'{entry} form[action$="/replay"] button', "the entry's replay button")
    await until(browser, lambda d: "replayed 1 request" in text_of(d, ".done"), "the replay is confirmed")
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-testid="dlq-empty"]'),
                "the replayed request leaves the DLQ (and, replayed, succeeds)")


async def test_purge_asks_for_confirmation(browser: WebDriver, dashboard: str, producer: Any) -> None:
    _, tasks = producer
    await tasks["pay"].enqueue(order_id="o-p", amount=1)
    browser.get(dashboard + "/queues/shop/dlq")
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#dlq [data-key="o-p"]'), "a dead request")
    click(browser, ".purge-all button", "the purge button")
    await until(browser, lambda d: "Type the queue's name" in d.page_source, "the purge asks for confirmation")
    browser.find_element(By.NAME, "confirm").send_keys("shop")
    browser.find_element(By.CSS_SELECTOR, "form button.danger").click()
    await until(browser, lambda d: "purged 1 dead request" in text_of(d, ".done"), "the purge is done")


async def test_read_only_hides_and_refuses_actions(nats_url: str, worker: Command, producer: Any) -> None:
    _, tasks = producer
    await tasks["pay"].enqueue(order_id="o-ro", amount=1)
    proc, base = await start_dashboard(nats_url, "--read-only")
    driver = make_browser()
    try:
        driver.get(base + "/queues/shop/dlq")
        await until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#dlq [data-key="o-ro"]'), "a dead request")
        assert not driver.find_elements(By.CSS_SELECTOR, "form[method=post] button"), "no action (a filter is none)"
        assert "read-only" in text_of(driver, "header")
        request = urllib.request.Request(base + "/queues/shop/dlq/purge", data=b"confirm=shop", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, request)
        assert refused.value.code == 405
    finally:
        driver.quit()
        await proc.stop()


async def test_tables_work_without_javascript(dashboard: str, producer: Any) -> None:
    _, tasks = producer
    await tasks["hold"].enqueue(order_id="o-nojs", seconds=20)
    driver = make_browser(javascript=False)
    try:
        def shows_holder(d: WebDriver) -> bool:
            d.get(dashboard + "/queues/shop/keys?state=held")  # without JavaScript, a reload is how it updates
            return text_of(d, '[data-key="o-nojs"] [data-testid="holder"]') == "web-1"

        await until(driver, shows_holder, "the server-rendered table shows the holder without JavaScript")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-live") is None
        driver.get(dashboard + "/schedules")
        assert "nightly-stocktake" in text_of(driver, "#periodic")
    finally:
        driver.quit()


async def test_a_key_held_without_progress_is_listed_as_stuck(nats_url: str, worker: Command, producer: Any) -> None:
    _, tasks = producer
    proc, base = await start_dashboard(nats_url, "--stuck-after", "1")
    driver = make_browser()
    try:
        await tasks["hold"].enqueue(order_id="o-slow", seconds=30)
        driver.get(base + "/queues/shop/keys?state=stuck")
        await until(driver, lambda d: text_of(d, '[data-key="o-slow"] .badge') == "stuck",
                    "a key held for more than --stuck-after without an event is listed as stuck")
    finally:
        driver.quit()
        await proc.stop()


async def test_a_stopped_worker_moves_to_recently_gone(browser: WebDriver, dashboard: str, worker: Command) -> None:
    browser.get(dashboard + "/workers")
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#live-workers [data-worker="web-1"]'),
                "the worker is live")
    await worker.stop()
    await until(browser, lambda d: "stopped" in text_of(d, '#gone-workers [data-worker="web-1"]'),
                "once stopped, the worker is listed as gone (stopped) without a reload")
    assert not browser.find_elements(By.CSS_SELECTOR, '#live-workers [data-worker="web-1"]')


async def test_schedules_page_lists_periodic_schedules_and_delayed_requests(browser: WebDriver, dashboard: str,
                                                                            producer: Any, shot: Shot) -> None:
    _, tasks = producer
    receipt = await tasks["touch"].options(countdown=900).enqueue(order_id="o-later")
    browser.get(dashboard + "/schedules")
    row = '#periodic [data-schedule="nightly-stocktake"]'
    await until(browser, lambda d: "0 3 * * *" in text_of(d, row) and "Europe/Oslo" in text_of(d, row),
                "the app's periodic schedule, with its cron expression and time zone")
    assert "UTC" in text_of(browser, f'{row} [data-testid="next-run"]'), "its next run"
    delayed = '#delayed [data-key="o-later"]'
    await until(browser, lambda d: receipt.request_id in text_of(d, delayed), "the delayed request")
    assert "(in 1" in text_of(browser, f'{delayed} [data-testid="due"]'), "due in about 15 minutes"
    shot(browser, "schedules")
    click(browser, f"{delayed} a", "the delayed request's key")
    await until(browser, lambda d: "UTC" in text_of(d, '#pending [data-testid="delayed"] [data-testid="due"]'),
                "the key's page lists the delayed request with the time it is delayed until")
