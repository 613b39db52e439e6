"""Commands on a queue as a whole: ``inspect`` what it holds, ``unpin``, ``configure`` its settings,
``recreate-consumer`` and ``delete-queue``.

The work happens in ``keyqueue.admin`` (and, for the consumer and settings, the topology); these
commands format its results. A queue that does not exist is one line naming it and the queues
the server has.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from keyqueue.admin.consumers import unpin as unpin_queue
from keyqueue.admin.diagnosis import diagnose_key
from keyqueue.admin.inspection import KEY_LIMIT, Holder, KeyState, QueueReport, inspect_queue, list_queues
from keyqueue.admin.key_history import key_events, runs_of
from keyqueue.admin.permissions import ROLES, server_block
from keyqueue.admin.permissions import permissions as role_permissions
from keyqueue.admin.queue_removal import QueueContents, delete_queue, queue_contents
from keyqueue.admin.workers import WorkerState, queue_workers
from keyqueue.app.purge import PurgeFilter, count_pending, purge_pending
from keyqueue.cli.common import connection, load_app, table, to_json, url_option
from keyqueue.cli.common import no_such_queue as _no_such_queue
from keyqueue.cli.key_inspection import key_fields, key_text
from keyqueue.errors import ConfigError, ConsumerNotFound, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.topology import QueueConfig, Topology

__all__ = ["configure", "delete_queue_command", "inspect_command", "permissions_command", "purge", "recreate_consumer",
           "unpin"]


async def _report(api: JetStreamApi, queue: str) -> QueueReport:
    try:
        return await inspect_queue(api, queue)
    except StreamNotFound:
        raise await _no_such_queue(api, queue) from None


@click.command("inspect")
@click.argument("queue", required=False)
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object (stable keys, numbers as numbers).")
@click.option("--runs", type=click.IntRange(0), default=10, show_default=True, metavar="N",
              help="With KEY: how many of the key's last runs to list (from its stored events).")
@url_option
def inspect_command(queue: str | None, key: str | None, as_json: bool, runs: int, url: str | None) -> None:
    """Show what a queue holds: keys with backlog, keys held and by whom, workers, DLQ, consumer.

    Without QUEUE, one line per queue on the server. A held key shows its holder and since when,
    from the key's lease record. The Workers section lists every worker of the queue from its
    heartbeat record (written every few seconds): live ones, idle included, and those gone in the
    last ten minutes.

    With KEY, why that key waits: its holder (worker, pid, host, since, fencing, last renewal, when
    the lease ends), its head request (task, arguments, attempts, running since, last error, next
    retry), what blocks it (a live holder running or backing off, a rate limit, a lease left by a
    gone worker, no worker serving the queue, a full fleet), its position among waiting keys, and
    its last runs (holder, fencing, outcome, duration) from the stored events.

    \b
    Examples:
      $ keyqueue inspect                 # every queue
      $ keyqueue inspect shop            # keys of queue shop, most backlog first
      $ keyqueue inspect shop --json
      $ keyqueue inspect shop order-17   # why is key order-17 waiting?
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            if queue is not None and key is not None:
                try:
                    diagnosis = await diagnose_key(api, queue, key)
                    history = runs_of(await key_events(api, queue, key, limit=max(50, runs * 6)))[:runs]
                except StreamNotFound:
                    raise await _no_such_queue(api, queue) from None
                click.echo(to_json(key_fields(diagnosis, history)) if as_json else key_text(diagnosis, history))
                return
            if queue is None:
                reports = [await _report(api, name) for name in await list_queues(api)]
                if as_json:
                    click.echo(to_json({"queues": [_summary(r) for r in reports]}))
                elif not reports:
                    click.echo("no queues on this server")
                else:
                    rows = [[r.queue, r.requests, r.keys_with_backlog, r.keys_held, r.pending_tokens, r.unkeyed,
                             r.dlq_size] for r in reports]
                    click.echo(table(["QUEUE", "REQUESTS", "KEYS", "HELD", "PENDING TOKENS", "UNKEYED", "DLQ"], rows))
                return
            report = await _report(api, queue)
            registry = await queue_workers(api, queue)
        if as_json:
            click.echo(to_json({**_report_fields(report), "registry": [_worker_fields(w) for w in registry]}))
        else:
            click.echo(_readable_report(report) + "\n\n" + _readable_workers(registry))

    asyncio.run(run())


def _summary(r: QueueReport) -> dict[str, Any]:
    return {"queue": r.queue, "requests": r.requests, "keys_with_backlog": r.keys_with_backlog,
            "keys_held": r.keys_held, "pending_tokens": r.pending_tokens, "unkeyed": r.unkeyed,
            "unkeyed_running": r.unkeyed_running, "dlq": r.dlq_size}


