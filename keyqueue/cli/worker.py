"""``keyqueue worker MODULE:APP``: serve an app's queues until SIGINT or SIGTERM.

With ``--processes N`` (N > 1) the command is a parent that supervises N such workers
(``keyqueue.cli.supervisor``) on one server: the app's URL, resolved here once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import click

from keyqueue.admin.release import release_keys
from keyqueue.app.application import App
from keyqueue.app.event_loop import LOOPS, resolve_loop
from keyqueue.app.event_loop import run as run_on
from keyqueue.cli.common import LOG_FORMATS, configure_logging, load_app, url_option
from keyqueue.cli.supervisor import EXIT_RECYCLED, Supervisor, WorkerCommand
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.plugins.manager import hookimpl

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ["ProcessCount", "worker"]


class ProcessCount(click.ParamType[int, Any]):
    """``--processes``: a number of processes (at least 1), or ``auto`` for one per CPU."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            count = value
        elif str(value).strip().lower() == "auto":
            count = os.cpu_count() or 1
        else:
            try:
                count = int(value)
            except ValueError:
                self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)
        if count < 1:
            self.fail(f"{count} is not at least 1", param, ctx)
        return count


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--queue", "-q", "queues", multiple=True, metavar="QUEUE",
              help="Serve only this queue (repeatable; default: all of the app's queues).")
@click.option("--concurrency", "-c", type=click.IntRange(1), default=16, show_default=True,
              help="Keys worked on at once, per queue (a key waiting out a retry's backoff, or being given "
                   "back, holds no slot).")
@click.option("--linger", type=click.FloatRange(0), default=0.05, show_default=True,
              help="Seconds a key stays held with no new request.")
@click.option("--ack-wait", type=click.FloatRange(1), default=None, metavar="SECONDS",
              help="Set the queue's lease on the server to SECONDS, in place (default: hold keys for the "
                   "lease the server has; `keyqueue configure` changes it without a worker).")
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
@click.option("--watchdog/--no-watchdog", default=True, show_default=True,
              help="End the process before a run it cannot stop outlives a key's lease, so that no other worker "
                   "runs the key beside it: an event loop blocked by a handler (sync code in an async def) or a "
                   "sync task's thread still running after its lease was lost ends it with status 75 (the "
                   "attempt counts toward max_attempts); C code holding the GIL or a stopped process is killed "
                   "(SIGKILL) by a kernel timer at the lease's end. Turn it off only to debug.")
@click.option("--pool", "sync_pool", type=click.Choice(["threads", "processes"]), default="threads",
              show_default=True,
              help="Where sync task functions run: threads, or child processes, which a task's hard timeout and "
                   "the drain deadline can stop (like Celery's prefork; serial tasks only).")
@click.option("--processes", "-p", type=ProcessCount(), default="1", show_default=True,
              help="Worker processes to run, each with these options, under a parent that restarts them "
                   "(auto: one per CPU).")
@click.option("--max-requests-per-child", type=click.IntRange(1), default=None, metavar="N",
              help="Each worker process drains and is replaced by a fresh one after N requests (succeeded or "
                   "dead-lettered): a bound on what a leaking task can hold. Runs the workers under a parent, "
                   "as --processes does (with --processes 1: one child).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics on http://127.0.0.1:PORT/metrics (with --processes N, worker k "
                   "of N listens on PORT+k-1). See docs/dashboard.md.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, metavar="HOST",
              help="The address --metrics-port listens on (0.0.0.0 for every interface).")
@click.option("--loop", "loop_name", type=click.Choice(LOOPS, case_sensitive=False), default="auto",
              show_default=True, envvar="KEYQUEUE_LOOP", show_envvar=True,
              help="The event loop: uvloop (faster; installed with keyqueue where it builds), asyncio's own, or auto "
                   "(uvloop where it is installed).")
@url_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              default="info", show_default=True, envvar="KEYQUEUE_LOG_LEVEL", show_envvar=True,
              help="Least severe log lines shown; debug adds keys acquired and released, every request, "
                   "and the traceback of each failed attempt.")
