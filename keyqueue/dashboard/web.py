"""The dashboard's Starlette app: its pages, live updates, ``/health`` and ``/metrics``.

Every page is server-rendered HTML that works without JavaScript (its tables, search, filters,
sorting and pages are plain links and GET forms, so each view has a shareable URL). With
JavaScript, ``static/live.js`` listens to ``/live`` (server-sent events: one ``refresh`` per
snapshot) and replaces the page's live region with ``?fragment=1`` of the same URL, so counters
move without a reload. The actions (POST) are in ``actions``; who may see and do what is decided
by ``security.Guard`` before any page runs.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from jinja2 import Environment, FileSystemLoader, select_autoescape
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from keyqueue.admin.dead_letters import DeadLetter, dead_letters, get_dead_letter
from keyqueue.admin.diagnosis import diagnose_key
from keyqueue.admin.inspection import parse_time
from keyqueue.admin.key_history import key_events, latest_events, runs_of
from keyqueue.dashboard.actions import action_routes
from keyqueue.dashboard.audit import AuditLog
from keyqueue.dashboard.charts import count_chart, duration, latency_chart, sparkline, time_chart
from keyqueue.dashboard.health import DLQ_SPAN, GROWTH_SPAN, Health, Verdict, judge, overall
from keyqueue.dashboard.key_list import KINDS, key_page
from keyqueue.dashboard.latency import RECENT, WINDOW
from keyqueue.dashboard.schedules import queue_schedules
from keyqueue.dashboard.search import PAGE, RequestFilter, with_where
from keyqueue.dashboard.security import CSRF_FIELD, Access, Caller, Guard, HostPolicy
from keyqueue.dashboard.state import Monitor, QueueView
from keyqueue.dashboard.workflows import queue_workflows, workflow_view
from keyqueue.errors import InvalidKey, KeyqueueError, MessageNotFound, StreamNotFound
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.metrics.prometheus import INSTRUMENTS, prometheus_name
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

__all__ = ["DashboardOptions", "Pages", "create_app", "role_text", "sparkline"]

HERE: Final = Path(__file__).parent
PENDING_LIMIT: Final = 100
"""Pending requests a key's page lists."""
DLQ_LIMIT: Final = 200
"""Dead requests the DLQ page lists."""
KEY_EVENTS_SHOWN: Final = 50
"""Stored events a key's page lists."""
HISTORY_SPANS: Final = {1: 1, 6: 5, 24: 15, 168: 60}
"""Hours a history chart can span -> minutes per point."""

_EVENT_INSTRUMENTS: Final = {
    "enqueued": "keyqueue.requests.enqueued", "succeeded": "keyqueue.requests.succeeded",
    "retried": "keyqueue.requests.retried", "dead_lettered": "keyqueue.requests.dead_lettered",
    "superseded": "keyqueue.requests.superseded",
}
"""Lifecycle event -> the counter it feeds on the dashboard's ``/metrics``."""


@dataclass(frozen=True)
class DashboardOptions:
    """How the dashboard runs: who may use it and from where, whether actions exist, its bounds."""

    access: Access = field(default_factory=Access)
    hosts: HostPolicy = field(default_factory=lambda: HostPolicy("127.0.0.1"))
    read_only: bool = False
    """Hide and refuse every action."""
    stuck_after: float = 60.0
    """Seconds without an event or a progress message after which a held key is listed as stuck."""
    max_wait: float = 300.0
    """Seconds the oldest stored request may wait before ``/health`` fails its queue."""


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


def _url(path: str, params: dict[str, Any]) -> str:
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v not in (None, "")})
    return path + (f"?{query}" if query else "")


class NotFound(Exception):
    """A page of something that does not exist (404 with the message)."""


