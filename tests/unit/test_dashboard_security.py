"""The dashboard's guard without a server: who may in, CSRF on every action, read-only, no secrets shown."""

from __future__ import annotations

import base64
import logging

import pytest
from starlette.testclient import TestClient

from keyqueue.dashboard.security import CSRF_COOKIE, Access, is_loopback
from keyqueue.dashboard.state import Monitor
from keyqueue.dashboard.web import DashboardOptions, create_app, sparkline
from keyqueue.errors import ConfigError


def client(access: Access | None = None, *, read_only: bool = False) -> TestClient:
    monitor = Monitor(None, queues=[])  # type: ignore[arg-type]  # these pages never reach the server
    options = DashboardOptions(access or Access(), read_only=read_only)
    return TestClient(create_app(monitor, options), base_url="http://127.0.0.1")


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("127.3.2.1", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                                ("example.org", False)])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_beyond_loopback_needs_credentials_and_the_error_says_how() -> None:
    Access().check("127.0.0.1")
    with pytest.raises(ConfigError, match="KEYQUEUE_DASHBOARD_TOKEN"):
        Access().check("0.0.0.0")
    Access(token="t").check("0.0.0.0")
    Access(user="ops", password="pw").check("0.0.0.0")
    with pytest.raises(ConfigError, match="both --user and --password"):
        Access(user="ops").check("127.0.0.1")


def test_the_start_line_names_the_kind_of_credentials_never_the_secret() -> None:
    text = Access(token="s3cret", user="ops", password="pw0rd").describe()
    assert "s3cret" not in text and "pw0rd" not in text and "token" in text and "user ops" in text


def test_a_token_is_asked_for_and_a_token_in_the_url_becomes_a_cookie() -> None:
    c = client(Access(token="s3cret"))
    assert c.get("/").status_code == 401
    assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    moved = c.get("/workers?token=s3cret&x=1", follow_redirects=False)
    assert moved.status_code == 303 and moved.headers["location"] == "/workers?x=1"
    cookie = moved.headers["set-cookie"].lower()
    assert "samesite=strict" in cookie and "httponly" in cookie
    page = c.get("/workers?x=1")  # the cookie now proves it
    assert page.status_code == 200 and "s3cret" not in page.text


def test_basic_credentials() -> None:
    c = client(Access(user="ops", password="pw"))
    refused = c.get("/")
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
    good = base64.b64encode(b"ops:pw").decode()
    assert c.get("/", headers={"Authorization": f"Basic {good}"}).status_code == 200
    bad = base64.b64encode(b"ops:nope").decode()
    assert c.get("/", headers={"Authorization": f"Basic {bad}"}).status_code == 401


def test_every_action_needs_the_session_csrf_token(caplog: pytest.LogCaptureFixture) -> None:
    c = client()
    page = c.get("/")
    cookie = page.cookies[CSRF_COOKIE]
    assert "samesite=strict" in page.headers["set-cookie"].lower()
    with caplog.at_level(logging.WARNING, logger="keyqueue.dashboard.audit"):
        for form in ({}, {"csrf": "forged"}):
            refused = c.post("/queues/shop/dlq/purge", data={**form, "confirm": "shop"})
            assert refused.status_code == 403
    assert "refused purge on queue shop from local" in caplog.text
    # With the right token the request gets past the guard (to a queue that does not exist here).
    assert c.post("/queues/shop/dlq/purge", data={"csrf": cookie, "confirm": "shop"}).status_code == 404


def test_read_only_refuses_every_action() -> None:
    c = client(read_only=True)
    cookie = c.get("/").cookies[CSRF_COOKIE]
    for action in ("replay", "delete", "purge"):
        assert c.post(f"/queues/shop/dlq/{action}", data={"csrf": cookie}).status_code == 405


def test_pages_render_without_queues_and_metrics_are_prometheus_text() -> None:
    c = client()
    assert "No queue on this server yet" in c.get("/").text
    assert "No queue on this server yet" in c.get("/schedules").text
    metrics = c.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE keyqueue_requests_succeeded_total counter" in metrics.text


def test_sparkline_is_inline_svg() -> None:
    assert sparkline([1.0]) == ""
    svg = sparkline([0.0, 2.0, 1.0])
    assert svg.startswith("<svg") and "polyline" in svg and 'points="0.0,22.0 60.0,2.0 120.0,12.0"' in svg


def test_the_command_refuses_a_public_address_without_credentials() -> None:
    from click.testing import CliRunner

    from keyqueue.cli import main

    result = CliRunner().invoke(main, ["dashboard", "--host", "0.0.0.0"], env={"KEYQUEUE_DASHBOARD_TOKEN": ""})
    assert result.exit_code == 1
    assert "beyond this machine: give it a token" in result.output