@click.option("--log-format", type=click.Choice(LOG_FORMATS, case_sensitive=False), default="text",
              show_default=True, envvar="KEYQUEUE_LOG_FORMAT", show_envvar=True,
              help="json: one JSON object per line (time, level, logger, message, and fields such as "
                   "queue, key, request_id, attempt).")
def worker(app_spec: str, queues: tuple[str, ...], concurrency: int, linger: float, ack_wait: float | None,
           drain_timeout: float, name: str | None, overflow_min_pending: int, overflow_min_ack_pending: int,
           priority: int | None, connect_timeout: float | None, watchdog: bool, sync_pool: str, processes: int,
           max_requests_per_child: int | None, metrics_port: int | None,
           metrics_host: str, loop_name: str, url: str | None, log_level: str, log_format: str) -> None:
    """Serve the tasks and processors of an app until SIGINT or SIGTERM.

    MODULE:APP names the App, e.g. shop:app for `app` in shop.py (the current directory is
    importable). The first signal drains: requests in hand finish (up to --drain-timeout) and
    the worker's keys move to other workers at once; a second signal stops immediately.

    With no URL configured, the worker runs the app's embedded nats-server (and says so in its
    log); producers of the same app on this machine find it. A configured server that is not up
    yet is waited for (each attempt logged) for --connect-timeout seconds, by default forever.

    The log goes to stderr, one line per event worth a look: a failed attempt that is retried
    (a warning, no traceback), a request dead-lettered (an error with its traceback; a rejected
    one is a warning), lost leases and connections, and at the stop each queue's totals.
    --log-level debug adds every key and request; --log-format json writes one JSON object
    per line.

    --processes N runs N workers, each its own process named NAME/1 .. NAME/N (NAME: --name,
    default host:pid of the parent), under a parent that serves no queue: it relays their log
    with each line naming its worker, and forwards SIGINT/SIGTERM (the first drains them all,
    a second stops them now). A worker that dies is restarted after a backoff while the others
    go on (its keys pass to them within the queue's ack_wait); one that keeps dying at start
    (a configuration error) stops them all, with exit status 1. With no URL configured, the
    parent starts or finds the app's embedded nats-server and the workers share it.

    \b
    Example:
      $ export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ keyqueue worker shop:app --concurrency 32
      $ keyqueue worker shop:app --processes auto          # one worker process per CPU
      $ keyqueue worker shop:app --overflow-min-pending 50 # an overflow pool
    """
    configure_logging(log_level, log_format.lower())
    loop_name = resolve_loop(loop_name.lower())  # a missing uvloop is an error before anything starts
    app = load_app(app_spec, url)
    supervised = os.environ.get(_CHILD_ENV) == "1"
    if processes > 1 or (max_requests_per_child is not None and not supervised):
        json_lines = log_format.lower() == "json"
        asyncio.run(_supervise(app, click.get_current_context(), processes, name, json_lines=json_lines))
        return
    serving = app.worker(queues=list(queues) or None, concurrency=concurrency, linger=linger, ack_wait=ack_wait,
                         drain_timeout=drain_timeout, name=name, overflow_min_pending=overflow_min_pending,
                         overflow_min_ack_pending=overflow_min_ack_pending, priority=priority,
                         connect_timeout=connect_timeout, watchdog=watchdog, sync_pool=sync_pool,
                         app_spec=app_spec)

    recycle = _Recycle(serving, max_requests_per_child) if max_requests_per_child is not None else None
    if recycle is not None:
        app.plugins.register(recycle, name="keyqueue.cli.worker.recycle")

    async def run() -> None:
        try:
            await serving.serve()
        finally:
            await app.close()

    logging.getLogger("keyqueue.worker").debug("event loop: %s", loop_name)
    with _metrics(app, metrics_port, metrics_host):
        run_on(run(), loop_name)
    if recycle is not None and recycle.drained:
        sys.exit(EXIT_RECYCLED)


class _Recycle:
    """``--max-requests-per-child``: drains the worker once it has finished ``limit`` requests."""

    def __init__(self, worker: Any, limit: int) -> None:
        self.worker, self.limit = worker, limit
        self.done = 0
        self.drained = False

    def _count(self) -> None:
        self.done += 1
        if self.done >= self.limit and not self.drained:
            self.drained = True
            logging.getLogger("keyqueue.worker").info(
                "served %d request(s) (--max-requests-per-child): draining; the parent starts a fresh process",
                self.done)
            self.worker.request_stop()

    @hookimpl
    def keyqueue_request_succeeded(self) -> None:
        self._count()

    @hookimpl
    def keyqueue_request_dead_lettered(self) -> None:
        self._count()


