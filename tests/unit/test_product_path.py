"""The per-request fast paths of the product path (``keyqueue worker``) give what the general paths give.

Each fast path (reading the headers, binding arguments, the retry policy, which lifecycle hooks
are queued, the events' ULID clock) is checked against the general code it shortcuts, on input
chosen to reach every branch, so an optimisation that changes behaviour fails here.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import cbor2
import pytest

import keyqueue
from keyqueue.app.worker import Worker
from keyqueue.builtins import processor
from keyqueue.builtins.processor import TaskProcessor
from keyqueue.core.observer import KeyHold, Outcome, RequestAttempt, SessionEnd
from keyqueue.core.processor import Request
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import MalformedBody, MissingHeader, UnsupportedVersion
from keyqueue.plugins.manager import PluginManager
from keyqueue.tasks.arguments import ArgumentCodec
from keyqueue.wire import CONTENT_TYPES, Envelope, peek
from keyqueue.wire import headers as H

T = TypeVar("T")


# --- peek ------------------------------------------------------------------------------------------


def reference_peek(headers: Mapping[str, str] | None) -> Envelope:
    """``peek`` as it was written before its fast path: each header looked up on its own."""

    def header(name: str) -> str | None:
        value = headers.get(name) if headers else None
        if value is None and headers:
            value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
        return value or None

    def required(name: str) -> str:
        value = header(name)
        if value is None:
            raise MissingHeader(name)
        return value

    raw_content_type = required(H.CONTENT_TYPE)
    content_type = raw_content_type.split(";", 1)[0].strip().lower()
    if content_type not in CONTENT_TYPES:
        raise keyqueue.UnsupportedContentType(raw_content_type, CONTENT_TYPES)
    message_type = required(H.MESSAGE_TYPE)
    raw_version = required(H.MESSAGE_VERSION)
    if not re.fullmatch(r"[1-9][0-9]{0,17}", raw_version):
        error = UnsupportedVersion(message_type, raw_version, 0)
        error.args = (f"{message_type}: {H.MESSAGE_VERSION} {raw_version!r} is not a positive integer",)
        raise error
    return Envelope(content_type, message_type, int(raw_version), required(H.MSG_ID),
                    header(H.REPLY_INBOX), header(H.TRACEPARENT))


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return type(exc), str(exc)


def header_maps() -> list[dict[str, str] | None]:
    base = {H.CONTENT_TYPE: H.CBOR, H.MESSAGE_TYPE: "charge", H.MESSAGE_VERSION: "1", H.MSG_ID: "01J"}
    maps: list[dict[str, str] | None] = [None, {}, base, {**base, H.REPLY_INBOX: "_INBOX.x", H.TRACEPARENT: "00-a"}]
    rng = random.Random(14)
    names = [H.CONTENT_TYPE, H.MESSAGE_TYPE, H.MESSAGE_VERSION, H.MSG_ID, H.REPLY_INBOX, H.TRACEPARENT]
    values = {H.CONTENT_TYPE: [H.CBOR, H.JSON, "Application/JSON; charset=utf-8", " application/cbor ", "text/plain",
                               ""],
              H.MESSAGE_VERSION: ["1", "2", "17", "0", "01", "-1", "1.0", "", "x", "1" * 19],
              H.MSG_ID: ["01J", ""], H.MESSAGE_TYPE: ["charge", ""], H.REPLY_INBOX: ["_INBOX.y", ""],
              H.TRACEPARENT: ["00-b", ""]}
    for _ in range(3000):
        headers: dict[str, str] = {"Nats-Stream": "KQ_shop_INBOX"}
        for name in names:
            choice = rng.random()
            if choice < 0.15:
                continue  # absent
            spelt = name if choice < 0.6 else rng.choice([name.lower(), name.upper(), name.swapcase()])
            headers[spelt] = rng.choice(values[name])
            if rng.random() < 0.1:  # the same name twice, in another letter case
                headers[name.swapcase()] = rng.choice(values[name])
        maps.append(headers)
    return maps


def test_peek_reads_headers_as_the_reference_does() -> None:
    for headers in header_maps():
        assert outcome(peek, headers) == outcome(reference_peek, headers), headers


# --- binding arguments -----------------------------------------------------------------------------


async def plain(a: int, b: str = "b", *, c: int, d: int = 4) -> None: ...
async def keywords(*, x: int, y: int = 2) -> None: ...
async def nothing() -> None: ...
async def star(a: int, *rest: int, **more: int) -> None: ...
async def positional_only(a: int, /, b: int = 2) -> None: ...


@pytest.mark.parametrize("fn", [plain, keywords, nothing, star, positional_only])
def test_to_call_binds_as_the_general_path_does(fn: Any) -> None:
    codec = ArgumentCodec(fn, fn.__name__)
    names = ["a", "b", "c", "d", "x", "y", "rest", "more", "other"]
    rng = random.Random(fn.__name__)
    for _ in range(500):
        fields = {name: rng.choice([1, [1, 2], {"k": 1}]) for name in names if rng.random() < 0.5}
        assert outcome(codec.to_call, fields) == outcome(codec._to_call, fields), fields


def test_to_call_refuses_what_does_not_fit_with_the_general_message() -> None:
    codec = ArgumentCodec(plain, "plain")
    with pytest.raises(MalformedBody, match="unexpected argument"):
        codec.to_call({"a": 1, "c": 2, "zzz": 3})
    with pytest.raises(MalformedBody, match="do not fit its signature"):
        codec.to_call({"a": 1})  # c is required
    assert codec.to_call({"a": 1, "c": 3}) == ([1], {"c": 3})
    assert codec.to_call({"c": 3, "a": 1, "d": 5}) == ([1], {"c": 3, "d": 5})
    assert codec.to_call({"b": "x", "c": 3, "a": 1}) == ([1, "x"], {"c": 3})


# --- the default processor -------------------------------------------------------------------------


def make_app() -> tuple[keyqueue.App, Any]:
    app = keyqueue.App("shop", set_as_default=False, autoload_plugins=False)

    @app.task(key="{k}", max_attempts=7)
    async def note(k: str, i: int) -> int:
        return i * 2

    return app, note


def request(seq: int = 1, **extra: str) -> Request:
    headers = {H.CONTENT_TYPE: H.CBOR, H.MESSAGE_TYPE: "note", H.MESSAGE_VERSION: "1", H.MSG_ID: f"01J{seq}",
               "Nats-Stream": "KQ_shop_INBOX", **extra}
    return Request("k1", seq, "kq.shop.in.k1", headers, cbor2.dumps({"k": "k1", "i": seq}))


class Ctx:
    queue, key, fencing, attempt = "shop", "k1", (1, 1), 1
    request_id = "01J1"
    log: Any = None
    hold_removal = None

    def lease_valid(self) -> bool:
        return True

    def lease_remaining(self) -> float:
        return math.inf

    def check_lease(self) -> None:
        return None

    async def steady(self, step: Callable[[], Awaitable[T]]) -> T:
        return await step()

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def progress(self, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        return None


async def test_a_request_s_headers_are_read_once_for_its_policy_and_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app()
    reads: list[object] = []
    def counted_peek(headers: Any) -> Any:
        reads.append(headers)
        return peek(headers)

    monkeypatch.setattr(processor, "peek", counted_peek)
    proc = TaskProcessor(app, "shop", "k1", app.queue_tasks("shop"))
    for seq in (1, 2):
        req = request(seq, **{H.REPLY_INBOX: "_INBOX.r"})
        assert proc.retry_policy(req) == RetryPolicy(max_attempts=7)
        reply = await proc.handle(Ctx(), req)
        assert reply is not None and cbor2.loads(reply.data) == seq * 2
    assert len(reads) == 2


async def test_the_retry_policy_hook_is_asked_whenever_a_plugin_implements_it() -> None:
    app, _ = make_app()
    proc = TaskProcessor(app, "shop", "k1", app.queue_tasks("shop"))
    assert proc.retry_policy(request()) is proc.retry_policy(request(2))  # built once per task

    asked: list[str] = []

    class Patient:
        @keyqueue.hookimpl
        def keyqueue_retry_policy(self, request: Request) -> RetryPolicy:
            asked.append(request.request_id)
            return RetryPolicy(max_attempts=99)

    plugin = Patient()
    app.plugins.register(plugin)  # after the processor was built: it is asked from now on
    assert proc.retry_policy(request(3)) == RetryPolicy(max_attempts=99)
    assert asked == ["01J3"]
    app.plugins.unregister(plugin)
    assert proc.retry_policy(request(4)) == RetryPolicy(max_attempts=7)


def test_the_implementations_of_a_hook_follow_registration() -> None:
    manager = PluginManager(autoload=False)
    assert [i.plugin_name for i in manager.implementations("keyqueue_request_failed")] == [
        "keyqueue.builtins.events"]

    class Watcher:
        @keyqueue.hookimpl
        def keyqueue_request_failed(self) -> None: ...

    name = manager.register(Watcher())
    assert len(manager.implementations("keyqueue_request_failed")) == 2
    manager.set_blocked("keyqueue.builtins.events")
    assert [i.plugin_name for i in manager.implementations("keyqueue_request_failed")] == [name]
    manager.unregister(name=name)
    assert manager.implementations("keyqueue_request_failed") == ()
    assert manager.implementations("keyqueue_no_such_hook") == ()


# --- the worker's lifecycle plumbing ---------------------------------------------------------------


async def test_the_worker_queues_only_the_hooks_some_plugin_implements() -> None:
    app, _ = make_app()
    app.plugins.set_blocked("keyqueue.builtins.events")
    failures: list[tuple[str, float]] = []

    class Failures:
        @keyqueue.hookimpl
        def keyqueue_request_failed(self, request_id: str, elapsed: float) -> None:
            failures.append((request_id, elapsed))

    app.plugins.register(Failures())
    worker = Worker(app)
    attempt = RequestAttempt("shop", "k1", "01J1", "note", 1, 1)
    worker.key_acquired(KeyHold("shop", "k1", (1, 1), 1))
    worker.request_started(attempt)
    assert worker.around_attempt(attempt, Ctx(), [request()]) is worker.around_attempt(attempt, Ctx(), [request()])
    worker.attempt_failed(attempt, RuntimeError("no"))
    worker.request_retried(attempt, 0.5, RuntimeError("no"))
    worker.request_succeeded(attempt, 0.01, None)
    worker.key_released(KeyHold("shop", "k1", (1, 1), 1), SessionEnd(Outcome.RELEASED))
    assert worker.events_waiting == 1  # only keyqueue_request_failed has an implementation
    call = worker._events.get_nowait()
    assert call is not None
    await call()
    [(request_id, elapsed)] = failures
    assert request_id == "01J1" and elapsed >= 0


OBSERVED_HOOKS = ("keyqueue_key_acquired", "keyqueue_key_released", "keyqueue_request_started",
                  "keyqueue_request_failed", "keyqueue_request_retried", "keyqueue_request_succeeded",
                  "keyqueue_request_superseded", "keyqueue_request_dead_lettered", "keyqueue_worker_pinned",
                  "keyqueue_worker_unpinned")
"""The lifecycle hooks a worker's key sessions (and lanes) tell it of."""


