"""The operator's view (the dashboard) in a real browser: loopback safety, why a key waits, actions with care,
search, history, roles and the audit log, health, and the smaller items. A real nats-server, real
``keyqueue worker`` and ``keyqueue dashboard`` processes, headless Chromium; each test waits for what
the page shows, never for a fixed time."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from browser_pages import (
    KEYQUEUE,
    ROOT,
    click,
    environment,
    make_browser,
    number_in,
    start_dashboard,
    text_of,
    texts_of,
    until,
)
from command_output import Command
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

import keyqueue
from keyqueue.dashboard.security import cookie_value
from keyqueue.jetstream.records import RequestRecords

Shot = Callable[[WebDriver, str], Path]


async def http(method: str, url: str, *, headers: dict[str, str] | None = None,
               form: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """One HTTP request as a non-browser client sends it (redirects not followed)."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})

    def send() -> tuple[int, dict[str, str], str]:
        try:
            with urllib.request.build_opener(NoRedirect).open(request, timeout=15) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()

    return await asyncio.to_thread(send)


def searched(driver: WebDriver, url: str) -> int | None:
    """Open a search (again: a search page shows its results as of when it was opened) and its count."""
    driver.get(url)
    return number_in(text_of(driver, '[data-testid="result-count"]'))


def body_text(driver: WebDriver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def csrf_cookie(driver: WebDriver) -> str:
    """The browser's CSRF cookie: a form carries the same value in its hidden field."""
    cookie = driver.get_cookie("kq_csrf") or {}
    return str(cookie.get("value", ""))


async def start_worker(nats_url: str, name: str, *args: str) -> Command:
    proc = await Command.start(str(KEYQUEUE), "worker", "tests.browser.dashboard_app:app", "--name", name, *args,
                               env=environment(KEYQUEUE_URL=nats_url), cwd=ROOT)
    await proc.wait_for(r"serving queue shop")
    return proc


# --- 1. loopback is safe ---------------------------------------------------------------------------


async def test_a_page_rebinding_its_name_to_loopback_is_refused(dashboard: str, producer: Any) -> None:
    _, tasks = producer
    await tasks["pay"].enqueue(order_id="o-rebind", amount=7)
    port = urllib.parse.urlsplit(dashboard).port
    # The attacker's name resolves to 127.0.0.1, as after a DNS rebinding: same origin as the page that rebound it.
    evil = make_browser(args=("--host-resolver-rules=MAP evil.example.com 127.0.0.1",))
    try:
        evil.get(f"http://evil.example.com:{port}/queues/shop/dlq")
        await until(evil, lambda d: "refused: Host 'evil.example.com" in body_text(d), "the foreign Host is refused")
        assert "card declined" not in evil.page_source and not evil.find_elements(By.CSS_SELECTOR, "form")
        assert evil.get_cookies() == [], "no cookie, so no CSRF token, is handed to the rebinding page"
        # The same browser, under the dashboard's own name, is served.
        evil.get(f"http://localhost:{port}/queues/shop/dlq")
        await until(evil, lambda d: "card declined" in text_of(d, '#dlq [data-key="o-rebind"]'), "served on localhost")
    finally:
        evil.quit()
    status, headers, body = await http("GET", dashboard + "/queues/shop/dlq",
                                       headers={"Host": f"evil.example.com:{port}"})
    assert status == 403 and "Set-Cookie" not in headers and "rebinding" in body


async def test_a_foreign_origin_cannot_act_even_with_the_cookie_and_the_token(browser: WebDriver, dashboard: str,
                                                                            producer: Any) -> None:
    _, tasks = producer
    await tasks["pay"].enqueue(order_id="o-origin", amount=3)
    browser.get(dashboard + "/queues/shop/dlq")
    entry = '#dlq [data-key="o-origin"]'
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, entry), "the dead request")
    seq = await until(browser, lambda d: d.find_element(By.CSS_SELECTOR, entry).get_attribute("data-seq"), "its seq")
    cookie = csrf_cookie(browser)
    form = {"csrf": cookie, "seq": seq}
    port = urllib.parse.urlsplit(dashboard).port
    for origin in ("http://evil.example.com", f"http://evil.example.com:{port}", "null"):
        status, _, body = await http("POST", dashboard + "/queues/shop/dlq/delete", form=form,
                                     headers={"Cookie": f"kq_csrf={cookie}", "Origin": origin})
        assert (status, body.startswith(f"refused: a request from '{origin}'")) == (403, True), body
    # A page of another site whose browser sends no Origin still says where it comes from.
    status, _, _ = await http("POST", dashboard + "/queues/shop/dlq/delete", form=form,
                              headers={"Cookie": f"kq_csrf={cookie}", "Sec-Fetch-Site": "cross-site"})
    assert status == 403
    browser.refresh()
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, entry), "the dead request is still there")
    # The very same request from the dashboard's own origin acts: only the Origin made the difference.
    status, headers, _ = await http("POST", dashboard + "/queues/shop/dlq/delete", form=form,
                                    headers={"Cookie": f"kq_csrf={cookie}", "Origin": dashboard})
    assert status == 303, headers
    browser.refresh()
    await until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, entry), "deleted from its own origin")


