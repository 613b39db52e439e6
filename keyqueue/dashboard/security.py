"""Who may use the dashboard, from where, in which role; how its actions are protected.

- **Loopback by default.** Bound to a loopback address, the dashboard asks for no credentials
  (whoever can reach it is on this machine). Bound to anything else it refuses to start without
  an operator's token (``--token`` / ``KEYQUEUE_DASHBOARD_TOKEN``) or basic credentials
  (``--user`` and ``--password``).
- **DNS rebinding.** A web page can make the operator's browser send requests to a loopback
  port under a name the page controls (``evil.example.com`` resolving to 127.0.0.1), which makes
  it same-origin with the dashboard. So on loopback only a ``Host`` that names the loopback
  address and the port it listens on is served (``127.0.0.1:8787``, ``localhost:8787``,
  ``[::1]:8787``, and what ``--allow-host`` adds for a tunnel or proxy); any other is refused (403)
  before anything is read or set. On every state-changing request (POST), an ``Origin`` (or,
  without one, a ``Referer``) that is not the dashboard's own is refused too, on any address.
- **Roles.** An *operator* may act; a *viewer* (``--viewer-token``, or ``--viewer-user`` and
  ``--viewer-password``) sees every page and no action. A token is accepted as
  ``Authorization: Bearer <token>``, or once as ``?token=<token>``, which sets an HttpOnly cookie
  and redirects to the same URL without it. The cookie carries a value derived from the token
  (an HMAC of it), never the token.
- **CSRF.** Every response sets a random per-session token in a ``SameSite=Strict`` HttpOnly
  cookie; every form carries the same token in a hidden field, and a POST whose field does not
  match its cookie is refused (403) before anything is done.
- **Read-only.** ``--read-only`` hides every action and refuses every POST (405).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from keyqueue.errors import ConfigError

__all__ = ["CSRF_COOKIE", "CSRF_FIELD", "TOKEN_COOKIE", "Access", "Caller", "Guard", "Role", "cookie_value",
           "csrf_matches", "is_loopback", "url_host"]

CSRF_COOKIE: Final = "kq_csrf"
CSRF_FIELD: Final = "csrf"
TOKEN_COOKIE: Final = "kq_session"
"""The cookie ``?token=`` sets: :func:`cookie_value` of the token, never the token itself."""

LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
"""Host names that name this machine's loopback address."""

UNSAFE_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})

PUBLIC_PATHS: Final = frozenset({"/health", "/static/dashboard.css"})
"""Paths served without credentials (``/health`` then says only its overall verdict)."""