def every_observer(manager: PluginManager, record: Callable[[str, dict[str, Any]], Any], *,
                   inline: bool) -> object:
    """A plugin implementing each of :data:`OBSERVED_HOOKS` with every argument its spec names."""
    namespace: dict[str, Any] = {"record": record}
    for name in OBSERVED_HOOKS:
        args = manager.hook.__dict__[name].spec.argnames
        exec(f"def {name}(self, {', '.join(args)}):\n"
             f"    return record({name!r}, dict({', '.join(f'{a}={a}' for a in args)}))", namespace)
    marks = (keyqueue.inline_observer,) if inline else ()
    methods = {}
    for name in OBSERVED_HOOKS:
        function = namespace[name]
        for mark in marks:
            function = mark(function)
        methods[name] = keyqueue.hookimpl(function)
    return type("EveryObserver", (), methods)()


def tell_every_step(worker: Worker) -> None:
    attempt = RequestAttempt("shop", "k1", "01J1", "note", 1, 1, stored_at="2026-03-01T12:30:05.5Z")
    hold = KeyHold("shop", "k1", (1, 1), 1)
    worker.key_acquired(hold)
    worker.request_started(attempt)
    worker.attempt_failed(attempt, RuntimeError("no"))
    worker.request_retried(attempt, 0.5, RuntimeError("no"))
    worker.request_succeeded(attempt, 0.01, None)
    worker.request_succeeded(attempt, 0.01, "01J2")
    worker.request_dead_lettered(attempt, "max-attempts", RuntimeError("no"))
    worker.worker_pinned("shop", "pin-1")
    worker.worker_unpinned("shop", "pin-1")
    worker.key_released(hold, SessionEnd(Outcome.RELEASED))