async def test_the_cookie_is_derived_from_the_token_and_ipv6_urls_have_brackets(nats_url: str, worker: Command) -> None:
    proc, base = await start_dashboard(nats_url, "--host", "::1", "--token", "s3cret-token")
    driver = make_browser()
    try:
        assert re.fullmatch(r"http://\[::1\]:\d+", base), base
        driver.get(base + "/queues/shop/keys?token=s3cret-token")
        await until(driver, lambda d: "Keys of shop" in d.title and "token=" not in d.current_url,
                    "the token opens the page once and leaves the address bar")
        cookie = driver.get_cookie("kq_session")
        assert cookie is not None and cookie["httpOnly"]
        assert "s3cret" not in cookie["value"] and cookie["value"] == cookie_value("s3cret-token", "operator")
        status, _, _ = await http("GET", base + "/queues/shop/keys")
        assert status == 401, "without the cookie or the token"
        status, _, _ = await http("GET", base + "/queues/shop/keys", headers={"Cookie": "kq_session=s3cret-token"})
        assert status == 401, "the raw token is not a session cookie"
    finally:
        driver.quit()
        await proc.stop()


# --- 2. why is this key waiting? -------------------------------------------------------------------


def blocker(driver: WebDriver, kind: str) -> str:
    return text_of(driver, f'[data-testid="blocker"][data-kind="{kind}"]')


async def test_why_a_key_waits_running_backing_off_rate_limited_or_in_line(browser: WebDriver, dashboard: str,
                                                                           producer: Any, shot: Shot) -> None:
    _, tasks = producer
    await tasks["ship"].enqueue(order_id="o-ship")
    await tasks["hold"].enqueue(order_id="o-run", seconds=40)
    await tasks["invoice"].enqueue(order_id="o-inv")
    await tasks["invoice"].enqueue(order_id="o-inv")
    browser.get(dashboard + "/queues/shop/keys/o-run")
    await until(browser, lambda d: "held by web-1 (pid" in blocker(d, "running"), "running, by its live holder")
    assert re.search(r"web-1 \(pid \d+ on \S+, live", text_of(browser, '[data-testid="key-holder"]'))
    assert number_in(text_of(browser, '[data-testid="key-fence"]')) is not None
    assert '"seconds": 40' in text_of(browser, '[data-testid="head-arguments"]')

    browser.get(dashboard + "/queues/shop/keys/o-inv")
    await until(browser, lambda d: "rate limit of task invoice: 1 run(s) in the last 60s" in blocker(d, "rate-limit"),
                "the second invoice waits for its rate limit")

    browser.get(dashboard + "/queues/shop/keys/o-ship")
    await until(browser, lambda d: "next attempt at" in blocker(d, "retry-backoff"), "a failed attempt backs off")
    assert "carrier unreachable" in blocker(browser, "retry-backoff")
    shot(browser, "key")

    # Four slots: o-run works in one; o-ship's backoff and o-inv's rate-limit wait hold their keys
    # but not a slot (a parked key). Three more long holds fill the worker.
    for n in range(3):
        await tasks["hold"].enqueue(order_id=f"o-fill-{n}", seconds=40)
    await tasks["hold"].enqueue(order_id="o-line", seconds=0)
    browser.get(dashboard + "/queues/shop/keys/o-line")
    await until(browser, lambda d: "waiting for a free worker slot: position 1 of 1" in blocker(d, "waiting-for-slot"),
                "the key waits in line, first")
    assert number_in(text_of(browser, '[data-testid="position"]')) == 1
    assert "has waited" in text_of(browser, '[data-testid="waited"]')


