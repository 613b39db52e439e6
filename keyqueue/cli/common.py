"""What the commands share: the ``--url`` option, loading an app, a connection, output, logging.

Commands that need an app load it with ``load_app`` (its settings carry the connection);
commands that only talk to NATS open ``connection(url)``. Output is JSON (``to_json``) or an
aligned ``table``; ``follow`` prints live messages for ``watch`` and ``events tail``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from keyqueue.app.application import App, default_app
from keyqueue.app.transport import open_connection
from keyqueue.errors import ConfigError
from keyqueue.server.local import running_local_servers
from keyqueue.settings import Settings

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["configure_logging", "connection", "follow", "load_app", "table", "to_json", "url_option"]


def url_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--url`` option every command that talks to NATS takes."""
    return click.option(
        "--url", metavar="URL", help="NATS server(s), comma-separated (default: $KEYQUEUE_URL)."
    )(fn)


def load_app(spec: str, url: str | None = None) -> App:
    """The ``App`` named by ``MODULE:APP`` (``MODULE`` alone: its ``app``), with ``url`` if given.

    The current directory is importable, as with ``python -m``.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or (spec.count(":") > 1):
        raise ConfigError(f"{spec!r} is not MODULE:APP (for example shop:app, or examples.quickstart.app:app)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(f"cannot import {module_name!r}: no module named {exc.name!r} "
                              f"(looked in {os.getcwd()} and the installed packages)") from None
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc} "
                          f"(python -c 'import {module_name}' shows the traceback)") from None
    if attribute:
        if not hasattr(module, attribute):
            raise ConfigError(f"module {module_name!r} has no attribute {attribute!r}")
        app = getattr(module, attribute)
    else:
        app = getattr(module, "app", None)
        if app is None:
            app = default_app()
    if not isinstance(app, App):
        raise ConfigError(f"{spec} is a {type(app).__name__}, not a keyqueue.App")
    if url is not None:
        app.settings = app.settings.with_url(url)
    return app


@contextlib.asynccontextmanager
async def connection(url: str | None) -> AsyncIterator[Client]:
    """A connection for commands that need no app: --url, $KEYQUEUE_URL, else a running embedded server."""
    nc = await _connect(url)
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _connect(url: str | None) -> Client:
    settings = Settings.from_env()
    if url is not None:
        settings = settings.with_url(url)
    if settings.url is None:
        running = running_local_servers()
        if len(running) == 1:
            [(app_name, found)] = running.items()
            click.echo(f"no KEYQUEUE_URL: using app {app_name}'s embedded nats-server at {found}", err=True)
            settings = settings.with_url(found)
        elif running:
            raise ConfigError(f"several embedded servers are running ({', '.join(running)}); pick one with --url")
        else:
            raise ConfigError("no NATS server: set KEYQUEUE_URL or pass --url (`keyqueue dev-server` runs one)")
    return await open_connection(settings, name="keyqueue-cli")


def to_json(value: Any) -> str:
    """``value`` as one line of JSON; bytes as hex, datetimes in ISO 8601, anything else as its repr."""

    def fallback(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return obj.hex()
        if isinstance(obj, datetime):
            return obj.isoformat()
        return repr(obj)

    return json.dumps(value, default=fallback, ensure_ascii=False)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` under ``headers`` in left-aligned columns two spaces apart."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (debug, info, warning, error) with time, level and logger name."""
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


async def follow(nc: Client, subjects: Sequence[str], render: Callable[[Msg], str | None], *,
                 count: int | None, timeout: float | None, banner: str) -> int:
    """Print ``render(msg)`` for each message on ``subjects`` until ``count`` messages, ``timeout``
    seconds, or SIGINT/SIGTERM; a message that renders to None is not printed or counted."""
    done = asyncio.Event()
    seen = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal seen
        line = render(msg)
        if line is None:
            return
        click.echo(line)
        seen += 1
        if count is not None and seen >= count:
            done.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, done.set)
    subs = [await nc.subscribe(subject, cb=on_msg) for subject in subjects]
    await nc.flush()
    click.echo(banner, err=True)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        for sub in subs:
            await sub.unsubscribe()
    return seen
