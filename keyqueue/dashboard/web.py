"""The dashboard's Starlette app: pages, live updates, ``/metrics`` and the DLQ actions.

Every page is server-rendered HTML that works without JavaScript (its tables, search, filters
and sorting are plain links and GET forms, so each view has a shareable URL). With JavaScript,
``static/live.js`` listens to ``/live`` (server-sent events: one ``refresh`` per snapshot) and
replaces the page's live region with ``?fragment=1`` of the same URL, so counters move without a
reload.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from jinja2 import Environment, FileSystemLoader, select_autoescape
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from keyqueue.admin.dead_letters import (
    dead_letters,
    delete_dead_letters,
    purge_dead_letters,
    replay,
)
from keyqueue.admin.inspection import KeyState, parse_time
from keyqueue.admin.workers import WorkerState
from keyqueue.dashboard.charts import duration, latency_chart, sparkline
from keyqueue.dashboard.latency import RECENT, WINDOW
from keyqueue.dashboard.schedules import queue_schedules
from keyqueue.dashboard.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    TOKEN_COOKIE,
    Access,
    csrf_matches,
    new_csrf_token,
)
from keyqueue.dashboard.state import HeadAttempt, Monitor, QueueView
from keyqueue.errors import KeyqueueError, MessageNotFound, StreamNotFound
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.metrics.prometheus import INSTRUMENTS, prometheus_name
from keyqueue.wire import headers as H

__all__ = ["DashboardOptions", "create_app", "role_text", "sparkline"]

log = logging.getLogger("keyqueue.dashboard")
audit = logging.getLogger("keyqueue.dashboard.audit")

HERE: Final = Path(__file__).parent
PENDING_LIMIT: Final = 100
"""Pending requests a key's page lists."""
DLQ_LIMIT: Final = 200
"""Dead requests the DLQ page lists."""

_EVENT_INSTRUMENTS: Final = {
    "enqueued": "keyqueue.requests.enqueued", "succeeded": "keyqueue.requests.succeeded",
    "retried": "keyqueue.requests.retried", "dead_lettered": "keyqueue.requests.dead_lettered",
    "superseded": "keyqueue.requests.superseded",
}
"""Lifecycle event -> the counter it feeds on the dashboard's ``/metrics``."""


@dataclass(frozen=True)
class DashboardOptions:
    """How the dashboard runs: its credentials, whether actions are allowed, when a key is stuck."""

    access: Access = field(default_factory=Access)
    read_only: bool = False
    """Hide and refuse every action."""
    stuck_after: float = 60.0
    """Seconds without activity after which a held key is listed as stuck."""


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    seconds = max(0, int(now - ts))
    if seconds < 60:
        return f"{seconds}s ago"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s ago"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m ago"


def _until(ts: float, now: float) -> str:
    seconds = max(0, int(ts - now))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _clock(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class _Guard(BaseHTTPMiddleware):
    """Authentication (beyond loopback), the CSRF cookie, and the token-in-URL redirect."""

    def __init__(self, app: Any, options: DashboardOptions) -> None:
        super().__init__(app)
        self.options = options

    async def dispatch(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        access = self.options.access
        request.state.who = f"local {request.client.host if request.client else '?'}"
        if access.required:
            given = request.query_params.get("token")
            if given is not None and access.token is not None and access.who(f"Bearer {given}", None):
                query = urllib.parse.urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
                response: Response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), 303)
                response.set_cookie(TOKEN_COOKIE, given, httponly=True, samesite="strict",
                                    secure=request.url.scheme == "https")
                return response
            who = access.who(request.headers.get("authorization"), request.cookies.get(TOKEN_COOKIE))
            if who is None:
                challenge = {"WWW-Authenticate": 'Basic realm="keyqueue"'} if access.user else {}
                return PlainTextResponse("authentication required", 401, headers=challenge)
            request.state.who = who
        csrf = request.cookies.get(CSRF_COOKIE) or new_csrf_token()
        request.state.csrf = csrf
        response = await call_next(request)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response