async def test_inline_observers_are_called_at_the_step_and_the_others_by_the_dispatcher() -> None:
    """An inline observer (``keyqueue.inline_observer``) is called at the step itself, with every
    argument its hook's spec names; the others wait for the dispatcher, with the same arguments; an
    awaitable an inline one returns is awaited by the dispatcher; one that raises is logged and the
    others still run."""
    app, _ = make_app()
    app.plugins.set_blocked("keyqueue.builtins.events")
    at_once: list[tuple[str, dict[str, Any]]] = []
    later: list[tuple[str, dict[str, Any]]] = []
    sent: list[str] = []

    async def send(request_id: str) -> None:
        sent.append(request_id)

    class Failing:
        @keyqueue.hookimpl
        @keyqueue.inline_observer
        def keyqueue_request_started(self) -> None:
            raise RuntimeError("a broken plugin")

    class Sending:
        @keyqueue.hookimpl
        @keyqueue.inline_observer
        def keyqueue_request_succeeded(self, request_id: str) -> Awaitable[None]:
            return send(request_id)

    app.plugins.register(every_observer(app.plugins, lambda name, kwargs: at_once.append((name, kwargs)),
                                        inline=True))
    app.plugins.register(every_observer(app.plugins, lambda name, kwargs: later.append((name, kwargs)),
                                        inline=False))
    app.plugins.register(Failing())
    app.plugins.register(Sending())
    worker = Worker(app)
    tell_every_step(worker)
    assert sorted({name for name, _ in at_once}) == sorted(OBSERVED_HOOKS)
    for name, kwargs in at_once:
        assert tuple(kwargs) == app.plugins.hook.__dict__[name].spec.argnames, name
        assert kwargs["worker"] is worker
    assert dict(at_once)["keyqueue_request_started"]["enqueued_at"] == pytest.approx(
        datetime.datetime(2026, 3, 1, 12, 30, 5, 500000, tzinfo=datetime.UTC).timestamp())
    assert later == [] and sent == []  # the queued observers, and the awaitable, wait for the dispatcher
    while worker.events_waiting:
        call = worker._events.get_nowait()
        assert call is not None
        await call()
    assert later == at_once
    assert sent == ["01J1"]