def _report_fields(r: QueueReport) -> dict[str, Any]:
    def holder(h: Holder | None) -> dict[str, Any] | None:
        if h is None:
            return None
        return {"worker": h.worker, "since": _iso(h.since), "renewed": _iso(h.renewed), "fence": h.fence}

    return {
        **_summary(r),
        "consumer": {**r.consumer, "pinned": r.consumer.get("pinned") or None},
        "workers": [{"worker": name, "keys_held": held} for name, held in r.workers.items()],
        "keys": [{"key": k.key, "backlog": k.backlog, "token": k.token, "holder": holder(k.holder)} for k in r.keys],
        "keys_truncated": r.truncated,
    }


def _readable_report(r: QueueReport) -> str:
    c = r.consumer
    lines = [
        f"queue {r.queue}: {r.requests} request(s) on {r.keys_with_backlog} key(s); "
        f"{r.keys_held} key(s) held; {r.pending_tokens} pending token(s); DLQ {r.dlq_size}"
        + (f"; {r.unkeyed} unkeyed request(s), {r.unkeyed_running} running" if r.unkeyed else ""),
        f"consumer: ack_pending={c['ack_pending']} redelivered={c['redelivered']} "
        f"waiting_pulls={c['waiting_pulls']} ack_wait={c['ack_wait_s']:g}s "
        f"max_ack_pending={c['max_ack_pending']} priority={c['priority_policy']}",
    ]
    if c.get("pinned"):
        lines.append(f"pinned: {c['pinned']}")
    holding = ", ".join(f"{name} ({held} key{'' if held == 1 else 's'})" for name, held in r.workers.items())
    lines.append(f"workers holding keys: {holding or 'none'}; {c['waiting_pulls']} pull request(s) waiting "
                 "for tokens (from idle workers)")
    if r.keys:
        now = datetime.now(UTC)
        rows = [[k.key, k.backlog, k.token, *_holder_cells(k, now)] for k in r.keys]
        lines += ["", table(["KEY", "BACKLOG", "TOKEN", "HOLDER", "SINCE"], rows)]
        if any(k.holder is not None and k.holder.since is None for k in r.keys):
            lines.append("(renewed: the lease record does not say when the key was acquired, only when it "
                         "was last renewed)")
        if r.truncated:
            lines.append(f"(first {KEY_LIMIT} keys)")
    return "\n".join(lines)


def _worker_fields(w: WorkerState) -> dict[str, Any]:
    r = w.record
    return {"name": r.name, "host": r.host, "pid": r.pid, "version": r.version, "queues": r.queues,
            "slots": r.slots, "used": r.used, "started": _iso(_moment(r.started)),
            "heartbeat": _iso(_moment(w.received)), "live": w.live, "gone": w.gone_because}


def _readable_workers(registry: list[WorkerState]) -> str:
    if not registry:
        return "Workers: none (no worker of this queue wrote a heartbeat in the last 10 minutes)"
    now = datetime.now(UTC)
    rows = [[w.name, w.record.host, w.record.pid, f"{w.record.used}/{w.record.slots}",
             f"{_age(now - _moment(w.record.started))} ago", f"{_age(now - _moment(w.received))} ago",
             "live" if w.live else f"gone ({w.gone_because})"] for w in registry]
    return "Workers:\n" + table(["WORKER", "HOST", "PID", "SLOTS USED", "STARTED", "HEARTBEAT", "STATE"], rows)