class Pages:
    """The dashboard's pages over one ``Monitor``: rendering, and the handlers of the GET routes."""

    def __init__(self, monitor: Monitor, options: DashboardOptions) -> None:
        self.monitor = monitor
        self.options = options
        self.audit = AuditLog(monitor.nc)
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
        self.env.globals.update(ago=_ago, until=_until, clock=_clock, sparkline=sparkline, duration=duration,
                                latency_chart=latency_chart, url=_url, count_chart=count_chart,
                                time_chart=time_chart, to_json=_json)

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        snapshot = self.monitor.snapshot
        caller: Caller = getattr(request.state, "caller", Caller("?", "viewer"))
        html = self.env.get_template(template).render(
            request=request, snapshot=snapshot, now=time.time(), read_only=self.options.read_only,
            may_act=caller.may_act and not self.options.read_only, caller=caller, csrf_field=CSRF_FIELD,
            csrf=getattr(request.state, "csrf", ""), fragment=request.query_params.get("fragment") == "1",
            queues=sorted(snapshot.queues), **context)
        return HTMLResponse(html, status)

    def view(self, queue: str) -> QueueView:
        found = self.monitor.snapshot.queues.get(queue)
        if found is None:
            known = ", ".join(sorted(self.monitor.snapshot.queues)) or "none"
            raise NotFound(f"no queue {queue!r} (queues: {known})")
        return found

    def verdicts(self) -> list[Verdict]:
        now = time.time()
        found = []
        for _, view in sorted(self.monitor.snapshot.queues.items()):
            backlog_then, dlq_then = view.sample_ago(GROWTH_SPAN), view.sample_ago(DLQ_SPAN)
            found.append(judge(view.report, view.workers, now=now, max_wait=self.options.max_wait,
                               backlog_then=backlog_then.messages + backlog_then.unkeyed if backlog_then else None,
                               dlq_then=dlq_then.dlq if dlq_then else None))
        return found

    # --- pages ---------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        timings = {queue: _Timings.of(self.monitor, queue) for queue in self.monitor.snapshot.queues}
        verdicts = {v.queue: v for v in self.verdicts()}
        return self.render(request, "overview.html", timings=timings, recent=int(RECENT), window=int(WINDOW // 60),
                           verdicts=verdicts)

    async def keys(self, request: Request) -> Response:
        queue = request.path_params["queue"]
        found = self.view(queue)
        params = request.query_params
        search, kind, sort = params.get("q", "").strip(), params.get("state", "all"), params.get("sort", "backlog")
        now = time.time()
        listed = key_page(self.monitor, queue, found, search=search, kind=kind, sort=sort,
                          page=_number(params.get("page"), 1), stuck_after=self.options.stuck_after, now=now)
        return self.render(request, "keys.html", queue=queue, view=found, listed=listed, search=search, state=kind,
                           sort=sort, kinds=KINDS, stuck_after=self.options.stuck_after)

    async def key(self, request: Request) -> Response:
        queue, key = request.path_params["queue"], request.path_params["key"]
        found = self.view(queue)
        monitor = self.monitor
        try:
            diagnosis = await diagnose_key(monitor.api, queue, key)
        except InvalidKey as exc:
            raise NotFound(str(exc)) from None
        latest = await latest_events(monitor.api, queue, key)
        events = await key_events(monitor.api, queue, key, limit=500, latest=latest)
        letters = await dead_letters(monitor.api, queue, key=key, limit=DLQ_LIMIT) if found.report.dlq_size else []
        progress = await monitor.progress.watch(queue, key)
        pending = await _pending(monitor, queue, key)
        return self.render(request, "key.html", queue=queue, key=key, d=diagnosis, pending=pending,
                           runs=runs_of(events)[:100], events=list(reversed(events))[:KEY_EVENTS_SHOWN],
                           letters=letters, progress=progress, last_progress=monitor.last_progress.get((queue, key)),
                           delayed=await monitor.delays.of_key(queue, key), message=request.query_params.get("done"))

    async def workers(self, request: Request) -> Response:
        merged: dict[str, dict[str, Any]] = {}
        for queue, found in sorted(self.monitor.snapshot.queues.items()):
            for w in found.workers:
                entry = merged.setdefault(w.name, {"state": w, "queues": [], "used": 0, "slots": 0, "roles": []})
                entry["queues"].append(queue)
                entry["roles"].append((queue, role_text(w.record.role)))
                entry["used"] += w.record.used
                entry["slots"] += w.record.slots
                if w.received > entry["state"].received:
                    entry["state"] = w
        rows = sorted(merged.values(), key=lambda e: e["state"].name)
        return self.render(request, "workers.html", live=[e for e in rows if e["state"].live],
                           gone=[e for e in rows if not e["state"].live])

    async def dlq(self, request: Request) -> Response:
        queue = request.path_params["queue"]
        self.view(queue)
        selected = RequestFilter.from_query(request.query_params)
        filtered = not selected.empty
        one_key = selected.key and not any(c in selected.key for c in "*?[") and not (
            selected.text or selected.task or selected.error)
        if one_key:  # read from the stream itself: exact even while the search index is being built
            letters = await dead_letters(self.monitor.api, queue, key=selected.key, limit=DLQ_LIMIT)
            total = len(letters)
        elif filtered:
            matches = self.monitor.search.matching(queue, with_where(selected, "dead"))
            letters = [letter for letter in await _letters(self.monitor, queue, [m.seq for m in matches[:DLQ_LIMIT]])]
            total = len(matches)
        else:
            letters = await dead_letters(self.monitor.api, queue, limit=DLQ_LIMIT)
            total = self.view(queue).report.dlq_size
        by_key: dict[str, int] = {}
        for letter in letters:
            by_key[letter.key] = by_key.get(letter.key, 0) + 1
        return self.render(request, "dlq.html", queue=queue, letters=letters, by_key=by_key, selected=selected,
                           filtered=filtered, total=total, message=request.query_params.get("done"))

    async def search(self, request: Request) -> Response:
        queues = sorted(self.monitor.snapshot.queues)
        queue = request.query_params.get("queue") or (queues[0] if queues else "")
        selected = RequestFilter.from_query(request.query_params)
        found = None
        if queue:
            self.view(queue)
            delayed = (await self.monitor.delays.of(queue)).requests if selected.where in ("all", "delayed") else []
            page = _number(request.query_params.get("page"), 1)
            found = self.monitor.search.search(queue, selected, delayed, page=page)
            found = replace(found, entries=await self.monitor.search.verify(queue, found.entries))
        return self.render(request, "search.html", queue=queue, selected=selected, found=found, page_size=PAGE,
                           message=request.query_params.get("done"))

    async def history(self, request: Request) -> Response:
        queue = request.path_params["queue"]
        self.view(queue)
        hours = _number(request.query_params.get("hours"), 6)
        hours = hours if hours in HISTORY_SPANS else 6
        points = await self.monitor.history.points(queue, hours=hours, step=HISTORY_SPANS[hours])
        return self.render(request, "history.html", queue=queue, hours=hours, spans=list(HISTORY_SPANS),
                           points=points, step=HISTORY_SPANS[hours])

    async def workflow(self, request: Request) -> Response:
        queue, workflow_id = request.path_params["queue"], request.path_params["workflow_id"]
        found = await workflow_view(self.monitor.nc, queue, workflow_id)
        if found is None:
            raise NotFound(f"no workflow {workflow_id!r} in queue {queue!r} (a workflow is kept in the queue of its "
                           "first step, for 7 days after its last change)")
        stopped = found.steps[found.stopped_at] if found.stopped_at is not None else None
        if request.query_params.get("format") == "json":
            return JSONResponse(found.fields())
        return self.render(request, "workflow.html", queue=queue, wf=found, stopped=stopped)

    async def workflows(self, request: Request) -> Response:
        queue = request.path_params["queue"]
        listed, total = await queue_workflows(self.monitor.nc, queue)
        return self.render(request, "workflows.html", queue=queue, workflows=listed, total=total)

    async def schedules(self, request: Request) -> Response:
        monitor = self.monitor
        found = [await queue_schedules(monitor.nc, monitor.delays, q) for q in sorted(monitor.snapshot.queues)]
        return self.render(request, "schedules.html", schedules=found)

    async def audit_page(self, request: Request) -> Response:
        queues = sorted(self.monitor.snapshot.queues)
        only = request.query_params.get("queue") or None
        entries = await self.audit.recent([only] if only in queues else queues)
        return self.render(request, "audit.html", entries=entries, only=only)

    async def health(self, request: Request) -> Response:
        verdicts = self.verdicts()
        result = Health(overall(verdicts), time.time(), verdicts)
        if self.monitor.snapshot.error:
            away = Verdict("(server)", "fail", [self.monitor.snapshot.error])
            result = Health("fail", result.checked, [*verdicts, away])
        body = result.fields(detailed=bool(getattr(request.state, "authenticated", False)))
        return JSONResponse(body, 503 if result.status == "fail" else 200, headers={"Cache-Control": "no-store"})

    async def live(self, request: Request) -> Response:
        monitor = self.monitor

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


def create_app(monitor: Monitor, options: DashboardOptions | None = None) -> Starlette:
    """The dashboard on ``monitor``'s snapshot (the caller runs ``monitor.run()``)."""
    options = options or DashboardOptions()
    pages = Pages(monitor, options)
    registry = _registry(monitor)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: Exception) -> Response:
        return pages.render(request, "error.html", status=404, message=str(exc))

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, StreamNotFound):
            return pages.render(request, "error.html", status=404, message=str(exc))
        if isinstance(exc, KeyqueueError):
            return pages.render(request, "error.html", status=502, message=f"{type(exc).__name__}: {exc}")
        raise exc

    routes = [
        Route("/", pages.overview),
        Route("/queues/{queue}/keys", pages.keys),
        Route("/queues/{queue}/keys/{key:path}", pages.key),
        Route("/queues/{queue}/dlq", pages.dlq),
        Route("/queues/{queue}/history", pages.history),
        Route("/queues/{queue}/workflows", pages.workflows),
        Route("/queues/{queue}/workflows/{workflow_id}", pages.workflow),
        Route("/search", pages.search),
        Route("/workers", pages.workers),
        Route("/schedules", pages.schedules),
        Route("/audit", pages.audit_page),
        Route("/health", pages.health),
        Route("/live", pages.live),
        Route("/metrics", metrics),
        *action_routes(pages),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Guard, access=options.access, hosts=options.hosts)],
                     exception_handlers={NotFound: not_found, KeyqueueError: server_error})


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