Role = Literal["viewer", "operator"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """``host`` as it is written in a URL or a ``Host`` header: an IPv6 address in brackets."""
    try:
        return f"[{host.strip('[]')}]" if ipaddress.ip_address(host.strip("[]")).version == 6 else host
    except ValueError:
        return host


def cookie_value(token: str, role: Role) -> str:
    """What the session cookie of ``token`` holds: an HMAC of it (a leaked cookie does not reveal
    the token, which may guard other things too)."""
    return hmac.new(token.encode(), f"keyqueue-dashboard-session:{role}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a name for the audit log and a role."""

    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role == "operator"


@dataclass(frozen=True)
class Access:
    """The credentials the dashboard asks for, per role (none on loopback without any given)."""

    token: str | None = None
    user: str | None = None
    password: str | None = None
    viewer_token: str | None = None
    viewer_user: str | None = None
    viewer_password: str | None = None

    def check(self, host: str) -> None:
        """Refuse (``ConfigError``) credentials that do not make sense, and listening on a
        non-loopback ``host`` without an operator's credentials."""
        for role, user, password in (("", self.user, self.password),
                                     ("viewer-", self.viewer_user, self.viewer_password)):
            if (user is None) != (password is None):
                env = "KEYQUEUE_DASHBOARD_" + role.upper().replace("-", "_")
                raise ConfigError(f"basic credentials need both --{role}user and --{role}password (or {env}USER "
                                  f"and {env}PASSWORD)")
        if self.viewer_required and not self.required:
            raise ConfigError("viewer credentials need operator credentials too (--token, or --user and --password): "
                              "without them anyone who can reach the dashboard would be an operator")
        if not is_loopback(host) and not self.required:
            raise ConfigError(f"the dashboard listens on {host}, beyond this machine: give it a token (--token or "
                              "KEYQUEUE_DASHBOARD_TOKEN) or basic credentials (--user/--password or "
                              "KEYQUEUE_DASHBOARD_USER/KEYQUEUE_DASHBOARD_PASSWORD)")

    @property
    def required(self) -> bool:
        return self.token is not None or self.user is not None

    @property
    def viewer_required(self) -> bool:
        return self.viewer_token is not None or self.viewer_user is not None

    def describe(self) -> str:
        """What guards the dashboard, for its start line (never the secrets themselves)."""
        kinds = [kind for kind, given in (("a token", self.token), (f"basic credentials (user {self.user})", self.user))
                 if given]
        if not kinds:
            return "nothing (loopback only)"
        viewers = [kind for kind, given in (("a token", self.viewer_token),
                                            (f"basic credentials (user {self.viewer_user})", self.viewer_user))
                   if given]
        return " or ".join(kinds) + (f"; viewers: {' or '.join(viewers)}" if viewers else "")

    def tokens(self) -> list[tuple[str, Role]]:
        found: list[tuple[str, Role]] = []
        if self.token is not None:
            found.append((self.token, "operator"))
        if self.viewer_token is not None:
            found.append((self.viewer_token, "viewer"))
        return found

    def who(self, authorization: str | None, session_cookie: str | None) -> Caller | None:
        """Who the request comes from, or None if it proves nothing."""
        if session_cookie:
            for token, role in self.tokens():
                if _same(session_cookie, cookie_value(token, role)):
                    return Caller("token" if role == "operator" else "viewer token", role)
        if not authorization:
            return None
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return self.token_caller(value.strip())
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            roles: tuple[tuple[Role, str | None, str | None], ...] = (
                ("operator", self.user, self.password), ("viewer", self.viewer_user, self.viewer_password))
            for role, u, p in roles:
                if u is not None and p is not None and _same(user, u) & _same(password, p):
                    return Caller(user, role)
        return None

    def token_caller(self, given: str) -> Caller | None:
        for token, role in self.tokens():
            if _same(given, token):
                return Caller("token" if role == "operator" else "viewer token", role)
        return None


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` values the dashboard serves: on loopback, the loopback names with the port it
    listens on, and those ``--allow-host`` adds; beyond loopback, any (unless ``--allow-host``)."""

    bound: str
    """The address it listens on (``--host``)."""
    extra: tuple[str, ...] = ()
    """``--allow-host`` values: ``name:port`` (or ``name`` for any port)."""

    @property
    def restricted(self) -> bool:
        return is_loopback(self.bound) or bool(self.extra)

    def allows(self, host_header: str, port: int) -> bool:
        host = host_header.strip().lower()
        if not self.restricted:
            return True
        names = {*LOOPBACK_NAMES, url_host(self.bound).lower()} if is_loopback(self.bound) else set()
        allowed = {f"{name}:{port}" for name in names}
        if port == 80:
            allowed |= names
        for extra in self.extra:
            extra = extra.strip().lower()
            if ":" in extra.rsplit("]", 1)[-1]:
                allowed.add(extra)
            else:
                allowed |= {extra, f"{extra}:{port}"}
        return host in allowed

    def describe(self, port: int) -> str:
        names = [f"{name}:{port}" for name in LOOPBACK_NAMES] if is_loopback(self.bound) else []
        return ", ".join([*names, *self.extra])


class Guard(BaseHTTPMiddleware):
    """Every request passes here first: the Host allow-list, credentials and role, a foreign Origin
    on a state-changing request, the CSRF cookie, the ``?token=`` redirect, and safe headers."""

    def __init__(self, app: Any, access: Access, hosts: HostPolicy) -> None:
        super().__init__(app)
        self.access = access
        self.hosts = hosts

    async def dispatch(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        port = int((request.scope.get("server") or ("", 80))[1] or 80)
        host = request.headers.get("host", "")
        if not self.hosts.allows(host, port):
            return _refuse(f"refused: Host {host!r} does not name this dashboard, which serves "
                           f"{self.hosts.describe(port)} (a page under another name may be rebinding it to this "
                           "machine). Reached through a tunnel or proxy? Start it with --allow-host NAME:PORT.")
        if request.method in UNSAFE_METHODS and (foreign := _foreign_origin(request, host)) is not None:
            return _refuse(f"refused: a request from {foreign!r}, not from this dashboard ({request.url.scheme}://"
                           f"{host}); actions are only taken from its own pages")
        access = self.access
        caller = Caller(f"local {request.client.host if request.client else '?'}", "operator")
        if access.required:
            given = request.query_params.get("token")
            if given is not None and (by_token := access.token_caller(given)) is not None:
                query = urllib.parse.urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
                redirect: Response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), 303)
                redirect.set_cookie(TOKEN_COOKIE, cookie_value(given, by_token.role), httponly=True,
                                    samesite="strict", secure=request.url.scheme == "https")
                return _safe(redirect)
            found = access.who(request.headers.get("authorization"), request.cookies.get(TOKEN_COOKIE))
            if found is None and request.url.path not in PUBLIC_PATHS:
                challenge = {"WWW-Authenticate": 'Basic realm="keyqueue"'} if access.user else {}
                return _safe(PlainTextResponse("authentication required", 401, headers=challenge))
            caller = found or Caller("anonymous", "viewer")
            request.state.authenticated = found is not None
        else:
            request.state.authenticated = True
        request.state.caller = caller
        csrf = request.cookies.get(CSRF_COOKIE) or new_csrf_token()
        request.state.csrf = csrf
        response = await call_next(request)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return _safe(response)


def _foreign_origin(request: Request, host: str) -> str | None:
    """The origin a state-changing request came from when it is not this dashboard's; else None.

    A browser sends ``Origin`` with every POST (``null`` from an opaque origin); without it, the
    ``Referer``'s origin is used; a request with neither is not from a browser page.
    """
    if request.headers.get("sec-fetch-site") == "cross-site":
        return request.headers.get("origin") or "a cross-site page"
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if not referer:
            return None
        parts = urllib.parse.urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    parts = urllib.parse.urlsplit(origin)
    if origin == "null" or parts.netloc.lower() != host.lower() or parts.scheme not in ("http", "https"):
        return origin
    return None


def _refuse(text: str) -> Response:
    return _safe(PlainTextResponse(text, 403))


def _safe(response: Response) -> Response:
    # same-origin, not no-referrer: under no-referrer a browser sends "Origin: null" with the
    # dashboard's own form posts, which the Origin check must refuse.
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    return response


def new_csrf_token() -> str:
    return secrets.token_urlsafe(24)


def csrf_matches(cookie: str | None, submitted: str | None) -> bool:
    return bool(cookie) and bool(submitted) and _same(str(cookie), str(submitted))


def _same(a: str, b: str) -> bool:
    """Constant-time comparison of two texts (any characters)."""
    return hmac.compare_digest(a.encode(), b.encode())
