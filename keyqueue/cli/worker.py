"""``keyqueue worker MODULE:APP``: serve an app's queues until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio

import click

from keyqueue.cli.common import LOG_FORMATS, configure_logging, load_app, url_option

__all__ = ["worker"]


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--queue", "-q", "queues", multiple=True, metavar="QUEUE",
              help="Serve only this queue (repeatable; default: all of the app's queues).")
@click.option("--concurrency", "-c", type=click.IntRange(1), default=16, show_default=True,
              help="Keys held at once, per queue.")
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
           priority: int | None, connect_timeout: float | None, url: str | None, log_level: str,
           log_format: str) -> None:
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

    \b
    Example:
      $ export KEYQUEUE_URL=nats://127.0.0.1:4222
      $ keyqueue worker shop:app --concurrency 32
      $ keyqueue worker shop:app --overflow-min-pending 50     # an overflow pool
    """
    configure_logging(log_level, log_format.lower())
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

    asyncio.run(run())
