"""The ``keyqueue`` command line: one click group, one function per command.

Commands raise keyqueue's own errors; ``KeyqueueGroup`` turns any ``KeyqueueError`` into one
line on stderr and a non-zero exit, so no command needs its own error handling. Plugins add
commands through the ``keyqueue_add_commands`` hook; the group looks them up lazily.

    worker      serve an app's queues            enqueue     enqueue a task by name
    inspect     what a queue holds               dlq         list, show, replay dead requests
    watch       follow a key's progress          plugins     loaded plugins and their hooks
    dev-server  a local nats-server
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TypeVar

import click

from keyqueue.admin.dead_letters import DeadLetter, dead_letters, get_dead_letter, replay
from keyqueue.admin.inspection import KEY_LIMIT, QueueReport, inspect_queue, list_queues
from keyqueue.app.application import App, default_app
from keyqueue.app.transport import open_connection
from keyqueue.errors import ConfigError, ConnectionFailed, KeyqueueError, StreamNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.plugins.manager import PluginManager, autoload_disabled
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.server.local import running_local_servers
from keyqueue.settings import Settings
from keyqueue.tasks.task import BatchTask, Receipt
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["main"]

T = TypeVar("T")

EXIT_ERROR: Final = 1
"""Exit status when a command fails with a keyqueue error (click uses 2 for usage errors)."""

BULK_CHUNK: Final = 500
"""Requests ``keyqueue enqueue --from-file`` publishes per pipelined batch."""


# --- the group and its error handling ---------------------------------------------------------


class KeyqueueGroup(click.Group):
    """A click group whose commands report keyqueue errors as one line, without a traceback.

    ``KeyqueueError`` is what keyqueue raises for things the user can fix (a missing binary, a
    port in use, bad settings, an unreachable server); anything else is a bug and keeps its
    traceback. Commands that plugins add (``keyqueue_add_commands``) are found on demand.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyqueueError as exc:
            raise KeyqueueClickError(exc) from exc

    def _plugin_commands(self) -> dict[str, click.Command]:
        collector = click.Group()
        PluginManager(autoload=not autoload_disabled()).hook.keyqueue_add_commands(cli=collector)
        return {name: cmd for name, cmd in collector.commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        try:
            extra = list(self._plugin_commands())
        except KeyqueueError as exc:
            click.echo(f"Warning: plugin commands are not listed: {exc}", err=True)
            extra = []
        return sorted([*super().list_commands(ctx), *extra])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or self._plugin_commands().get(cmd_name)


class KeyqueueClickError(click.ClickException):
    """A keyqueue error as click reports it: ``Error: <message>`` on stderr."""

    exit_code = EXIT_ERROR

    def __init__(self, error: KeyqueueError) -> None:
        super().__init__(f"{error}")
        self.error = error


@click.group(
    cls=KeyqueueGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="keyqueue", prog_name="keyqueue")
def main() -> None:
    """keyqueue runs tasks with exclusive, ordered work per key, on NATS JetStream.

    Requests for the same key never run at the same time and run in the order they were
    enqueued; requests for different keys run in parallel across workers.

    \b
    Start here:
      keyqueue dev-server            run a local nats-server with JetStream
      export KEYQUEUE_URL=...        point everything else at it (the URL it prints)
      keyqueue worker shop:app       serve the tasks of `app` in shop.py

    The connection is configured with KEYQUEUE_* environment variables (KEYQUEUE_URL,
    KEYQUEUE_CREDS, KEYQUEUE_TLS_CA, ...) or --url. Run `keyqueue COMMAND --help` for a
    command's options and an example.
    """


# --- shared helpers --------------------------------------------------------------------------


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


def _settings(url: str | None) -> Settings:
    settings = Settings.from_env()
    return settings.with_url(url) if url is not None else settings


async def _connect(url: str | None) -> Client:
    """A connection for commands that need no app: --url, $KEYQUEUE_URL, else a running embedded server."""
    settings = _settings(url)
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


def _run(make: Callable[[], Awaitable[T]]) -> T:
    async def run() -> T:
        return await make()

    return asyncio.run(run())


@contextlib.asynccontextmanager
async def _connection(url: str | None) -> Any:
    nc = await _connect(url)
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def _json(value: Any) -> str:
    def fallback(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return obj.hex()
        if isinstance(obj, datetime):
            return obj.isoformat()
        return repr(obj)

    return json.dumps(value, default=fallback, ensure_ascii=False)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


# --- worker ------------------------------------------------------------------------------------


@main.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--queue", "-q", "queues", multiple=True, metavar="QUEUE",
              help="Serve only this queue (repeatable; default: all of the app's queues).")
@click.option("--concurrency", "-c", type=click.IntRange(1), default=16, show_default=True,
              help="Keys held at once, per queue.")
@click.option("--linger", type=click.FloatRange(0), default=0.05, show_default=True,
              help="Seconds a key stays held with no new request.")
@click.option("--ack-wait", type=click.FloatRange(1), default=None,
              help="Seconds of a key's lease (default: the queue's configuration, 30).")
@click.option("--drain-timeout", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Seconds a stopping worker waits for the requests in hand.")
@click.option("--name", default=None, metavar="NAME",
              help="This worker's name in logs, events and inspect (default: host:pid).")
@click.option("--overflow-min-pending", type=click.IntRange(0), default=0, metavar="N",
              help="Overflow queues: take keys only while N or more wait for a worker.")
@click.option("--overflow-min-ack-pending", type=click.IntRange(0), default=0, metavar="N",
              help="Overflow queues: take keys only while N or more are held fleet-wide.")
@click.option("--priority", type=click.IntRange(0, 9), default=None, metavar="P",
              help="Prioritized queues: 0 (served first) to 9. See docs/priority-groups.md.")
@click.option("--connect-timeout", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="How long to wait for an unreachable server at start, retrying with a backoff and "
                   "logging each attempt (default: wait forever).")
@url_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def worker(app_spec: str, queues: tuple[str, ...], concurrency: int, linger: float, ack_wait: float | None,
           drain_timeout: float, name: str | None, overflow_min_pending: int, overflow_min_ack_pending: int,
           priority: int | None, connect_timeout: float | None, url: str | None, log_level: str) -> None:
    """Serve the tasks and processors of an app until SIGINT or SIGTERM.

    MODULE:APP names the App, e.g. shop:app for `app` in shop.py (the current directory is
    importable). The first signal drains: requests in hand finish (up to --drain-timeout) and
    the worker's keys move to other workers at once; a second signal stops immediately.

    With no URL configured, the worker runs the app's embedded nats-server (and says so in its
    log); producers of the same app on this machine find it. A configured server that is not up
    yet is waited for (each attempt logged) for --connect-timeout seconds, by default forever.

    \b
    Example:
      $ export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ keyqueue worker examples.quickstart.app:app --concurrency 32
      $ keyqueue worker shop:app --overflow-min-pending 50     # an overflow pool
    """
    _configure_logging(log_level)
    app = load_app(app_spec, url)
    serving = app.worker(queues=list(queues) or None, concurrency=concurrency, linger=linger, ack_wait=ack_wait,
                         drain_timeout=drain_timeout, name=name, overflow_min_pending=overflow_min_pending,
                         overflow_min_ack_pending=overflow_min_ack_pending, priority=priority,
                         connect_timeout=connect_timeout)

    async def run() -> None:
        try:
            await serving.serve()
        finally:
            await app.close()

    _run(run)


# --- enqueue -----------------------------------------------------------------------------------


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"invalid JSON in {where}: {exc}") from None


def _receipt_line(receipt: Receipt) -> str:
    return _json({"request_id": receipt.request_id, "key": receipt.key, "seq": receipt.seq,
                  "duplicate": receipt.duplicate})


def _read_lines(handle: IO[str]) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


@main.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.argument("task_name", metavar="TASK")
@click.argument("arguments", metavar="[JSON]", required=False)
@click.option("--from-file", "from_file", type=click.File("r"), metavar="PATH",
              help="Enqueue one request per line of JSON ('-' reads stdin).")
@click.option("--wait", is_flag=True, help="Wait for the result and print it as JSON.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              help="Seconds --wait waits.")
@click.option("--request-id", metavar="ID", help="The request id (an idempotency key within the duplicate window).")
@url_option
def enqueue(app_spec: str, task_name: str, arguments: str | None, from_file: IO[str] | None, wait: bool,
            timeout: float, request_id: str | None, url: str | None) -> None:
    """Enqueue a task of an app by name, with JSON arguments.

    JSON is an object of keyword arguments (for a batch task: the item). Prints the receipt
    (request id, key, inbox sequence) as JSON, or with --wait the result. --from-file takes JSON
    lines, one request each, with a progress bar.

    \b
    Examples:
      $ keyqueue enqueue examples.quickstart.app:app charge '{"order_id": "o1", "amount": 5}'
      {"request_id": "01J...", "key": "o1", "seq": 1, "duplicate": false}
      $ keyqueue enqueue examples.quickstart.app:app charge '{"order_id": "o1", "amount": 5}' --wait
      $ keyqueue enqueue examples.quickstart.app:app charge --from-file orders.jsonl
    """
    if (arguments is None) == (from_file is None):
        raise click.UsageError("give the arguments as JSON or --from-file, not both or neither")
    app = load_app(app_spec, url)
    task = app.find_task(task_name)
    batch = isinstance(task, BatchTask)

    def check(value: Any, where: str) -> Any:
        if not batch and not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object of keyword arguments for {task_name}, "
                              f"not {type(value).__name__}")
        return value

    async def one(value: Any) -> None:
        bound = task.options(request_id=request_id, timeout=timeout)
        args: tuple[Any, ...] = (value,) if batch else ()
        kwargs: dict[str, Any] = {} if batch else value
        try:
            if wait:
                click.echo(_json(await bound.call(*args, **kwargs)))
            else:
                click.echo(_receipt_line(await bound.enqueue(*args, **kwargs)))
        finally:
            await app.close()

    async def many(handle: IO[str]) -> None:
        items = [check(_parse_json(line, f"line {n}"), f"line {n}") for n, line in _read_lines(handle)]
        stored = duplicates = 0
        try:
            with click.progressbar(length=len(items), label=f"enqueueing {task_name}", file=sys.stderr) as bar:
                for start in range(0, len(items), BULK_CHUNK):
                    chunk = items[start:start + BULK_CHUNK]
                    try:
                        receipts = await task.enqueue_many(chunk)
                    except TypeError as exc:
                        raise ConfigError(f"lines {start + 1}-{start + len(chunk)}: {exc}") from None
                    stored += len(receipts)
                    duplicates += sum(r.duplicate for r in receipts)
                    bar.update(len(chunk))
        finally:
            await app.close()
        click.echo(f"enqueued {stored} {task_name} request(s)" + (f", {duplicates} duplicate(s)" if duplicates else ""))

    try:
        if from_file is not None:
            _run(lambda: many(from_file))
        else:
            assert arguments is not None
            _run(lambda: one(check(_parse_json(arguments, "the arguments"), "the arguments")))
    except TypeError as exc:  # arguments that do not fit the task's signature
        raise ConfigError(str(exc)) from None


# --- inspect -----------------------------------------------------------------------------------


async def _report(api: JetStreamApi, queue: str) -> QueueReport:
    try:
        return await inspect_queue(api, queue)
    except StreamNotFound:
        known = ", ".join(await list_queues(api)) or "none"
        raise ConfigError(f"queue {queue!r} does not exist on this server; queues: {known}") from None


@main.command("inspect")
@click.argument("queue", required=False)
@url_option
def inspect_command(queue: str | None, url: str | None) -> None:
    """Show what a queue holds: keys with backlog, keys held, pending tokens, DLQ, consumer.

    Without QUEUE, one line per queue on the server.

    \b
    Examples:
      $ keyqueue inspect                 # every queue
      $ keyqueue inspect shop            # keys of queue shop, most backlog first
    """

    async def run() -> None:
        async with _connection(url) as nc:
            api = JetStreamApi(nc)
            if queue is None:
                queues = await list_queues(api)
                if not queues:
                    click.echo("no queues on this server")
                    return
                rows = []
                for name in queues:
                    r = await _report(api, name)
                    rows.append([name, r.requests, r.keys_with_backlog, r.keys_held, r.pending_tokens, r.dlq_size])
                click.echo(_table(["QUEUE", "REQUESTS", "KEYS", "HELD", "PENDING TOKENS", "DLQ"], rows))
                return
            r = await _report(api, queue)
            c = r.consumer
            click.echo(f"queue {r.queue}: {r.requests} request(s) on {r.keys_with_backlog} key(s); "
                       f"{r.keys_held} key(s) held; {r.pending_tokens} pending token(s); DLQ {r.dlq_size}")
            click.echo(f"consumer: ack_pending={c['ack_pending']} redelivered={c['redelivered']} "
                       f"waiting_pulls={c['waiting_pulls']} ack_wait={c['ack_wait_s']:g}s "
                       f"max_ack_pending={c['max_ack_pending']} priority={c['priority_policy']}")
            if c.get("pinned"):
                click.echo(f"pinned: {c['pinned']}")
            if r.keys:
                click.echo()
                click.echo(_table(["KEY", "BACKLOG", "TOKEN"], [[k.key, k.backlog, k.token] for k in r.keys]))
                if r.truncated:
                    click.echo(f"(first {KEY_LIMIT} keys)")

    _run(run)


@main.command()
@click.argument("queue")
@url_option
def unpin(queue: str, url: str | None) -> None:
    """Move the pin of a pinned_client queue: the server drops it and pins a worker afresh.

    \b
    Example:
      $ keyqueue unpin shop
    """

    async def run() -> None:
        names = QueueNames(queue)
        async with _connection(url) as nc:
            api = JetStreamApi(nc)
            info = await api.consumer_info(names.token_stream, names.consumer)
            groups = info.get("config", {}).get("priority_groups") or []
            if info.get("config", {}).get("priority_policy") != "pinned_client" or not groups:
                raise ConfigError(f"queue {queue!r} is not a pinned_client queue; nothing to unpin")
            for group in groups:
                await api.unpin(names.token_stream, names.consumer, group)
            click.echo(f"unpinned queue {queue} (group {', '.join(groups)}); the next delivery pins a worker afresh")

    _run(run)


@main.command("recreate-consumer")
@click.argument("queue")
@click.option("--app", "app_spec", metavar="MODULE:APP", default=None,
              help="Take the queue's configuration (priority policy, ack wait) from this app.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@url_option
def recreate_consumer(queue: str, app_spec: str | None, yes: bool, url: str | None) -> None:
    """Delete and recreate a queue's token consumer, to change its priority policy or lease.

    Stop every worker of the queue first: the new consumer delivers every remaining token again,
    so a worker still holding a key would share it. Requests are kept.

    \b
    Example:
      $ keyqueue recreate-consumer shop --app shop:app --yes
    """
    config = load_app(app_spec, url).queue_config(queue) if app_spec else QueueConfig(queue)
    if not yes:
        click.confirm(f"Recreate the token consumer of queue {queue!r} (policy {config.priority_policy})? "
                      "Every worker of the queue must be stopped", abort=True)

    async def run() -> None:
        async with _connection(url) as nc:
            await Topology(JetStreamApi(nc), config).recreate_consumer()
        click.echo(f"recreated consumer {config.names.consumer} of queue {queue} "
                   f"(priority policy {config.priority_policy})")

    _run(run)


# --- dlq ---------------------------------------------------------------------------------------


@main.group(cls=KeyqueueGroup)
def dlq() -> None:
    """List, show and replay a queue's dead-lettered requests.

    \b
    Examples:
      $ keyqueue dlq list shop --key o1
      $ keyqueue dlq show shop 3
      $ keyqueue dlq replay shop --key o1
    """


@dlq.command("list")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
@url_option
def dlq_list(queue: str, key: str | None, limit: int, url: str | None) -> None:
    """List dead requests, oldest first.

    \b
    Example:
      $ keyqueue dlq list shop
      SEQ  KEY  TASK    REASON        ATTEMPTS  ERROR
      1    o3   charge  max-attempts  5         ValueError: negative amount
    """

    async def run() -> None:
        async with _connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                letters = await dead_letters(api, queue, key=key, limit=limit)
            except StreamNotFound:
                raise ConfigError(f"queue {queue!r} has no dead-letter stream on this server") from None
            if not letters:
                click.echo(f"no dead requests in queue {queue}" + (f" for key {key}" if key else ""))
                return
            rows = [[d.seq, d.key, d.message_type, d.reason, d.attempts, f"{d.error_type}: {d.error_message}"]
                    for d in letters]
            click.echo(_table(["SEQ", "KEY", "TASK", "REASON", "ATTEMPTS", "ERROR"], rows))

    _run(run)


def _show(letter: DeadLetter) -> str:
    fields = {
        "seq": letter.seq, "key": letter.key, "request_id": letter.request_id, "task": letter.message_type,
        "version": letter.version, "reason": letter.reason, "error": f"{letter.error_type}: {letter.error_message}",
        "attempts": letter.attempts, "original_seq": letter.original_seq, "dead_lettered_at": letter.time,
        "arguments": letter.body(),
    }
    if letter.truncated_from is not None:
        fields["truncated_from"] = letter.truncated_from
    return _json(fields)


@dlq.command("show")
@click.argument("queue")
@click.argument("seq", type=click.IntRange(1))
@url_option
def dlq_show(queue: str, seq: int, url: str | None) -> None:
    """Show one dead request (by its DLQ sequence) as JSON, with its decoded arguments.

    \b
    Example:
      $ keyqueue dlq show shop 1
    """

    async def run() -> None:
        async with _connection(url) as nc:
            click.echo(_show(await get_dead_letter(JetStreamApi(nc), queue, seq)))

    _run(run)


@dlq.command("replay")
@click.argument("queue")
@click.option("--key", metavar="KEY", help="Only this key's dead requests.")
@url_option
def dlq_replay(queue: str, key: str | None, url: str | None) -> None:
    """Enqueue dead requests again, in their original order, and remove them from the DLQ.

    Each gets a new request id (<id>.replay-<seq>) and joins the back of its key's backlog. Only
    the requests in the DLQ when the replay begins are replayed; an incomplete copy (its body cut
    to fit the server's max_payload) stays in the DLQ.

    \b
    Example:
      $ keyqueue dlq replay shop --key o3
      replayed 2 request(s)
    """

    async def run() -> None:
        async with _connection(url) as nc:
            api = JetStreamApi(nc)
            names = QueueNames(queue)
            try:
                letters = await dead_letters(api, queue, key=key)
            except StreamNotFound:
                raise ConfigError(f"queue {queue!r} has no dead-letter stream on this server") from None
            skipped: list[DeadLetter] = []

            def skip(letter: DeadLetter) -> None:
                skipped.append(letter)
                bar.update(1)

            with click.progressbar(length=len(letters), label=f"replaying {queue}", file=sys.stderr) as bar:
                count = await replay(api, Publisher(nc, names), queue, key=key, on_replayed=lambda _: bar.update(1),
                                     on_skipped=skip)
            click.echo(f"replayed {count} request(s)")
            if skipped:
                click.echo(f"left {len(skipped)} incomplete dead request(s) in the DLQ (sequences "
                           f"{', '.join(str(d.seq) for d in skipped)}): their copies are truncated")

    _run(run)


# --- watch -------------------------------------------------------------------------------------


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


def _progress_line(msg: Msg) -> str:
    headers = msg.headers or {}
    try:
        value: Any = loads(msg.data, headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
    except WireError as exc:
        value = f"<undecodable: {exc}>"
    stamp = datetime.now(UTC).strftime("%H:%M:%S.%f")[:-3]
    key = msg.subject.split(".", 3)[-1]
    return f"{stamp} {key} {headers.get(H.REQUEST_ID, '-')} {_json(value)}"


@main.command()
@click.argument("queue")
@click.argument("key")
@click.option("--count", type=click.IntRange(1), help="Exit after this many progress messages.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), help="Exit after this many seconds.")
@url_option
def watch(queue: str, key: str, count: int | None, timeout: float | None, url: str | None) -> None:
    """Follow a key's live progress (what tasks publish with ctx.progress(...)).

    KEY may end in NATS wildcards ('*' one token, '>' the rest) to follow many keys. Runs until
    Ctrl-C, --count messages or --timeout seconds.

    \b
    Example:
      $ keyqueue watch shop o1
      12:00:01.250 o1 01J... {"step": "authorising"}
    """

    async def run() -> None:
        async with _connection(url) as nc:
            await follow(nc, [QueueNames(queue).progress(key)], _progress_line, count=count, timeout=timeout,
                         banner=f"watching {queue} {key} (Ctrl-C to stop)")

    _run(run)


# --- plugins -----------------------------------------------------------------------------------


@main.command()
def plugins() -> None:
    """List the loaded plugins and the hooks each implements.

    Third-party plugins come from the `keyqueue` entry-point group; set
    KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD=1 to start without them.

    \b
    Example:
      $ keyqueue plugins
    """
    disabled = autoload_disabled()
    manager = PluginManager(autoload=not disabled)
    for info in manager.listing():
        origin = "built-in" if info.builtin else info.distribution or "registered"
        click.echo(f"{info.name} ({origin})")
        click.echo("  " + (", ".join(info.hooks) or "no hooks"))
    if disabled:
        click.echo("(entry-point plugins not loaded: KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD is set)")


# --- dev-server --------------------------------------------------------------------------------


@main.command("dev-server")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=4222,
    show_default=True,
    help="Client port on 127.0.0.1; 0 picks a free one.",
)
@click.option(
    "--store-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep JetStream data in this directory across runs (default: a temporary one, deleted on exit).",
)
def dev_server(port: int, store_dir: Path | None) -> None:
    """Run a local nats-server with JetStream in the foreground, for development.

    It listens on 127.0.0.1 only and stops cleanly on Ctrl-C or SIGTERM.

    \b
    Example:
      $ keyqueue dev-server --store-dir .keyqueue-data
      nats-server with JetStream on nats://127.0.0.1:4222
      export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ # in another terminal: paste the export line, then run workers and enqueue tasks
    """
    asyncio.run(_serve(EmbeddedServer(port=port, store_dir=store_dir), persistent=store_dir is not None))


async def _serve(server: EmbeddedServer, *, persistent: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with server:
            kept = "kept" if persistent else "temporary, deleted on exit"
            click.echo(f"nats-server with JetStream on {server.url}")
            click.echo(f"store: {server.store_dir} ({kept}); log: {server.log_file}")
            click.echo(f"export KEYQUEUE_URL={server.url}")
            click.echo("Press Ctrl-C to stop.", err=True)
            while not stop.is_set() and server.running:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
            if not stop.is_set():
                raise ConnectionFailed(f"nats-server exited unexpectedly; see its log {server.log_file}")
            click.echo("stopping nats-server ...", err=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


if __name__ == "__main__":
    main()