async def test_why_a_key_waits_for_a_gone_worker_released_then_for_no_worker(browser: WebDriver, nats_url: str,
                                                                            producer: Any, shot: Shot) -> None:
    _, tasks = producer
    gone = await start_worker(nats_url, "doomed-1", "--ack-wait", "60")
    proc, base = await start_dashboard(nats_url)
    try:
        await tasks["hold"].enqueue(order_id="o-gone", seconds=120)
        await tasks["hold"].enqueue(order_id="o-gone", seconds=0)
        browser.get(base + "/queues/shop/keys/o-gone")
        await until(browser, lambda d: "held by doomed-1" in blocker(d, "running"), "held by the live worker")
        # The CLI's rule: a key is not released while its holder looks alive.
        click(browser, "button[name=release]", "Release the key")
        await until(browser, lambda d: "releases 1 key, o-gone, held by doomed-1 (live)" in text_of(
            d, "[data-testid=release-count]"), "the confirmation says what it touches")
        click(browser, "button[name=confirm-release]", "Release 1 key")
        await until(browser, lambda d: "looks alive: o-gone (worker doomed-1's heartbeat is live)" in text_of(
            d, "[data-testid=release-refused]"), "refused while the holder lives, with the forced form offered")
        assert browser.find_elements(By.CSS_SELECTOR, "button[name=force-release]")
        gone.proc.kill()  # kill -9: no stopped record, its lease record stays until its TTL
        await gone.wait()
        browser.get(base + "/queues/shop/keys/o-gone")
        await until(browser, lambda d: "held by doomed-1, which is gone (silent" in blocker(d, "gone-holder"),
                    "once the registry says the worker is gone, its lease and when it ends", timeout=40)
        assert "its lease ends at" in blocker(browser, "gone-holder") and "keyqueue release shop o-gone" in blocker(
            browser, "gone-holder")
        shot(browser, "key-gone")
        click(browser, "button[name=release]", "Release the key left by doomed-1")
        await until(browser, lambda d: "held by doomed-1 (gone: silent)" in text_of(d, "[data-testid=release-count]"),
                    "the confirmation names the gone holder")
        click(browser, "button[name=confirm-release]", "Release 1 key")
        await until(browser, lambda d: "released o-gone (held by doomed-1" in text_of(d, ".done"), "released now")
        await until(browser, lambda d: "no worker serves queue shop" in blocker(d, "no-worker")
                    and not d.find_elements(By.CSS_SELECTOR, '[data-kind="gone-holder"]'),
                    "its lease is gone at once; the key waits for a worker")
        browser.get(base + "/audit")
        await until(browser, lambda d: "release" in text_of(d, '#audit tr[data-action="release"][data-outcome="done"]'),
                    "the release is audited")
        assert "heartbeat is live" in text_of(browser, '#audit tr[data-action="release"][data-outcome="refused"]')
        await tasks["hold"].enqueue(order_id="o-none", seconds=0)
        browser.get(base + "/queues/shop/keys/o-none")
        await until(browser, lambda d: "no worker serves queue shop" in blocker(d, "no-worker"), "nobody serves it")
    finally:
        await proc.stop()


# --- 3. actions with care --------------------------------------------------------------------------