def _moment(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _holder_cells(k: KeyState, now: datetime) -> list[str]:
    if k.token != "held":
        return ["-", "-"]
    h = k.holder
    if h is None:
        return ["(no lease record)", "-"]
    if h.since is not None:
        since = f"{_iso(h.since)} ({_age(now - h.since)} ago)"
    elif h.renewed is not None:
        since = f"renewed {_iso(h.renewed)} ({_age(now - h.renewed)} ago)"
    else:
        since = "-"
    return [h.worker or "?", since]


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _age(elapsed: timedelta) -> str:
    seconds = max(0, int(elapsed.total_seconds()))
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    if days:
        return f"{days}d{h}h"
    if hours:
        return f"{hours}h{m:02d}m"
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


@click.command()
@click.argument("queue")
@url_option
def unpin(queue: str, url: str | None) -> None:
    """Move the pin of a pinned_client queue: the server drops it and pins a worker afresh.

    \b
    Example:
      $ keyqueue unpin shop
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                groups = await unpin_queue(api, queue)
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None
            click.echo(f"unpinned queue {queue} (group {', '.join(groups)}); the next delivery pins a worker afresh")

    asyncio.run(run())


@click.command()
@click.argument("queue")
@click.option("--ack-wait", type=click.FloatRange(1), default=None, metavar="SECONDS",
              help="The queue's lease: seconds a key stays held without a keepalive.")
@click.option("--max-ack-pending", type=click.IntRange(1), default=None, metavar="N",
              help="How many keys the whole fleet may hold at once.")
@click.option("--max-backlog-per-key", type=click.IntRange(0), default=None, metavar="N",
              help="Pending requests a key may have (0: unlimited); one more is refused with BacklogFull.")
@click.option("--duplicate-window", type=click.FloatRange(1), default=None, metavar="SECONDS",
              help="How long a repeated request id (options(request_id=...)) stores nothing new (default 120).")
@url_option
def configure(queue: str, ack_wait: float | None, max_ack_pending: int | None, max_backlog_per_key: int | None,
              duplicate_window: float | None, url: str | None) -> None:
    """Change a queue's settings on the server in place, while its workers run; without options, show them.

    The settings belong to the queue: workers started without --ack-wait hold keys for the lease
    the server has, and producers never check them. A worker already running keeps its lease
    until it restarts, which is safe: it holds each key through a lease record that the server
    keeps for that worker's own lease (docs/decisions.md, "Who owns each setting").

    \b
    Examples:
      $ keyqueue configure shop --ack-wait 60
      $ keyqueue configure shop --duplicate-window 3600   # a repeated request id is a no-op for an hour
      $ keyqueue configure shop                 # show them
    """

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            topology = Topology(api, QueueConfig(queue))
            try:
                changes = await topology.configure(ack_wait=ack_wait, max_ack_pending=max_ack_pending,
                                                   max_backlog_per_key=max_backlog_per_key,
                                                   duplicate_window=duplicate_window)
                current = await topology.server_config()
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None
            except ConsumerNotFound:
                raise ConfigError(f"queue {queue!r} has no token consumer; start a worker, or run "
                                  f"`keyqueue recreate-consumer {queue}`") from None
        for change in changes:
            click.echo(f"queue {queue}: {change}")
        if not changes:
            click.echo(f"queue {queue}: ack_wait {current.ack_wait:g}s, max_ack_pending {current.max_ack_pending}, "
                       f"max_backlog_per_key {current.max_backlog_per_key or 'unlimited'}, "
                       f"duplicate_window {current.duplicate_window:g}s, "
                       f"priority policy {current.priority_policy}")

    asyncio.run(run())


@click.command("recreate-consumer")
@click.argument("queue")
@click.option("--app", "app_spec", metavar="MODULE:APP", default=None,
              help="Take the queue's priority policy from this app (default: keep the server's).")
@click.option("--ack-wait", type=click.FloatRange(1), default=None, metavar="SECONDS",
              help="Set the queue's lease (default: keep the server's).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Recreate it even while the worker registry lists live workers.")
@url_option
def recreate_consumer(queue: str, app_spec: str | None, ack_wait: float | None, yes: bool, force: bool,
                      url: str | None) -> None:
    """Delete and recreate a queue's token consumer, to change its priority policy or repair it.

    Stop every worker of the queue first: the new consumer delivers every remaining token again.
    It refuses while the worker registry lists live workers of the queue (a heartbeat within the
    last few intervals), unless --force. Requests are kept, and so are the queue's settings (its
    lease and max_ack_pending; change them in place with `keyqueue configure`).

    \b
    Example:
      $ keyqueue recreate-consumer shop --app shop:app --yes
    """
    app_config = load_app(app_spec, url).queue_config(queue) if app_spec else None
    if not yes:
        policy = f" (priority policy {app_config.priority_policy})" if app_config else ""
        click.confirm(f"Recreate the token consumer of queue {queue!r}{policy}? Every worker of the queue must be "
                      "stopped", abort=True)

    async def run() -> None:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            live = [w.name for w in await queue_workers(api, queue) if w.live]
            if live and not force:
                raise ConfigError(f"queue {queue!r} has {len(live)} live worker(s) ({', '.join(live[:5])}): stop them "
                                  "first (the new consumer delivers every token again, to anyone), or pass --force")
            try:
                config = app_config or await _server_config(api, queue)
                lease = await Topology(api, config).recreate_consumer(ack_wait=ack_wait)
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None
        click.echo(f"recreated consumer {config.names.consumer} of queue {queue} "
                   f"(priority policy {config.priority_policy}, ack_wait {lease.after:g}s)")

    asyncio.run(run())


async def _server_config(api: JetStreamApi, queue: str) -> QueueConfig:
    """The queue's config as the server has it (the defaults for a queue without a consumer)."""
    try:
        return await Topology(api, QueueConfig(queue)).server_config()
    except ConsumerNotFound:
        return QueueConfig(queue)