async def test_inline_observers_keep_the_call_order_of_opening_and_closing_hooks() -> None:
    """Among inline observers, the last registered is called first on an opening hook and last on a
    closing one (docs/plugins.md, "Order"), as the dispatcher calls the others."""
    app, _ = make_app()
    app.plugins.set_blocked("keyqueue.builtins.events")
    order: list[str] = []
    def recorder(who: str) -> Callable[[str, dict[str, Any]], None]:
        return lambda name, _: order.append(f"{who} {name}")

    for who in ("first", "second"):
        app.plugins.register(every_observer(app.plugins, recorder(who), inline=True))
    worker = Worker(app)
    hold = KeyHold("shop", "k1", (1, 1), 1)
    worker.key_acquired(hold)
    worker.key_released(hold, SessionEnd(Outcome.RELEASED))
    assert order == ["second keyqueue_key_acquired", "first keyqueue_key_acquired",
                     "first keyqueue_key_released", "second keyqueue_key_released"]
    assert worker.events_waiting == 0


async def test_the_dispatcher_makes_hook_calls_in_order_and_holds_sessions_back_at_the_backlog() -> None:
    """The hook calls wait in a deque with one waiter (not an ``asyncio.Queue``): made in the order
    queued, the dispatcher woken by the first after it found none, sessions held back (``_full``)
    while ``event_backlog`` wait and let go once the dispatcher has made room."""
    app, _ = make_app()
    worker = Worker(app)
    worker.event_backlog = 3
    made: list[int] = []
    gate = asyncio.Event()

    def call(n: int) -> Callable[[], Awaitable[None]]:
        async def made_n() -> None:
            await gate.wait()
            made.append(n)
        return made_n

    dispatcher = asyncio.create_task(worker._dispatch())
    await asyncio.sleep(0)  # it finds nothing and waits
    for n in range(4):
        worker._queue(call(n))
    assert worker.events_waiting == 4 and worker._full and not worker._room.is_set()
    held_back = asyncio.create_task(worker.wait_for_room())
    await asyncio.sleep(0)
    assert not held_back.done() and worker.held_back == 1
    gate.set()
    await held_back  # room once fewer than three wait
    worker._events.put_nowait(None)  # what the worker queues to end its dispatcher
    await dispatcher
    assert made == [0, 1, 2, 3]
    assert not worker._full and worker._room.is_set() and worker.events_waiting == 0