async def test_cancel_a_pending_and_a_delayed_request(browser: WebDriver, dashboard: str, producer: Any) -> None:
    _, tasks = producer
    await tasks["hold"].enqueue(order_id="o-cancel", seconds=3)
    pending = await tasks["hold"].enqueue(order_id="o-cancel", seconds=0)
    delayed = await tasks["touch"].options(countdown=600).enqueue(order_id="o-cancel")
    browser.get(dashboard + "/queues/shop/keys/o-cancel")
    row = f'#pending tr[data-request="{pending.request_id}"]'
    await until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), "the pending request")
    click(browser, f"{row} button[name=cancel]", "its Cancel button")
    await until(browser, lambda d: f"cancel of request {pending.request_id}: pending" in text_of(d, ".done"),
                "the cancel is recorded: it never starts, its key's holder removes it")
    # It never ran: the key's stored history says it was cancelled, and has no start of it.
    await until(browser, lambda d: "cancelled" in text_of(d, '#runs tr[data-outcome="cancelled"]'),
                "the cancelled request shows in the key's runs", timeout=30)
    rows = await until(browser, lambda d: [(r.get_attribute("data-outcome"), r.text) for r in d.find_elements(
        By.CSS_SELECTOR, "#runs tr[data-outcome]")], "the key's runs")
    assert [outcome for outcome, text in rows if pending.request_id in text] == ["cancelled"], rows
    drow = f'#pending tr[data-request="{delayed.request_id}"]'
    click(browser, f"{drow} button[name=cancel]", "the delayed request's Cancel button")
    await until(browser, lambda d: f"cancel of request {delayed.request_id}: cancelled" in text_of(d, ".done"),
                "a delayed request is cancelled at once (its schedule is removed)")
    await until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, drow), "and leaves the list")


async def test_bulk_replay_on_a_filter_shows_how_many_before_it_acts(browser: WebDriver, dashboard: str,
                                                                    producer: Any, shot: Shot) -> None:
    _, tasks = producer
    for key in ("b-1", "b-2", "b-3", "x-9"):
        await tasks["pay"].enqueue(order_id=key, amount=10)
    browser.get(dashboard + "/queues/shop/dlq?key=b-*")
    await until(browser, lambda d: "3 dead request(s) match key 'b-*'" in text_of(d, '[data-testid="dlq-count"]'),
                "the filter selects the three dead requests of keys b-*")
    assert '"amount": 10' in text_of(browser, '#dlq [data-key="b-2"] [data-testid="arguments"]'), "DLQ arguments"
    click(browser, "button[name=bulk-replay]", "Replay all that match")
    await until(browser, lambda d: "stores again, oldest first, 3 request(s)" in text_of(d, "[data-testid=bulk-count]"),
                "the confirmation says how many it touches")
    shot(browser, "confirm")
    click(browser, "button[name=confirm-bulk]", "the confirmation")
    await until(browser, lambda d: "replayed 3 request(s)" in text_of(d, ".done"), "all three are replayed")
    browser.get(dashboard + "/queues/shop/dlq")
    await until(browser, lambda d: [e.get_attribute("data-key")
                                    for e in d.find_elements(By.CSS_SELECTOR, "#dlq tr[data-key]")] == ["x-9"],
                "only the one outside the filter is left (the replayed ones succeed)")


async def test_bulk_cancel_from_a_search_cancels_what_it_counted(browser: WebDriver, dashboard: str, producer: Any,
                                                                nats_url: str) -> None:
    app, tasks = producer
    await tasks["hold"].enqueue(order_id="q-1", seconds=60)
    receipts = [await tasks["touch"].enqueue(order_id="q-1") for _ in range(5)]
    await tasks["touch"].enqueue(order_id="q-2")
    await until(browser, lambda d: searched(d, dashboard + "/search?queue=shop&task=touch&key=q-1&in=pending") == 5,
                "five pending touches")
    click(browser, "button[name=bulk-cancel]", "Cancel the pending ones")
    await until(browser, lambda d: "cancels (they never run) 5 request(s)" in text_of(d, '[data-testid="bulk-count"]'),
                "the confirmation counts five")
    click(browser, "button[name=confirm-bulk]", "the confirmation")
    await until(browser, lambda d: "cancel of 5 request(s): 5 pending" in text_of(d, ".done"), "five cancels recorded")
    records = RequestRecords(await app.connection(), "shop")
    states = [await records.cancel_state(r.request_id) for r in receipts]
    assert [s[0] if s else None for s in states] == ["requested"] * 5, "each has its cancel record"


# --- 4. find anything ------------------------------------------------------------------------------