@click.command("delete-queue")
@click.argument("queue")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Delete it even while the worker registry lists live workers.")
@url_option
def delete_queue_command(queue: str, yes: bool, force: bool, url: str | None) -> None:
    """Delete a queue and everything it holds: pending requests, dead letters, kept results and
    progress, cancels, schedules, events, the dashboard's history of it. It cannot be undone.

    For a queue nobody uses any more (a test's, a renamed one's), which otherwise stays on the
    server, listed by `keyqueue inspect` and the dashboard, and failing /health while it holds
    requests no worker serves. It refuses while the worker registry lists live workers of the queue
    (a heartbeat within the last few intervals), unless --force; stop its workers and producers
    first (a producer that enqueues again creates the queue again, empty).

    \b
    Example:
      $ keyqueue delete-queue smoke-test          # says what it holds, asks first
      $ keyqueue delete-queue smoke-test --yes
      deleted queue smoke-test: 7 stream(s), 12 request(s), 3 dead letter(s)
    """

    async def contents() -> QueueContents:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            found = await queue_contents(api, queue)
            if not found.streams:
                raise await _no_such_queue(api, queue)
            live = [w.name for w in await queue_workers(api, queue) if w.live]
            if live and not force:
                raise ConfigError(f"queue {queue!r} has {len(live)} live worker(s) ({', '.join(live[:5])}): stop them "
                                  "first, or pass --force")
            return found

    async def deleted(found: QueueContents) -> list[str]:
        async with connection(url) as nc:
            return await delete_queue(JetStreamApi(nc), found)

    found = asyncio.run(contents())
    held = f"{found.requests} request(s), {found.dead_letters} dead letter(s)"
    if not yes:
        click.echo(f"queue {queue}: {held}; streams {', '.join(found.streams)}")
        click.confirm(f"Delete queue {queue!r} and everything it holds? This cannot be undone", abort=True)
    gone = asyncio.run(deleted(found))
    click.echo(f"deleted queue {queue}: {len(gone)} stream(s), {held}")


@click.command()
@click.argument("queue")
@click.option("--key", metavar="KEY", default=None, help="Only this key's pending requests ('~': only the unkeyed "
              "ones).")
@click.option("--task", metavar="TASK", default=None, help="Only this task's pending requests (the others keep "
              "their order).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@url_option
def purge(queue: str, key: str | None, task: str | None, yes: bool, url: str | None) -> None:
    """Remove pending requests of a queue (all, one key's, one task's): they never run.

    A request a worker has already started (or read ahead) may still run; delayed requests not
    yet due are not pending yet (cancel them by id). The dead-letter queue has its own purge
    (keyqueue dlq purge).

    \b
    Examples:
      $ keyqueue purge shop --key o17            # asks first
      $ keyqueue purge shop --key '~'            # the requests of unkeyed tasks
      $ keyqueue purge shop --task refund --yes
      removed 12 pending request(s) from queue shop (task refund)
    """
    which = PurgeFilter(queue, key, task)

    async def counted() -> int:
        async with connection(url) as nc:
            api = JetStreamApi(nc)
            try:
                return await count_pending(api, which)
            except StreamNotFound:
                raise await _no_such_queue(api, queue) from None

    async def removed() -> int:
        async with connection(url) as nc:
            return await purge_pending(JetStreamApi(nc), which)

    found = asyncio.run(counted())
    if not found:
        click.echo(f"no pending requests in queue {queue}{which.describe()}")
        return
    if not yes:
        click.confirm(f"Remove {found} pending request(s) from queue {queue}{which.describe()}? They will never run",
                      abort=True)
    click.echo(f"removed {asyncio.run(removed())} pending request(s) from queue {queue}{which.describe()}")


@click.command("permissions")
@click.argument("role", type=click.Choice(ROLES))
@click.argument("queues", nargs=-1, metavar="QUEUE...")
@click.option("--json", "as_json", is_flag=True, help="Print {publish: [...], subscribe: [...]} as JSON.")
def permissions_command(role: str, queues: tuple[str, ...], as_json: bool) -> None:
    """Print the NATS permissions a role needs, as a nats-server `permissions` block for its user.

    \b
    producer   enqueue (and call) only: cannot read requests, results or the DLQ, nor purge
    worker     run the queues' requests
    dashboard  read-only: streams, consumers, stored messages, events and progress of every queue
    operator   the command line's writes (purge, configure, dlq replay, release)

    \b
    Example:
      $ keyqueue permissions producer shop
      permissions: {
        publish: { allow: ["$JS.API.INFO", "kq.shop.in.>", ...] }
        subscribe: { allow: ["_INBOX.>"] }
      }
    """
    if role in ("producer", "worker") and not queues:
        raise ConfigError(f"the {role} role's permissions are per queue: name at least one QUEUE")
    if as_json:
        click.echo(to_json(role_permissions(role, list(queues))))  # type: ignore[arg-type]
    else:
        click.echo(server_block(role, list(queues)))  # type: ignore[arg-type]
