"""The dashboard's actions: every POST, each checked, confirmed when it touches many, and audited.

Before any action runs: ``--read-only`` refuses it (405); a viewer is refused (403); a form whose
CSRF token does not match its cookie is refused (403). ``security.Guard`` has already refused a
foreign ``Host`` or ``Origin``. Each action, done, failed or refused, is one entry of the audit log
(``audit``) saying who, what and how many.

- ``/queues/<q>/dlq/{replay,delete,purge}``: one dead request (``seq``), a key's, or (purge) the
  whole DLQ; a purge asks for the queue's name to be typed.
- ``/queues/<q>/cancel``: one pending or delayed request (``keyqueue cancel``'s protocol): it never
  runs, its key's holder removes it in order.
- ``/queues/<q>/release``: hand on a key left by a gone worker now, by ``keyqueue release``'s code
  and rule (``keyqueue.admin.release``): refused while the holder looks alive; forcing it asks for
  the key's name to be typed, and says why it was refused.
- ``/queues/<q>/bulk/{replay,delete,cancel}``: every dead (replay, delete) or pending and delayed
  (cancel) request a :class:`~keyqueue.dashboard.search.RequestFilter` selects. The first POST
  answers with a confirmation page that says how many it touches; the second carries that count
  and runs only if the filter still selects as many (else it asks again with the new count).
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any, Final

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from keyqueue.admin.cancels import cancel_request, cancel_requests
from keyqueue.admin.dead_letters import delete_dead_letters, purge_dead_letters, replay
from keyqueue.admin.diagnosis import diagnose_key
from keyqueue.admin.release import HolderAlive, describe, release_keys
from keyqueue.dashboard.audit import Outcome, entry
from keyqueue.dashboard.search import IndexEntry, RequestFilter, with_where
from keyqueue.dashboard.security import CSRF_COOKIE, CSRF_FIELD, Caller, csrf_matches
from keyqueue.errors import KeyqueueError, MessageNotFound
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames

if TYPE_CHECKING:
    from keyqueue.dashboard.web import Pages

__all__ = ["BULK", "action_routes"]

BULK: Final = {"replay": "dead", "delete": "dead", "cancel": "pending"}
"""Bulk action -> the requests it applies to (cancel: pending and delayed)."""


def action_routes(pages: Pages) -> list[Route]:
    """The POST routes of the dashboard's actions."""

    async def admitted(request: Request, queue: str, action: str) -> FormData | Response:
        """The action's form if this caller may take it now on an existing queue, else its refusal."""
        caller: Caller = request.state.caller
        if pages.options.read_only:
            return PlainTextResponse("this dashboard is read-only", 405)
        form = await request.form()
        why = None
        if not caller.may_act:
            why, status = f"the {caller.role} role may look, not act; ask an operator", 403
        elif not csrf_matches(request.cookies.get(CSRF_COOKIE), _text(form.get(CSRF_FIELD))):
            why, status = "CSRF token missing or wrong; reload the page and try again", 403
        if why is not None:
            await record(request, queue, action, _text(form.get("key")) or _text(form.get("seq")) or "-", 0,
                         "refused", why)
            return PlainTextResponse(why, status)
        pages.view(queue)
        return form

    async def record(request: Request, queue: str, action: str, what: str, count: int, outcome: Outcome,
                     detail: str = "") -> None:
        caller: Caller = request.state.caller
        await pages.audit.record(entry(queue, caller.name, caller.role, action, what, count, outcome, detail))

    async def dlq_action(request: Request) -> Response:
        queue, action = request.path_params["queue"], request.path_params["action"]
        form = await admitted(request, queue, action)
        if isinstance(form, Response):
            return form
        key = _text(form.get("key")) or None
        seq_text = _text(form.get("seq"))
        seq = int(seq_text) if seq_text.isdigit() else None
        monitor = pages.monitor
        if action == "purge" and _text(form.get("confirm")) != queue:
            return pages.render(request, "confirm.html", queue=queue, key=key)
        what = (f"key {key}" if key else "") + (f" seq {seq}" if seq is not None else "") or "the whole DLQ"
        try:
            if action == "replay":
                count = await replay(monitor.api, Publisher(monitor.nc, QueueNames(queue), timeout=5.0), queue,
                                     key=key, seqs=[seq] if seq is not None else None)
                done = f"replayed {count} request(s)"
            elif action == "delete" and seq is not None:
                await delete_dead_letters(monitor.api, queue, [seq])
                count, done = 1, f"deleted dead request {seq}"
            elif action == "purge":
                count = await purge_dead_letters(monitor.api, queue, key=key)
                done = f"purged {count} dead request(s)"
            else:
                return PlainTextResponse(f"unknown action {action!r}", 400)
        except MessageNotFound as exc:
            await record(request, queue, action, what.strip(), 0, "failed", exc.description)
            return PlainTextResponse(exc.description, 404)
        await record(request, queue, action, what.strip(), count, "done", done)
        await monitor.poll()
        return RedirectResponse(pages_url(f"/queues/{queue}/dlq", {"done": done, "key": key or ""}), 303)

    async def cancel(request: Request) -> Response:
        queue = request.path_params["queue"]
        form = await admitted(request, queue, "cancel")
        if isinstance(form, Response):
            return form
        request_id = _text(form.get("request_id"))
        seq_text = _text(form.get("seq"))
        if not request_id:
            return PlainTextResponse("which request? the form has no request_id", 400)
        state = await cancel_request(pages.monitor.nc, queue, request_id, int(seq_text) if seq_text.isdigit() else None)
        done = f"cancel of request {request_id}: {state}"
        await record(request, queue, "cancel", f"request {request_id}", 1, "done", state)
        return RedirectResponse(_back(_text(form.get("back")), f"/queues/{queue}/keys", done), 303)

    async def release(request: Request) -> Response:
        queue = request.path_params["queue"]
        form = await admitted(request, queue, "release")
        if isinstance(form, Response):
            return form
        key = _text(form.get("key"))
        force = _text(form.get("force")) == "1"
        if not key:
            return PlainTextResponse("which key? the form has no key", 400)
        back = f"/queues/{queue}/keys/{key}"
        if _text(form.get("confirm")) != key:  # first, say what it touches (forcing: the key typed)
            return pages.render(request, "confirm_release.html", queue=queue, key=key, alive=None, force=force,
                                holder=await _holder_of(pages, queue, key))
        try:
            released = await release_keys(pages.monitor.api, queue, key=key, force=force)
        except HolderAlive as exc:
            # The CLI's rule: not while the holder looks alive, unless forced by someone who knows it is gone.
            await record(request, queue, "release", f"key {key}", 0, "refused", str(exc))
            return pages.render(request, "confirm_release.html", queue=queue, key=key, alive=str(exc), force=True,
                                holder=await _holder_of(pages, queue, key))
        done = "; ".join(f"released {describe(r)}" for r in released) or f"nothing to release: nobody holds {key}"
        await record(request, queue, "force-release" if force else "release", f"key {key}", len(released), "done",
                     done)
        await pages.monitor.poll()
        return RedirectResponse(_back(back, back, done), 303)

    async def bulk(request: Request) -> Response:
        queue, action = request.path_params["queue"], request.path_params["action"]
        if action not in BULK:
            return PlainTextResponse(f"unknown bulk action {action!r}; one of {', '.join(BULK)}", 400)
        form = await admitted(request, queue, f"bulk-{action}")
        if isinstance(form, Response):
            return form
        fields = {k: _text(form.get(k)) for k in ("q", "key", "task", "error")}
        selected = RequestFilter.from_query(fields)
        back = _text(form.get("back")) or pages_url("/search", {"queue": queue, **selected.query()})
        if selected.empty:
            return PlainTextResponse("a bulk action needs a filter (text, key, task or error): it never applies "
                                     "to everything at once", 400)
        chosen = await _chosen(pages, queue, selected, action)
        confirmed = _text(form.get("confirm"))
        if confirmed != str(len(chosen)):
            return pages.render(request, "confirm_bulk.html", queue=queue, action=action, selected=selected,
                                fields=fields, count=len(chosen), before=confirmed, back=back,
                                sample=chosen[:10])
        what = f"filter {selected.describe()}"
        try:
            done = await _run(pages, queue, action, chosen)
        except KeyqueueError as exc:
            await record(request, queue, f"bulk-{action}", what, len(chosen), "failed", str(exc))
            return PlainTextResponse(f"{action} failed: {exc}", 502)
        await record(request, queue, f"bulk-{action}", what, len(chosen), "done", done)
        await pages.monitor.poll()
        return RedirectResponse(_back(back, f"/search?queue={queue}", done), 303)

    return [
        Route("/queues/{queue}/dlq/{action}", dlq_action, methods=["POST"]),
        Route("/queues/{queue}/cancel", cancel, methods=["POST"]),
        Route("/queues/{queue}/release", release, methods=["POST"]),
        Route("/queues/{queue}/bulk/{action}", bulk, methods=["POST"]),
    ]


