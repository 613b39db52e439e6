"""How to reach NATS: one frozen value, built from a URL or from ``KEYQUEUE_*`` variables.

The environment is read only by ``Settings.from_env`` (called at the edge, e.g. by the CLI);
everything else takes a ``Settings``. ``url=None`` means "no server given: run the embedded one".
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final, Self
from urllib.parse import urlsplit

from keyqueue.errors import ConfigError

__all__ = ["Settings"]

_SCHEMES: Final = ("nats", "tls", "ws", "wss")
"""The URL schemes nats-py connects with; a server without one is ``nats://``."""

_SECRET_FIELDS: Final = frozenset({"password", "token"})
_MASK: Final = "***"

_ENV_FIELDS: Final = {
    "URL": "url",
    "CREDS": "creds_file",
    "NKEY_SEED": "nkey_seed",
    "TOKEN": "token",
    "USER": "user",
    "PASSWORD": "password",
    "TLS_CA": "tls_ca",
    "TLS_CERT": "tls_cert",
    "TLS_KEY": "tls_key",
    "TLS_HOSTNAME": "tls_hostname",
    "NAME": "name",
}
"""Environment variable suffix -> string field (``KEYQUEUE_CONNECT_TIMEOUT`` is parsed apart)."""


@dataclass(frozen=True, repr=False)
class Settings:
    """Connection settings for NATS.

    ``url`` may list several servers separated by commas, each ``nats://``, ``tls://``, ``ws://``
    or ``wss://`` (``nats://`` when it has no scheme); ``None`` asks for the embedded server.
    File fields (``creds_file``, ``nkey_seed``, ``tls_*``) are paths, read when the connection
    options are built. ``repr()`` masks passwords, tokens and URL credentials.
    """

    url: str | None = None
    creds_file: str | None = None
    """A ``.creds`` file (JWT + nkey seed), as issued by an operator."""
    nkey_seed: str | None = None
    """A file holding an nkey seed (``SU...``)."""
    token: str | None = None
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    """CA bundle to verify the server with (the system's when unset)."""
    tls_cert: str | None = None
    """Client certificate for mutual TLS (may also hold the key)."""
    tls_key: str | None = None
    tls_hostname: str | None = None
    """The name to verify the server certificate against, when it differs from the URL's host."""
    connect_timeout: float = 5.0
    """Seconds to wait for each connection attempt."""
    name: str | None = None
    """The client name the server shows in its connection lists."""

    def __post_init__(self) -> None:
        if not self.connect_timeout > 0:  # also rejects NaN
            raise ConfigError(
                f"connect_timeout must be a positive number of seconds, not {self.connect_timeout}"
            )
        if self.url is not None and not self._servers():
            raise ConfigError(f"url {self.url!r} names no server; use e.g. nats://127.0.0.1:4222")
        for server in self._servers():
            scheme, sep, _ = server.partition("://")
            if sep and scheme not in _SCHEMES:
                raise ConfigError(
                    f"url {_mask_url_credentials(server)!r} has the scheme {scheme!r}; NATS URLs use "
                    f"{', '.join(s + '://' for s in _SCHEMES)} (e.g. nats://127.0.0.1:4222)"
                )
        if self.password is not None and self.user is None:
            raise ConfigError("a password was given without a user")
        if self.tls_key is not None and self.tls_cert is None:
            raise ConfigError("tls_key was given without tls_cert (the client certificate)")

    # --- construction ---

    @classmethod
    def from_url(cls, url: str | None, **overrides: Any) -> Self:
        """Settings for ``url`` (comma-separated for several servers); other fields as keywords."""
        return cls(url=url, **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "KEYQUEUE_") -> Self:
        """Settings from ``<prefix>URL``, ``<prefix>CREDS``, ... (``os.environ`` by default).

        Empty variables count as unset. ``<prefix>CONNECT_TIMEOUT`` is in seconds.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            field: value for suffix, field in _ENV_FIELDS.items() if (value := env.get(prefix + suffix))
        }
        if raw_timeout := env.get(prefix + "CONNECT_TIMEOUT"):
            try:
                timeout = float(raw_timeout)
            except ValueError:
                timeout = float("nan")
            if not timeout > 0:  # also rejects NaN
                raise ConfigError(
                    f"{prefix}CONNECT_TIMEOUT must be a positive number of seconds, not {raw_timeout!r}"
                )
            values["connect_timeout"] = timeout
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {prefix}* environment variables)") from None

    def with_url(self, url: str | None) -> Self:
        """A copy pointing at ``url`` (e.g. the embedded server's, once it runs)."""
        return replace(self, url=url)

    # --- use ---

    @property
    def uses_embedded_server(self) -> bool:
        """Whether no URL was given, so keyqueue should run its embedded nats-server."""
        return self.url is None

    def nats_connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect(**options)``.

        The client reconnects forever: a queue worker outlives server restarts. It buffers
        nothing while disconnected (``pending_size=0``): a publish then fails at once instead of
        going out after the reconnect, when the lease it acted for may have ended. Raises
        ``ConfigError`` if there is no URL yet or a credentials/TLS file is missing or invalid.
        """
        if self.url is None:
            raise ConfigError("no NATS URL: start the embedded server and use settings.with_url(server.url)")
        options: dict[str, Any] = {
            "servers": self._servers(),
            "connect_timeout": self.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "pending_size": 0,
        }
        if self.name is not None:
            options["name"] = self.name
        if self.creds_file is not None:
            options["user_credentials"] = _existing(self.creds_file, "creds file")
        if self.nkey_seed is not None:
            options["nkeys_seed"] = _existing(self.nkey_seed, "nkey seed file")
        if self.token is not None:
            options["token"] = self.token
        if self.user is not None:
            options["user"] = self.user
        if self.password is not None:
            options["password"] = self.password
        if self._wants_tls():
            options["tls"] = self._ssl_context()
        if self.tls_hostname is not None:
            options["tls_hostname"] = self.tls_hostname
        return options

    def __repr__(self) -> str:
        shown = []
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None or (field.name == "connect_timeout" and value == field.default):
                continue
            if field.name in _SECRET_FIELDS:
                value = _MASK
            elif field.name == "url":
                value = _mask_url_credentials(value)
            shown.append(f"{field.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    # --- internals ---

    def _servers(self) -> list[str]:
        return [server.strip() for server in (self.url or "").split(",") if server.strip()]

    def _wants_tls(self) -> bool:
        tls_files = (self.tls_ca, self.tls_cert, self.tls_key)
        return any(tls_files) or any(urlsplit(server).scheme == "tls" for server in self._servers())

    def _ssl_context(self) -> ssl.SSLContext:
        ca = _existing(self.tls_ca, "TLS CA file") if self.tls_ca is not None else None
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"TLS CA file {ca} is not a valid PEM bundle: {exc}") from None
        if self.tls_cert is not None:
            cert = _existing(self.tls_cert, "TLS certificate")
            key = _existing(self.tls_key, "TLS key") if self.tls_key is not None else None
            try:
                context.load_cert_chain(cert, key)
            except ssl.SSLError as exc:
                raise ConfigError(f"cannot load TLS certificate {cert} (key {key or cert}): {exc}") from None
        return context


def _existing(path: str, what: str) -> str:
    """``path`` if it is a readable file, else a ConfigError naming it."""
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ConfigError(f"{what} {path} does not exist or is not a file")
    return str(resolved)


def _mask_url_credentials(url: str) -> str:
    """``url`` with passwords and tokens in ``user:password@`` / ``token@`` parts masked."""
    masked = []
    for server in url.split(","):
        scheme, sep, rest = server.partition("://")
        if not sep:
            scheme, rest = "", server
        userinfo, at, host = rest.rpartition("@")
        if at:
            user, colon, _ = userinfo.partition(":")
            # A bare "secret@host" is a token; "user:secret@host" a user and password.
            userinfo = f"{user}:{_MASK}" if colon else _MASK
            rest = f"{userinfo}@{host}"
        masked.append(f"{scheme}{sep}{rest}")
    return ",".join(masked)
