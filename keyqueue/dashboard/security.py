"""Who may use the dashboard, and how its actions are protected and logged.

- **Loopback by default.** Bound to a loopback address, the dashboard asks for nothing (whoever
  can reach it is on this machine). Bound to anything else it refuses to start without a token
  (``--token`` / ``KEYQUEUE_DASHBOARD_TOKEN``) or basic credentials (``--user`` and ``--password``
  / ``KEYQUEUE_DASHBOARD_USER`` and ``KEYQUEUE_DASHBOARD_PASSWORD``). A token is accepted as
  ``Authorization: Bearer <token>``, or once as ``?token=<token>``, which sets an HttpOnly cookie
  and redirects to the same URL without it (so the token does not stay in the address bar or in
  shared links).
- **CSRF.** Every response sets a random per-session token in a ``SameSite=Strict`` HttpOnly
  cookie; every form carries the same token in a hidden field, and a POST whose field does not
  match its cookie is refused (403) before anything is done.
- **Audit.** Each action is logged (logger ``keyqueue.dashboard.audit``) with who did it (the
  basic-auth user, ``token``, or ``local`` and the client address) and what it changed. Secrets are
  never logged or rendered: the start line says which kind of credentials guard the dashboard,
  not the credentials.
- **Read-only.** ``--read-only`` hides every action and refuses every POST (405).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from typing import Final

from keyqueue.errors import ConfigError

__all__ = ["CSRF_COOKIE", "CSRF_FIELD", "Access", "is_loopback"]

CSRF_COOKIE: Final = "kq_csrf"
CSRF_FIELD: Final = "csrf"
TOKEN_COOKIE: Final = "kq_token"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """The credentials the dashboard asks for (none on loopback without any given)."""

    token: str | None = None
    user: str | None = None
    password: str | None = None

    def check(self, host: str) -> None:
        """Refuse (``ConfigError``) to listen on a non-loopback ``host`` without credentials."""
        if (self.user is None) != (self.password is None):
            raise ConfigError("basic credentials need both --user and --password (or KEYQUEUE_DASHBOARD_USER "
                              "and KEYQUEUE_DASHBOARD_PASSWORD)")
        if not is_loopback(host) and not self.required:
            raise ConfigError(f"the dashboard listens on {host}, beyond this machine: give it a token (--token or "
                              "KEYQUEUE_DASHBOARD_TOKEN) or basic credentials (--user/--password or "
                              "KEYQUEUE_DASHBOARD_USER/KEYQUEUE_DASHBOARD_PASSWORD)")

    @property
    def required(self) -> bool:
        return self.token is not None or self.user is not None

    def describe(self) -> str:
        """What guards the dashboard, for its start line (never the secrets themselves)."""
        kinds = [kind for kind, given in (("a token", self.token), (f"basic credentials (user {self.user})", self.user))
                 if given]
        return " or ".join(kinds) if kinds else "nothing (loopback only)"

    def who(self, authorization: str | None, token_cookie: str | None) -> str | None:
        """Who the request comes from (``token`` or the user name), or None if it proves nothing."""
        if self.token is not None and token_cookie is not None and _same(token_cookie, self.token):
            return "token"
        if not authorization:
            return None
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and self.token is not None and _same(value.strip(), self.token):
            return "token"
        if scheme.lower() == "basic" and self.user is not None and self.password is not None:
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            if _same(user, self.user) & _same(password, self.password):
                return user
        return None


def new_csrf_token() -> str:
    return secrets.token_urlsafe(24)


def csrf_matches(cookie: str | None, submitted: str | None) -> bool:
    return bool(cookie) and bool(submitted) and _same(str(cookie), str(submitted))


def _same(a: str, b: str) -> bool:
    """Constant-time comparison of two texts (any characters)."""
    return hmac.compare_digest(a.encode(), b.encode())