def _number(text: str | None, default: int) -> int:
    return int(text) if text is not None and text.isdigit() else default


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


@dataclass(frozen=True)
class _Pending:
    """One pending request of a key, as its page lists it."""

    seq: int
    task: str
    request_id: str
    stored: float | None
    arguments: Any


async def _pending(monitor: Monitor, queue: str, key: str) -> list[_Pending]:
    """The key's pending requests in order (at most ``PENDING_LIMIT``)."""
    names = QueueNames(queue)
    found: list[_Pending] = []
    async for page in monitor.api.pages(names.inbox_stream, names.inbox(key), limit=PENDING_LIMIT, batch=PENDING_LIMIT):
        for msg in page:
            if H.is_release_marker(msg.headers):  # a former holder's, not a request
                continue
            stored = parse_time(msg.timestamp)
            try:
                arguments: Any = loads(msg.data, msg.headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
            except KeyqueueError:
                arguments = f"<{len(msg.data)} bytes that do not decode>"
            found.append(_Pending(msg.seq, msg.headers.get(H.MESSAGE_TYPE, ""), msg.headers.get(H.MSG_ID, ""),
                                  None if stored is None else stored.timestamp(), arguments))
    return found


async def _letters(monitor: Monitor, queue: str, seqs: list[int]) -> list[DeadLetter]:
    """The dead requests at ``seqs`` still in the DLQ, in order."""

    async def one(seq: int) -> DeadLetter | None:
        try:
            return await get_dead_letter(monitor.api, queue, seq)
        except MessageNotFound:
            return None

    return [letter for letter in await asyncio.gather(*(one(s) for s in seqs)) if letter is not None]


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
        "unkeyed": Gauge("keyqueue_queue_unkeyed_requests", "Requests of unkeyed tasks stored in the work stream",
                         ["keyqueue_queue"], registry=registry),
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
            gauges["unkeyed"].labels(queue).set(r.unkeyed)
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