async def test_a_settled_request_is_told_to_the_workflows_plugin_only_when_it_is_a_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``keyqueue_request_settled`` with the built-in workflows plugin as its one implementation is
    not called for a request that is no workflow step (it would return at once); it is for one that
    says it is a step, and for any request once another plugin implements the hook."""
    from keyqueue.builtins import workflows
    from keyqueue.builtins.request_records import RecordingTaskProcessor

    app, note = make_app()
    looked_at: list[str] = []
    told: list[str] = []

    def step_of(headers: Mapping[str, str]) -> None:
        looked_at.append(headers[H.MSG_ID])
        return None  # (a step's own work needs a server: its headers are all this test follows)

    class Another:
        @keyqueue.hookimpl
        def keyqueue_request_settled(self, request: Request) -> None:
            told.append(request.request_id)

    monkeypatch.setattr(workflows, "step_of", step_of)
    records = RecordingTaskProcessor(app, "shop", "k1", {"note": note})
    plain, step = request(1), request(2, **{H.WORKFLOW_ID: "wf1"})
    await records._settled(Ctx(), plain, H.STATUS_OK)
    await records._settled(Ctx(), step, H.STATUS_OK)
    assert looked_at == ["01J2"]
    app.plugins.register(Another())
    await records._settled(Ctx(), plain, H.STATUS_OK)
    assert looked_at == ["01J2", "01J1"] and told == ["01J1"]


# --- wait times: the stored message's timestamp -----------------------------------------------------


def test_a_stored_message_timestamp_is_read_as_unix_seconds() -> None:
    from keyqueue.jetstream.api import stored_seconds

    base = datetime.datetime(2026, 3, 1, 12, 30, 5, tzinfo=datetime.UTC).timestamp()
    assert stored_seconds("2026-03-01T12:30:05Z") == base
    assert stored_seconds("2026-03-01T12:30:05.123456789Z") == pytest.approx(base + 0.123456)
    assert stored_seconds("2026-03-01T12:30:05.5Z") == pytest.approx(base + 0.5)
    assert stored_seconds("2026-03-01T13:30:05.25+01:00") == pytest.approx(base + 0.25)
    assert stored_seconds("") is None
    assert stored_seconds("not a time") is None
