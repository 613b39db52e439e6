"""The dashboard's guard without a server: who may in, CSRF on every action, read-only, no secrets shown."""

from __future__ import annotations

import base64
import logging

import pytest
from starlette.testclient import TestClient

from keyqueue.dashboard.security import (
    CSRF_COOKIE,
    TOKEN_COOKIE,
    Access,
    HostPolicy,
    cookie_value,
    is_loopback,
    url_host,
)
from keyqueue.dashboard.state import Monitor
from keyqueue.dashboard.web import DashboardOptions, create_app, sparkline
from keyqueue.errors import ConfigError


def client(access: Access | None = None, *, read_only: bool = False, hosts: HostPolicy | None = None,
           base_url: str = "http://127.0.0.1") -> TestClient:
    monitor = Monitor(None, queues=[])  # type: ignore[arg-type]  # these pages never reach the server
    options = DashboardOptions(access or Access(), hosts or HostPolicy("127.0.0.1"), read_only=read_only)
    return TestClient(create_app(monitor, options), base_url=base_url)


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
    assert "local testclient (operator): purge on queue shop (-): refused, 0 touched; CSRF token" in caplog.text
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


# --- DNS rebinding, foreign origins, the derived session cookie, roles --------------------------------


@pytest.mark.parametrize(("host", "served"), [
    ("127.0.0.1:8787", True), ("localhost:8787", True), ("[::1]:8787", True), ("LOCALHOST:8787", True),
    ("127.0.0.1:9999", False), ("evil.example.com:8787", False), ("evil.example.com", False), ("", False),
    ("localhost", False), ("127.0.0.1.nip.io:8787", False)])
def test_on_loopback_only_hosts_naming_the_loopback_address_and_port_are_served(host: str, served: bool) -> None:
    assert HostPolicy("127.0.0.1").allows(host, 8787) is served


def test_allow_host_adds_a_tunnels_name_and_beyond_loopback_any_host_is_served() -> None:
    policy = HostPolicy("127.0.0.1", ("localhost:9000", "dash.internal"))
    assert policy.allows("localhost:9000", 8787) and policy.allows("dash.internal:8787", 8787)
    assert not policy.allows("localhost:9001", 8787)
    assert HostPolicy("0.0.0.0").allows("dash.example.org", 8787), "credentials guard it there"
    assert HostPolicy("::1").allows("[::1]:8787", 8787)
    assert (url_host("::1"), url_host("127.0.0.1"), url_host("localhost")) == ("[::1]", "127.0.0.1", "localhost")


def test_a_foreign_host_is_refused_before_any_cookie_is_set() -> None:
    c = client()
    refused = c.get("/", headers={"Host": "evil.example.com"})
    assert refused.status_code == 403 and "set-cookie" not in refused.headers
    assert "refused: Host 'evil.example.com'" in refused.text and "--allow-host" in refused.text
    assert c.get("/", headers={"Host": "localhost"}).status_code == 200


def test_a_state_changing_request_from_another_origin_is_refused_even_with_the_csrf_token() -> None:
    c = client()
    cookie = c.get("/").cookies[CSRF_COOKIE]
    form = {"csrf": cookie, "confirm": "shop"}
    for headers in ({"Origin": "http://evil.example.com"}, {"Origin": "null"},
                    {"Referer": "http://evil.example.com/page"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "http://127.0.0.1:8787"}):
        refused = c.post("/queues/shop/dlq/purge", data=form, headers=headers)
        assert refused.status_code == 403 and refused.text.startswith("refused: a request from"), headers
    # Its own origin (or no browser at all) gets past the guard, to a queue that does not exist here.
    assert c.post("/queues/shop/dlq/purge", data=form, headers={"Origin": "http://127.0.0.1"}).status_code == 404
    assert c.post("/queues/shop/dlq/purge", data=form).status_code == 404
    assert c.get("/").headers["referrer-policy"] == "same-origin", "no-referrer: browsers send Origin: null"


def test_the_session_cookie_is_derived_from_the_token_never_the_token() -> None:
    c = client(Access(token="s3cret"))
    moved = c.get("/workers?token=s3cret", follow_redirects=False)
    value = moved.cookies[TOKEN_COOKIE]
    assert value == cookie_value("s3cret", "operator") and "s3cret" not in value
    assert value != cookie_value("s3cret", "viewer"), "a role is part of what is derived"
    fresh = client(Access(token="s3cret"))
    fresh.cookies.set(TOKEN_COOKIE, "s3cret")
    assert fresh.get("/").status_code == 401, "the raw token is no cookie"
    fresh.cookies.set(TOKEN_COOKIE, value)
    assert fresh.get("/").status_code == 200


def test_a_viewer_sees_pages_and_is_refused_every_action() -> None:
    c = client(Access(token="op", viewer_token="view"))
    assert c.get("/workers?token=view").status_code == 200
    page = c.get("/")
    assert "viewer (viewer token)" in page.text
    refused = c.post("/queues/shop/dlq/purge", data={"csrf": page.cookies.get(CSRF_COOKIE) or c.cookies[CSRF_COOKIE],
                                                     "confirm": "shop"})
    assert refused.status_code == 403 and "viewer role may look, not act" in refused.text
    viewer = base64.b64encode(b"eve:pw2").decode()
    basic = client(Access(user="ops", password="pw", viewer_user="eve", viewer_password="pw2"))
    assert "viewer (eve)" in basic.get("/", headers={"Authorization": f"Basic {viewer}"}).text
    with pytest.raises(ConfigError, match="viewer credentials need operator credentials too"):
        Access(viewer_token="view").check("127.0.0.1")
    with pytest.raises(ConfigError, match="both --viewer-user and --viewer-password"):
        Access(token="t", viewer_user="eve").check("127.0.0.1")
    assert "view" not in Access(token="op", viewer_token="view").describe().replace("viewers", "")


def test_health_without_credentials_says_only_the_verdict() -> None:
    c = client(Access(token="op"))
    public = c.get("/health")
    assert public.status_code == 200 and public.json().keys() == {"status", "checked"}
    assert c.get("/", headers={}).status_code == 401, "other pages still need credentials"
    detailed = c.get("/health", headers={"Authorization": "Bearer op"}).json()
    assert detailed["status"] == "ok" and detailed["queues"] == {}
