"""What the commands share: the ``--url`` option, loading an app, a connection, output, logging.

Commands that need an app load it with ``load_app`` (its settings carry the connection);
commands that only talk to NATS open ``connection(url)`` and check a queue with
``require_queue``. Output is JSON (``to_json``) or an aligned ``table``; ``follow`` prints live
messages for ``watch`` and ``events tail``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from keyqueue.admin.inspection import list_queues
from keyqueue.app.loading import load_app
from keyqueue.app.transport import open_connection
from keyqueue.errors import ConfigError, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.server.local import running_local_servers
from keyqueue.settings import Settings

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = [
    "LOG_FORMATS",
    "JsonLogFormatter",
    "configure_logging",
    "connection",
    "follow",
    "load_app",
    "no_such_queue",
    "require_queue",
    "table",
    "to_json",
    "url_option",
]


def url_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--url`` option every command that talks to NATS takes."""
    return click.option(
        "--url", metavar="URL", help="NATS server(s), comma-separated (default: $KEYQUEUE_URL)."
    )(fn)


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


async def no_such_queue(api: JetStreamApi, queue: str) -> ConfigError:
    """The one-line error for a queue the server does not have, naming the queues it has."""
    known = ", ".join(await list_queues(api)) or "none"
    return ConfigError(f"queue {queue!r} does not exist on this server; queues: {known} "
                       "(check the name, and --url or KEYQUEUE_URL)")


async def require_queue(api: JetStreamApi, queue: str) -> None:
    """Raise ``no_such_queue``'s error unless ``queue`` exists (its inbox stream does)."""
    try:
        await api.stream_info(QueueNames(queue).inbox_stream)
    except StreamNotFound:
        raise await no_such_queue(api, queue) from None


def to_json(value: Any, *, indent: int | None = None) -> str:
    """``value`` as one line of JSON (``indent``: over several lines); bytes as hex, datetimes in
    ISO 8601, anything else as its repr."""

    def fallback(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return obj.hex()
        if isinstance(obj, datetime):
            return obj.isoformat()
        return repr(obj)

    return json.dumps(value, default=fallback, ensure_ascii=False, indent=indent)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` under ``headers`` in left-aligned columns two spaces apart."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


LOG_FORMATS = ("text", "json")
"""What ``configure_logging`` can write: ``text`` lines, or one JSON object per line."""


def configure_logging(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level`` (debug, info, warning, error): ``text`` lines with time, level and
    logger name, or (``json``) one :class:`JsonLogFormatter` object per line."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])


_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
"""What every log record has; anything else on a record was given as ``extra``."""


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, then the record's ``extra`` fields (keyqueue's ``kq_queue``, ``kq_key``,
    ``kq_request_id``, ... without the ``kq_`` prefix) and, for a record with an exception, its
    ``traceback``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_ATTRIBUTES:
                entry.setdefault(name.removeprefix("kq_"), value)
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["traceback"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return to_json(entry)


async def follow(nc: Client, subjects: Sequence[str], render: Callable[[Msg], str | Sequence[str] | None], *,
                 count: int | None, timeout: float | None, banner: str) -> int:
    """Print ``render(msg)`` for each message on ``subjects`` until ``count`` lines, ``timeout``
    seconds, or SIGINT/SIGTERM; a message that renders to None is not printed or counted, one that
    renders to several lines (a batch of events) counts each."""
    done = asyncio.Event()
    seen = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal seen
        if done.is_set():
            # nats-py hands a burst that arrived at once to this callback before the unsubscribes
            # below run: the messages after the count, or after Ctrl-C, are not printed.
            return
        rendered = render(msg)
        if rendered is None:
            return
        for line in [rendered] if isinstance(rendered, str) else rendered:
            click.echo(line)
            seen += 1
            if count is not None and seen >= count:
                done.set()
                return

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
