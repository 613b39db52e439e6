"""The embedded nats-server an app uses when no URL is configured, shared on this machine.

With no ``KEYQUEUE_URL`` (and no ``url=``), the first process of app ``NAME`` that needs NATS
starts an embedded server whose JetStream store lives in ``<data dir>/NAME/store`` and writes
its URL to ``<data dir>/NAME/server.json``. Later processes of the same app (a producer beside a
``keyqueue worker``, a second worker) read that file and connect to the same server. A file lock
makes the check-and-start atomic, so two processes starting at once share one server.

The process that started the server owns it: when it exits, the server stops (its store stays,
so stored requests are kept for the next run). For a server independent of any app process, run
``keyqueue dev-server`` and set ``KEYQUEUE_URL``.

The data dir is ``$KEYQUEUE_DATA_DIR``, else ``$XDG_DATA_HOME/keyqueue``, else
``~/.local/share/keyqueue``.

Not in a pre-forking web server's processes (gunicorn, uWSGI): there, the process that started the
server is one web worker, which the web server recycles (``max_requests``, a timeout, a reload);
its server stops with it, and the other web workers, and the keyqueue workers, are left with a
server that is gone, or split across the old one and a new one. So there an app without a URL
raises ``ConfigError`` saying to run one server for all of them and set ``KEYQUEUE_URL``
(docs/decisions.md, "No embedded server under a pre-forking web server").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Final
from urllib.parse import urlsplit

from keyqueue.errors import ConfigError
from keyqueue.server.embedded import EmbeddedServer

try:
    import fcntl
except ImportError:  # Windows: no cross-process lock; concurrent first starts are the user's to avoid
    fcntl = None  # type: ignore[assignment]

__all__ = ["DATA_DIR_ENV", "LocalServer", "data_root", "running_local_servers"]

log = logging.getLogger("keyqueue.local_server")

DATA_DIR_ENV: Final = "KEYQUEUE_DATA_DIR"
"""Where embedded servers keep their stores and discovery files (one directory per app)."""

_SERVER_FILE: Final = "server.json"

WEB_SERVERS: Final = (("gunicorn.arbiter", "gunicorn"), ("uwsgi", "uWSGI"))
"""(module, name) of the pre-forking web servers whose processes get no embedded server: the module
is loaded in every process of that server (its master, and the workers it forks)."""


def web_server() -> str | None:
    """The pre-forking web server this process is part of, if any (see the module docstring)."""
    return next((name for module, name in WEB_SERVERS if module in sys.modules), None)


def data_root(environ: Mapping[str, str] | None = None) -> Path:
    """The directory holding one sub-directory per app's embedded server."""
    env = os.environ if environ is None else environ
    if configured := env.get(DATA_DIR_ENV):
        return Path(configured).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "keyqueue"


def _answers(url: str) -> bool:
    """Whether something accepts TCP connections at ``url``'s host and port (quick, blocking)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=1):
            return True
    except OSError:
        return False


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("url"), str) else None


def running_local_servers(root: Path | None = None) -> dict[str, str]:
    """App name -> URL of every embedded server under ``root`` that answers now."""
    root = data_root() if root is None else root
    found = {}
    for path in sorted(root.glob(f"*/{_SERVER_FILE}")):
        info = _read(path)
        if info is not None and _answers(info["url"]):
            found[path.parent.name] = info["url"]
    return found


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[IO[str]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


class LocalServer:
    """Finds or starts app ``name``'s embedded server; stops it on ``close`` if it started it."""

    def __init__(self, name: str, root: Path | None = None) -> None:
        self.name = name
        self.root = root
        self._server: EmbeddedServer | None = None
        self._url: str | None = None

    @property
    def directory(self) -> Path:
        return (data_root() if self.root is None else self.root) / self.name

    @property
    def owned(self) -> bool:
        """Whether this process started the server (and stops it on ``close``)."""
        return self._server is not None

    def forget_after_fork(self) -> None:
        """In a forked child: the server (if this process started it) is the parent's to stop; keep its URL."""
        self._server = None

    async def url(self) -> str:
        """The URL of the app's embedded server, starting it if none answers."""
        if self._url is not None and (self._server is None or self._server.running):
            return self._url
        return await asyncio.to_thread(self._find_or_start)

    def _find_or_start(self) -> str:
        server_name = web_server()
        if server_name is not None:
            raise ConfigError(
                f"no KEYQUEUE_URL configured, and this process is part of {server_name}: an embedded nats-server "
                f"would belong to one web worker and stop when {server_name} recycles it, leaving the other web "
                "workers and the keyqueue workers on a server that is gone, or split across two. Run one server "
                "for all of them (in development: keyqueue dev-server --store-dir ./nats-data) and set "
                f"KEYQUEUE_URL=nats://127.0.0.1:4222 for {server_name} and for keyqueue worker")
        directory = self.directory
        with _locked(directory / "server.lock"):
            info = _read(directory / _SERVER_FILE)
            if info is not None and _answers(info["url"]):
                self._url = info["url"]
                log.warning(
                    "no KEYQUEUE_URL configured: using app %r's embedded nats-server at %s (started by pid %s); "
                    "export KEYQUEUE_URL=%s to make this explicit", self.name, self._url, info.get("pid"), self._url,
                )
                return self._url
            server = EmbeddedServer(store_dir=directory / "store", log_file=directory / "nats-server.log")
            try:
                server.start_sync()
            except BaseException:
                server.close_sync()
                raise
            self._server, self._url = server, server.url
            (directory / _SERVER_FILE).write_text(json.dumps({"url": server.url, "pid": os.getpid()}))
        log.warning(
            "no KEYQUEUE_URL configured: started an embedded nats-server for app %r at %s (store %s); it stops "
            "when this process exits. Other processes of this app on this machine find it; elsewhere, "
            "export KEYQUEUE_URL=%s", self.name, server.url, directory / "store", server.url,
        )
        return server.url

    async def close(self) -> None:
        """Stop the server if this process started it (its store is kept)."""
        server, self._server, self._url = self._server, None, None
        if server is None:
            return
        with contextlib.suppress(OSError):
            info = _read(self.directory / _SERVER_FILE)
            if info is not None and info.get("pid") == os.getpid():
                (self.directory / _SERVER_FILE).unlink()
        await server.stop()
        server.close_sync()