async def test_search_by_id_key_task_and_argument_text_in_pages_with_the_filter_in_the_url(
        browser: WebDriver, dashboard: str, producer: Any, shot: Shot) -> None:
    _, tasks = producer
    await tasks["hold"].enqueue(order_id="s-0", seconds=60)
    receipts = await tasks["touch"].enqueue_many([{"order_id": "s-0"} for _ in range(120)])
    await tasks["pay"].enqueue(order_id="s-dead", amount=4242)
    await until(browser, lambda d: searched(d, dashboard + "/search?queue=shop&task=touch&in=pending") == 120,
                "all 120 pending touches are found")
    assert "page 1 of 3" in text_of(browser, '[data-testid="pager"]')
    assert len(browser.find_elements(By.CSS_SELECTOR, "#results tr[data-request]")) == 50
    click(browser, '[data-testid="pager"] a[rel=next]', "the next page")
    await until(browser, lambda d: "page=2" in d.current_url and "page 2 of 3" in text_of(d, '[data-testid="pager"]'),
                "page 2, in the URL")
    wanted = receipts[76].request_id
    browser.get(dashboard + f"/search?queue=shop&q={wanted}")
    found = [e.get_attribute("data-request")
             for e in browser.find_elements(By.CSS_SELECTOR, "#results tr[data-request]")]
    assert found == [wanted], "one request by its id"
    await until(browser, lambda d: searched(d, dashboard + "/search?queue=shop&q=4242") == 1,
                "a dead request by its argument")
    assert text_of(browser, '#results tr[data-where="dead"] .badge') == "dead"
    assert '"amount": 4242' in text_of(browser, "#results") and "card declined" in text_of(browser, "#results")
    assert browser.find_element(By.NAME, "q").get_attribute("value") == "4242", "the filter lives in the URL"
    assert searched(browser, dashboard + "/search?queue=shop&key=s-d*&in=dead") == 1, "by key pattern"
    assert searched(browser, dashboard + "/search?queue=shop&q=touch&key=s-*") == 120, "text and key"
    shot(browser, "search")


# --- 5. history ------------------------------------------------------------------------------------


async def test_a_keys_runs_come_from_stored_events_not_from_what_the_dashboard_saw(
        nats_url: str, worker: Command, producer: Any) -> None:
    _, tasks = producer
    for _ in range(3):
        await tasks["touch"].call(order_id="h-1", timeout=15)
    proc, base = await start_dashboard(nats_url)  # started after the runs
    driver = make_browser()
    try:
        driver.get(base + "/queues/shop/keys/h-1")
        await until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, '#runs tr[data-outcome="succeeded"]')) == 3,
                    "the three runs, read from the events stream")
        cells = await until(driver, lambda d: texts_of(d, '#runs tr[data-outcome="succeeded"] td')[:9],
                            "the newest run's cells")
        assert cells[1] == "succeeded" and cells[3] == "touch" and cells[5] == "web-1", cells
        assert cells[6].isdigit() and cells[7] != "-", "the holder's fencing number and the run's duration"
        assert "acquired" in text_of(driver, "#events")
    finally:
        driver.quit()
        await proc.stop()


async def test_history_charts_are_stored_in_nats_and_outlive_the_dashboard(nats_url: str, worker: Command,
                                                                           producer: Any, shot: Shot) -> None:
    _, tasks = producer
    first, base = await start_dashboard(nats_url)
    driver = make_browser()
    try:
        for _ in range(30):
            await tasks["touch"].enqueue(order_id="hist")
        await tasks["touch"].call(order_id="hist", timeout=15)
        driver.get(base + "/queues/shop/history?hours=1")
        # A minute is stored once it has closed (and the dashboard's first minute is rolled up from the events).
        # The page refreshes itself (live updates): no reload needed.
        await until(driver, lambda d: (number_in(text_of(d, '[data-testid="stored-done"]')) or 0) >= 31,
                    "the minute is stored", timeout=90)
        await first.stop()
        second, base = await start_dashboard(nats_url)
        try:
            driver.get(base + "/queues/shop/history?hours=1")
            await until(driver, lambda d: (number_in(text_of(d, '[data-testid="stored-done"]')) or 0) >= 31,
                        "a new dashboard shows what was stored")
            assert driver.find_elements(By.CSS_SELECTOR, '[data-testid="chart-throughput"] svg.history polyline, '
                                                         '[data-testid="chart-throughput"] svg.history circle')
            assert driver.find_elements(By.CSS_SELECTOR, '[data-testid="chart-run"] svg.history')
            shot(driver, "history")
        finally:
            await second.stop()
    finally:
        driver.quit()
        if first.proc.returncode is None:
            await first.stop()