@contextlib.contextmanager
def _metrics(app: App, port: int | None, host: str) -> Iterator[None]:
    """With a port, count the worker's lifecycle hooks and serve them on ``/metrics`` meanwhile."""
    if port is None:
        yield
        return
    from keyqueue.metrics.prometheus import PrometheusPlugin, serve_metrics

    plugin = PrometheusPlugin()
    app.plugins.register(plugin, name="keyqueue.metrics.prometheus")
    with serve_metrics(plugin.registry, port, host) as bound:
        logging.getLogger("keyqueue.worker").info("metrics on http://%s:%d/metrics", host, bound)
        yield


_CHILD_ENV: Final = "KEYQUEUE_SUPERVISED"
"""Set in a worker process's environment by its parent: it serves, and exits when it should be replaced."""

_URL_ENV: Final = "KEYQUEUE_URL"
"""How the parent gives its worker processes the server's URL (in their environment, not in ``ps``)."""

_NOT_PASSED_ON = frozenset({"app_spec", "processes", "name", "url", "metrics_port"})
"""Parameters the parent gives its worker processes itself, rather than as it received them."""


def _worker_options(ctx: click.Context) -> list[str]:
    """The options of this command line as a child ``keyqueue worker`` takes them, but for the
    parent's own (--processes; --name and --url, which the parent sets per child)."""
    args: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if not isinstance(param, click.Option) or param.name in _NOT_PASSED_ON or value is None:
            continue
        if param.is_flag:  # --watchdog/--no-watchdog: the form that says the value
            if value:
                args.append(param.opts[0])
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
            continue
        flag = max(param.opts, key=len)
        for item in value if param.multiple else (value,):
            args += [flag, str(item)]
    return args


async def _supervise(app: App, ctx: click.Context, processes: int, name: str | None, *, json_lines: bool) -> None:
    """Run ``processes`` worker processes on the app's server until a signal."""

    async def command() -> WorkerCommand:
        # Resolved once, here: with no URL configured this starts (or finds) the app's embedded
        # server, which this parent then owns and keeps up until its children have stopped.
        url = await app.url()
        port = ctx.params.get("metrics_port")
        return WorkerCommand([sys.executable, "-m", "keyqueue", "worker", ctx.params["app_spec"],
                              *_worker_options(ctx)], {**os.environ, _URL_ENV: url, _CHILD_ENV: "1"},
                             # Worker k of N serves its metrics on port + k - 1 (the parent serves none).
                             child_args=None if port is None else lambda k: ["--metrics-port", str(port + k - 1)])

    served = list(ctx.params.get("queues") or ()) or app.queues
    releaser = _Releaser(app, served)
    supervisor = Supervisor(processes, name or f"{socket.gethostname()}:{os.getpid()}", json_lines=json_lines,
                            on_death=releaser.release)
    try:
        await supervisor.run(command())
    finally:
        await releaser.close()
        await app.close()


class _Releaser:
    """Releases the keys of a worker process that died (the parent saw it), on one connection made
    on first use: its lease records of that process only, so its restarted successor (same name,
    another pid) keeps what it has taken meanwhile."""

    def __init__(self, app: App, queues: list[str]) -> None:
        self.app = app
        self.queues = queues
        self._nc: Client | None = None

    async def release(self, worker: str, pid: int) -> None:
        if self._nc is None or self._nc.is_closed:
            self._nc = await connect(await self.app.url(), name="keyqueue-supervisor")
        api = JetStreamApi(self._nc)
        for queue in self.queues:
            released = await release_keys(api, queue, worker=worker, pid=pid, force=True)
            if released:
                logging.getLogger("keyqueue.supervisor").warning(
                    "released %d key(s) of queue %s that %s (pid %d) held: %s", len(released), queue, worker, pid,
                    ", ".join(r.key for r in released[:10]) + (" ..." if len(released) > 10 else ""))

    async def close(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