def create_app(monitor: Monitor, options: DashboardOptions | None = None) -> Starlette:
    """The dashboard on ``monitor``'s snapshot (the caller runs ``monitor.run()``)."""
    options = options or DashboardOptions()
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.globals.update(ago=_ago, until=_until, clock=_clock, sparkline=sparkline, duration=duration,
                       latency_chart=latency_chart)
    registry = _registry(monitor)

    def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        snapshot = monitor.snapshot
        fragment = request.query_params.get("fragment") == "1"
        html = env.get_template(template).render(
            request=request, snapshot=snapshot, now=time.time(), read_only=options.read_only,
            csrf_field=CSRF_FIELD, csrf=getattr(request.state, "csrf", ""), fragment=fragment,
            queues=sorted(snapshot.queues), **context)
        return HTMLResponse(html, status)

    def view(queue: str) -> QueueView:
        found = monitor.snapshot.queues.get(queue)
        if found is None:
            raise _NotFound(f"no queue {queue!r} (queues: {', '.join(sorted(monitor.snapshot.queues)) or 'none'})")
        return found

    async def overview(request: Request) -> Response:
        timings = {queue: _Timings.of(monitor, queue) for queue in monitor.snapshot.queues}
        return render(request, "overview.html", timings=timings, recent=int(RECENT), window=int(WINDOW // 60))

    async def keys(request: Request) -> Response:
        queue = request.path_params["queue"]
        found = view(queue)
        search = request.query_params.get("q", "").strip()
        state = request.query_params.get("state", "all")
        sort = request.query_params.get("sort", "backlog")
        registry_by_name = {w.name: w for w in found.workers}
        now = time.time()
        rows = []
        for k in found.report.keys:
            if search and search.lower() not in k.key.lower():
                continue
            activity = monitor.last_activity(queue, k)
            stuck = k.token == "held" and activity is not None and now - activity > options.stuck_after
            kind = "stuck" if stuck else {"held": "held", "scheduled": "waiting"}.get(k.token, "backlog")
            head = monitor.head_attempt(queue, k.key)
            failing = head is not None and head.failing
            if state == "failing":
                if not failing:
                    continue
            elif state != "all" and not (state == kind or (state == "held" and kind == "stuck")):
                continue
            holder = registry_by_name.get(k.holder.worker) if k.holder and k.holder.worker else None
            rows.append(_KeyRow(k, kind, holder, activity, head))
        rows.sort(key=_KEY_SORTS.get(sort, _KEY_SORTS["backlog"]))
        return render(request, "keys.html", queue=queue, view=found, rows=rows, search=search, state=state,
                      sort=sort, stuck_after=options.stuck_after)

    async def key_page(request: Request) -> Response:
        queue, key = request.path_params["queue"], request.path_params["key"]
        found = view(queue)
        state = next((k for k in found.report.keys if k.key == key), None)
        pending = await _pending(monitor, queue, key)
        letters = await dead_letters(monitor.api, queue, key=key, limit=DLQ_LIMIT) if found.report.dlq_size else []
        holder = None
        if state is not None and state.holder is not None and state.holder.worker:
            holder = next((w for w in found.workers if w.name == state.holder.worker), None)
        return render(request, "key.html", queue=queue, key=key, state=state, pending=pending,
                      events=monitor.key_events(queue, key), letters=letters, holder=holder,
                      head=monitor.head_attempt(queue, key), progress=await monitor.progress.watch(queue, key),
                      delayed=await monitor.delays.of_key(queue, key))

    async def workers(request: Request) -> Response:
        merged: dict[str, dict[str, Any]] = {}
        for queue, found in sorted(monitor.snapshot.queues.items()):
            for w in found.workers:
                entry = merged.setdefault(w.name, {"state": w, "queues": [], "used": 0, "slots": 0, "roles": []})
                entry["queues"].append(queue)
                entry["roles"].append((queue, role_text(w.record.role)))
                entry["used"] += w.record.used
                entry["slots"] += w.record.slots
                if w.received > entry["state"].received:
                    entry["state"] = w
        rows = sorted(merged.values(), key=lambda e: e["state"].name)
        return render(request, "workers.html", live=[e for e in rows if e["state"].live],
                      gone=[e for e in rows if not e["state"].live])

    async def dlq_page(request: Request) -> Response:
        queue = request.path_params["queue"]
        view(queue)
        key = request.query_params.get("key") or None
        letters = await dead_letters(monitor.api, queue, key=key, limit=DLQ_LIMIT)
        by_key: dict[str, int] = {}
        for letter in letters:
            by_key[letter.key] = by_key.get(letter.key, 0) + 1
        return render(request, "dlq.html", queue=queue, key=key, letters=letters, by_key=by_key,
                      message=request.query_params.get("done"))

    async def dlq_action(request: Request) -> Response:
        queue, action = request.path_params["queue"], request.path_params["action"]
        if options.read_only:
            return PlainTextResponse("this dashboard is read-only", 405)
        form = await request.form()
        if not csrf_matches(request.cookies.get(CSRF_COOKIE), _text(form.get(CSRF_FIELD))):
            audit.warning("refused %s on queue %s from %s: CSRF token missing or wrong", action, queue,
                          request.state.who)
            return PlainTextResponse("CSRF token missing or wrong; reload the page and try again", 403)
        view(queue)
        key = _text(form.get("key")) or None
        seq_text = _text(form.get("seq"))
        seq = int(seq_text) if seq_text.isdigit() else None
        publisher = Publisher(monitor.nc, QueueNames(queue), timeout=5.0)
        if action == "purge" and _text(form.get("confirm")) != queue:
            return render(request, "confirm.html", queue=queue, key=key)
        try:
            if action == "replay":
                count = await replay(monitor.api, publisher, queue, key=key,
                                     seqs=[seq] if seq is not None else None)
                done = f"replayed {count} request(s)"
            elif action == "delete" and seq is not None:
                await delete_dead_letters(monitor.api, queue, [seq])
                done = f"deleted dead request {seq}"
            elif action == "purge":
                count = await purge_dead_letters(monitor.api, queue, key=key)
                done = f"purged {count} dead request(s)"
            else:
                return PlainTextResponse(f"unknown action {action!r}", 400)
        except MessageNotFound as exc:
            return PlainTextResponse(exc.description, 404)
        what = f"queue {queue}" + (f" key {key}" if key else "") + (f" seq {seq}" if seq is not None else "")
        audit.info("%s: %s (%s)", request.state.who, done, what)
        await monitor.poll()
        back = f"/queues/{queue}/dlq?" + urllib.parse.urlencode({"done": done, **({"key": key} if key else {})})
        return RedirectResponse(back, 303)

    async def schedules(request: Request) -> Response:
        found = [await queue_schedules(monitor.nc, monitor.delays, queue) for queue in sorted(monitor.snapshot.queues)]
        return render(request, "schedules.html", schedules=found)

    async def live(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            version = monitor.snapshot.version
            yield b"retry: 2000\n\n"
            while not await request.is_disconnected():
                new = await monitor.changed(version, timeout=15.0)
                if new == version:
                    yield b": keep-alive\n\n"
                    continue
                version = new
                yield f"event: refresh\ndata: {version}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: Exception) -> Response:
        return render(request, "error.html", status=404, message=str(exc))

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, StreamNotFound):
            return render(request, "error.html", status=404, message=str(exc))
        if isinstance(exc, KeyqueueError):
            return render(request, "error.html", status=502, message=f"{type(exc).__name__}: {exc}")
        raise exc

    routes = [
        Route("/", overview),
        Route("/queues/{queue}/keys", keys),
        Route("/queues/{queue}/keys/{key:path}", key_page),
        Route("/queues/{queue}/dlq", dlq_page),
        Route("/queues/{queue}/dlq/{action}", dlq_action, methods=["POST"]),
        Route("/workers", workers),
        Route("/schedules", schedules),
        Route("/live", live),
        Route("/metrics", metrics),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(_Guard, options=options)],
                     exception_handlers={_NotFound: not_found, KeyqueueError: server_error})


class _NotFound(Exception):
    pass


@dataclass(frozen=True)
class _KeyRow:
    """One row of a queue's keys page."""

    key: KeyState
    kind: str
    """``held``, ``stuck``, ``waiting`` or ``backlog`` (requests but no token)."""
    worker: WorkerState | None
    """The holder's registry entry, when it has one."""
    activity: float | None
    head: HeadAttempt | None = None
    """The attempts of the request it runs or retries, from its events."""

    @property
    def since(self) -> float | None:
        h = self.key.holder
        moment = None if h is None else h.since or h.renewed
        return None if moment is None else moment.timestamp()


_KEY_SORTS: Final[dict[str, Callable[[_KeyRow], Any]]] = {
    "backlog": lambda r: (-r.key.backlog, r.key.key),
    "key": lambda r: r.key.key,
    "since": lambda r: (r.since is None, r.since or 0.0, r.key.key),
    "activity": lambda r: (r.activity is None, r.activity or 0.0, r.key.key),
    "state": lambda r: (r.kind, r.key.key),
    "attempts": lambda r: (-(r.head.attempt if r.head else 0), r.key.key),
}


@dataclass(frozen=True)
class _Timings:
    """A queue's wait and run percentiles: over the last ``RECENT`` seconds, and per slot of the window."""

    wait_p50: float | None
    wait_p99: float | None
    run_p50: float | None
    run_p99: float | None
    waits: int
    runs: int
    wait_series: tuple[list[float | None], list[float | None]]
    run_series: tuple[list[float | None], list[float | None]]

    @classmethod
    def of(cls, monitor: Monitor, queue: str) -> _Timings:
        waits, runs = monitor.waits.get(queue), monitor.runs.get(queue)
        empty: list[float | None] = []
        return cls(
            waits.quantile(0.5) if waits else None, waits.quantile(0.99) if waits else None,
            runs.quantile(0.5) if runs else None, runs.quantile(0.99) if runs else None,
            waits.count() if waits else 0, runs.count() if runs else 0,
            (waits.series(0.5), waits.series(0.99)) if waits else (empty, empty),
            (runs.series(0.5), runs.series(0.99)) if runs else (empty, empty),
        )


def role_text(role: dict[str, Any]) -> str:
    """A worker's part in a queue's priority group, for people (``-`` from a worker that does not say)."""
    policy = role.get("policy")
    if policy is None:
        return "-"
    if policy == "pinned_client":
        return "pinned" if role.get("pinned") else "standby (unpinned)"
    if policy == "prioritized":
        return f"priority {role.get('priority', 0)}"
    if policy == "overflow":
        limits = [f"{role[k]} {what}" for k, what in (("min_pending", "waiting"), ("min_ack_pending", "held"))
                  if role.get(k)]
        return f"overflow from {' or '.join(limits)}" if limits else "overflow primary"
    return str(policy)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class _Pending:
    """One pending request of a key, as its page lists it."""

    seq: int
    task: str
    request_id: str
    stored: float | None


async def _pending(monitor: Monitor, queue: str, key: str) -> list[_Pending]:
    """The key's pending requests in order (at most ``PENDING_LIMIT``)."""
    names = QueueNames(queue)
    found: list[_Pending] = []
    seq = 1
    while len(found) < PENDING_LIMIT:
        msg = await monitor.api.get_msg(names.inbox_stream, seq=seq, next_by_subject=names.inbox(key), direct=False)
        if msg is None:
            break
        stored = parse_time(msg.timestamp)
        found.append(_Pending(msg.seq, msg.headers.get(H.MESSAGE_TYPE, ""), msg.headers.get(H.MSG_ID, ""),
                              None if stored is None else stored.timestamp()))
        seq = msg.seq + 1
    return found


def _registry(monitor: Monitor) -> CollectorRegistry:
    """The dashboard's ``/metrics``: per-queue gauges from the snapshot, and counters of the
    lifecycle events seen since it started (the OpenTelemetry plugin's names)."""
    registry = CollectorRegistry()
    gauges = {
        "backlog": Gauge("keyqueue_queue_backlog", "Requests stored in the inbox", ["keyqueue_queue"],
                         registry=registry),
        "keys_backlog": Gauge("keyqueue_queue_keys_with_backlog", "Keys with pending requests", ["keyqueue_queue"],
                              registry=registry),
        "held": Gauge("keyqueue_keys_held", "Keys held by a worker (fleet-wide)", ["keyqueue_queue"],
                      registry=registry),
        "waiting": Gauge("keyqueue_queue_keys_waiting", "Keys waiting for a worker", ["keyqueue_queue"],
                         registry=registry),
        "dlq": Gauge("keyqueue_queue_dead_letters", "Requests in the dead-letter queue", ["keyqueue_queue"],
                     registry=registry),
        "workers": Gauge("keyqueue_queue_workers", "Live workers", ["keyqueue_queue"], registry=registry),
    }

    def update(snapshot: Any) -> None:
        for queue, found in snapshot.queues.items():
            r = found.report
            gauges["backlog"].labels(queue).set(r.requests)
            gauges["keys_backlog"].labels(queue).set(r.keys_with_backlog)
            gauges["held"].labels(queue).set(r.keys_held)
            gauges["waiting"].labels(queue).set(r.pending_tokens)
            gauges["dlq"].labels(queue).set(r.dlq_size)
            gauges["workers"].labels(queue).set(len(found.live_workers))

    monitor.listeners.append(update)

    class EventCounters:
        def collect(self) -> Any:
            families = {event: CounterMetricFamily(prometheus_name(name, "counter"), INSTRUMENTS[name][1],
                                                   labels=["keyqueue_queue", "keyqueue_task"])
                        for event, name in _EVENT_INSTRUMENTS.items()}
            for (queue, event, task), count in sorted(monitor.event_counts.items()):
                if event in families:
                    families[event].add_metric([queue, task], count)
            yield from families.values()

    registry.register(EventCounters())
    return registry