# --- 6. who may do what ----------------------------------------------------------------------------


async def test_a_viewer_sees_and_cannot_act_and_the_audit_log_says_who_did_what(nats_url: str, worker: Command,
                                                                              producer: Any, shot: Shot) -> None:
    _, tasks = producer
    await tasks["pay"].enqueue(order_id="o-audit", amount=2)
    proc, base = await start_dashboard(nats_url, "--token", "op-secret", "--viewer-token", "view-secret")
    viewer, operator = make_browser(), make_browser()
    entry = '#dlq [data-key="o-audit"]'
    try:
        viewer.get(base + "/queues/shop/dlq?token=view-secret")
        await until(viewer, lambda d: d.find_elements(By.CSS_SELECTOR, entry), "the viewer sees the dead request")
        assert text_of(viewer, '[data-testid="role"]').startswith("viewer")
        assert not viewer.find_elements(By.CSS_SELECTOR, "form[method=post] button"), "and no action"
        seq = await until(viewer, lambda d: d.find_element(By.CSS_SELECTOR, entry).get_attribute("data-seq"), "seq")
        cookies = "; ".join(f"{c['name']}={c['value']}" for c in viewer.get_cookies())
        csrf = csrf_cookie(viewer)
        status, _, body = await http("POST", base + "/queues/shop/dlq/delete", form={"csrf": csrf, "seq": seq},
                                     headers={"Cookie": cookies, "Origin": base})
        assert status == 403 and "viewer role may look, not act" in body

        operator.get(base + "/queues/shop/dlq?token=op-secret")
        await until(operator, lambda d: d.find_elements(By.CSS_SELECTOR, entry), "the operator sees it")
        assert text_of(operator, '[data-testid="role"]').startswith("operator")
        click(operator, f'{entry} form[action$="/replay"] button', "replay")
        await until(operator, lambda d: "replayed 1 request" in text_of(d, ".done"), "the operator replays it")

        operator.get(base + "/audit")
        await until(operator, lambda d: d.find_elements(By.CSS_SELECTOR, '#audit tr[data-action="replay"]'),
                    "the replay is in the audit log")
        done = await until(operator, lambda d: text_of(d, '#audit tr[data-action="replay"][data-outcome="done"]'),
                           "the replay's entry")
        refused = await until(operator, lambda d: text_of(d, '#audit tr[data-action="delete"][data-outcome="refused"]'),
                              "the viewer's refused delete")
        assert "token operator shop replay" in done and "replayed 1 request" in done, done
        assert "viewer token viewer shop delete" in refused and "may look, not act" in refused, refused
        shot(operator, "audit")
        status, _, body = await http("GET", base + "/health")
        assert status == 200 and json.loads(body).keys() == {"status", "checked"}, "no credentials: the verdict only"
    finally:
        viewer.quit()
        operator.quit()
        await proc.stop()


# --- 7. health -------------------------------------------------------------------------------------


async def test_health_fails_a_queue_with_a_backlog_and_no_worker(browser: WebDriver, dashboard: str, worker: Command,
                                                                 producer: Any) -> None:
    _, tasks = producer
    status, _, body = await http("GET", dashboard + "/health")
    assert status == 200 and json.loads(body)["queues"]["shop"]["status"] == "ok", body
    await worker.stop()
    await tasks["touch"].enqueue(order_id="o-orphan")
    browser.get(dashboard + "/")
    await until(browser, lambda d: text_of(d, '[data-queue="shop"] [data-testid="no-worker"]') == "no worker",
                "the overview highlights a backlog that no worker serves")
    await until(browser, lambda d: "no-worker" in (d.find_element(By.CSS_SELECTOR, '#queues tr[data-queue="shop"]')
                                                   .get_attribute("class") or ""), "the row is highlighted")
    status, _, body = await http("GET", dashboard + "/health")
    verdict = json.loads(body)
    assert status == 503 and verdict["status"] == "fail", body
    assert verdict["queues"]["shop"]["reasons"] == ["1 request(s) stored and no live worker serves the queue"], body
    assert verdict["queues"]["shop"]["live_workers"] == 0