async def _chosen(pages: Pages, queue: str, selected: RequestFilter, action: str) -> list[IndexEntry]:
    """The requests a bulk action applies to, still stored, oldest first."""
    search = pages.monitor.search
    if BULK[action] == "dead":
        found = search.matching(queue, with_where(selected, "dead"))
    else:
        delayed = (await pages.monitor.delays.of(queue)).requests
        found = [e for e in search.matching(queue, RequestFilter(selected.text, selected.key, selected.task, "",
                                                                 "all"), delayed) if e.where != "dead"]
    return await search.verify(queue, found)


async def _run(pages: Pages, queue: str, action: str, chosen: list[IndexEntry]) -> str:
    monitor = pages.monitor
    if action == "replay":
        count = await replay(monitor.api, Publisher(monitor.nc, QueueNames(queue), timeout=5.0), queue,
                             seqs=[e.seq for e in chosen])
        return f"replayed {count} request(s)"
    if action == "delete":
        await delete_dead_letters(monitor.api, queue, [e.seq for e in chosen])
        return f"deleted {len(chosen)} dead request(s)"
    states = await cancel_requests(monitor.nc, queue, [(e.request_id, e.seq or None) for e in chosen])
    return f"cancel of {len(chosen)} request(s): " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))


async def _holder_of(pages: Pages, queue: str, key: str) -> str | None:
    """Who the key's lease record names, for a confirmation."""
    diagnosis = await diagnose_key(pages.monitor.api, queue, key)
    if diagnosis.holder is None:
        return None
    w = diagnosis.holder_worker
    state = "not in the worker registry" if w is None else "live" if w.live else f"gone: {w.gone_because}"
    return f"{diagnosis.holder.worker or 'an unnamed worker'} ({state})"


def pages_url(path: str, params: dict[str, str]) -> str:
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v})
    return path + (f"?{query}" if query else "")


def _back(back: str, default: str, done: str) -> str:
    """Where to go after an action: ``back`` if it is a path of this dashboard, with ``done`` added."""
    target = back if back.startswith("/") and not back.startswith("//") else default
    parts = urllib.parse.urlsplit(target)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in ("done", "page")]
    return urllib.parse.urlunsplit(("", "", parts.path, urllib.parse.urlencode([*query, ("done", done)]), ""))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