# --- 8. the smaller items --------------------------------------------------------------------------


async def test_a_key_that_reports_progress_is_not_stuck(nats_url: str, worker: Command, producer: Any) -> None:
    _, tasks = producer
    proc, base = await start_dashboard(nats_url, "--stuck-after", "2")
    driver = make_browser()
    try:
        await tasks["report"].enqueue(order_id="o-busy", seconds=30)
        await tasks["hold"].enqueue(order_id="o-quiet", seconds=30)
        driver.get(base + "/queues/shop/keys?state=stuck")
        await until(driver, lambda d: text_of(d, '[data-key="o-quiet"] .badge') == "stuck",
                    "the quiet key is stuck after 2 s")
        assert not driver.find_elements(By.CSS_SELECTOR, '[data-key="o-busy"]'), "the one reporting progress is not"
        driver.get(base + "/queues/shop/keys?state=held")
        await until(driver, lambda d: text_of(d, '[data-key="o-busy"] .badge') == "held", "busy is held")
        driver.get(base + "/queues/shop/keys/o-busy")
        await until(driver, lambda d: text_of(d, "[data-testid=last-progress]").endswith("s ago"), "its last progress")
    finally:
        driver.quit()
        await proc.stop()


async def test_a_held_token_without_a_lease_record_reads_as_changing_hands(browser: WebDriver, nats_url: str,
                                                                          producer: Any) -> None:
    app, tasks = producer
    await tasks["touch"].enqueue(order_id="o-hand")
    nc = await app.connection()
    # A worker took the key's token and has not written its lease record (yet, or any more).
    tokens = await nc.jetstream().pull_subscribe_bind("workers", "KQ_shop_TOKENS")
    [_token] = await tokens.fetch(1, timeout=10)
    proc, base = await start_dashboard(nats_url)
    try:
        browser.get(base + "/queues/shop/keys")
        await until(browser, lambda d: text_of(d, '[data-key="o-hand"] .badge') == "changing-hands",
                    "a held token with no lease record is a key changing hands, not a contradiction")
        assert text_of(browser, '[data-key="o-hand"] [data-testid="holder"]') == "(changing hands)"
        browser.get(base + "/queues/shop/keys/o-hand")
        await until(browser, lambda d: "no lease record names a holder" in blocker(d, "changing-hands"), "and says why")
    finally:
        await proc.stop()


async def test_the_navigation_holds_many_queues(browser: WebDriver, nats_url: str) -> None:
    app = keyqueue.App("many", nats_url, set_as_default=False, autoload_plugins=False)
    try:
        for i in range(12):
            @app.task(queue=f"queue-{i:02d}", key="{k}", name=f"t{i}")
            async def task(k: str) -> None:
                return None

            await task.enqueue(k="a")
        proc, base = await start_dashboard(nats_url)
        try:
            browser.get(base + "/")
            await until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#queues tr[data-queue]")) == 12,
                        "twelve queues")
            assert browser.find_element(By.TAG_NAME, "header").size["height"] < 60, "one line of navigation"
            click(browser, '[data-testid="queue-menu"] summary', "the queue menu")
            links = browser.find_elements(By.CSS_SELECTOR, '[data-testid="queue-menu"] li a')
            assert [a.text for a in links] == [f"queue-{i:02d}" for i in range(12)]
            click(browser, '[data-testid="queue-menu"] a[href="/queues/queue-07/keys"]', "queue-07")
            await until(browser, lambda d: "Keys of queue-07" in d.title, "its keys page")
            assert "queue-07" in text_of(browser, "nav.queue-nav")
        finally:
            await proc.stop()
    finally:
        await app.close()
