"""The task API without a server: declaration checks, keys, argument and result encoding."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

import keyqueue
from keyqueue.app import application as app_module
from keyqueue.errors import (
    ConfigError,
    DeadLettered,
    InvalidKey,
    MalformedBody,
    RemoteError,
    Superseded,
    UnsupportedVersion,
)
from keyqueue.tasks.arguments import decode_arguments, decode_result, takes_context
from keyqueue.tasks.task import DEFAULT_CALL_TIMEOUT, Dispatcher
from keyqueue.wire import CBOR, dumps, loads
from keyqueue.wire import headers as H


@pytest.fixture
def app() -> keyqueue.App:
    return keyqueue.App("unit", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)


@pytest.fixture
def fresh_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[app_module._Defaults]:
    """A clean default app and shared-task list, so @keyqueue.task tests do not leak."""
    defaults = app_module._Defaults()
    monkeypatch.setattr(app_module, "_DEFAULTS", defaults)
    yield defaults


@dataclass(frozen=True)
class Address:
    city: str
    zip: str


# --- declaring ------------------------------------------------------------------------------------


def test_a_task_has_name_queue_and_policy(app: keyqueue.App) -> None:
    @app.task(key="{order_id}")
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int = 1) -> int:
        return amount

    assert (charge.name, charge.queue, charge.spec.policy) == ("charge", "unit", "serial")
    assert charge.takes_context
    assert list(charge.codec.signature.parameters) == ["order_id", "amount"]
    assert app.find_task("charge") is charge
    assert charge.__name__ == "charge"  # type: ignore[attr-defined]  # set by functools.update_wrapper, untyped
    assert app.queues == ["unit"]


def test_a_task_without_options_may_be_declared_without_parentheses(app: keyqueue.App) -> None:
    """``@app.task``, as Celery users write it, is ``@app.task()``: an unkeyed task with every default."""

    @app.task
    async def send_mail(to: str) -> None:
        pass

    @app.task()
    def resize(path: str) -> None:
        pass

    assert isinstance(send_mail, keyqueue.Task) and app.find_task("send_mail") is send_mail
    assert (send_mail.spec.unkeyed, send_mail.queue, send_mail.spec.max_attempts, send_mail.spec.policy) == (
        resize.spec.unkeyed, resize.queue, resize.spec.max_attempts, resize.spec.policy)
    assert send_mail.spec.unkeyed
    with pytest.raises(TypeError, match=r"app.task takes its options by keyword \(app.task\(key=...\)\)"):
        app.task("{order_id}")  # type: ignore[call-overload]


def test_the_context_parameter_is_found_by_annotation_or_name() -> None:
    def annotated(c: keyqueue.Context, x: int) -> None: ...
    def by_name(ctx, x: int) -> None: ...  # type: ignore[no-untyped-def]
    def without(x: int) -> None: ...
    def string_annotation(c: "Context", x: int) -> None: ...  # type: ignore[name-defined]  # noqa: F821, UP037

    assert takes_context(annotated) and takes_context(by_name) and takes_context(string_annotation)
    assert not takes_context(without)


def test_declaration_mistakes_fail_at_import_time(app: keyqueue.App) -> None:
    with pytest.raises(ConfigError, match="names 'order', which is not one of its parameters"):
        @app.task(key="{order}")
        def a(order_id: str) -> None: ...
    with pytest.raises(ConfigError, match="policy 'fifo' is not one of"):
        @app.task(key="{x}", policy="fifo")  # type: ignore[call-overload, untyped-decorator]
        def b(x: str) -> None: ...
    with pytest.raises(ConfigError, match="needs upgrades for versions"):
        @app.task(key="{x}", version=3, upgrades={1: dict})
        def c(x: str) -> None: ...
    with pytest.raises(ConfigError, match="max_attempts must be at least 1"):
        @app.task(key="{x}", max_attempts=0)
        def d(x: str) -> None: ...
    with pytest.raises(ConfigError, match="queue name"):
        @app.task(key="{x}", queue="no spaces")
        def e(x: str) -> None: ...


def test_task_names_are_unique_within_an_app(app: keyqueue.App) -> None:
    @app.task(key="{x}")
    def same(x: str) -> None: ...

    with pytest.raises(ConfigError, match="already has a task named 'same'"):
        @app.task(key="{x}", queue="other")
        def same(x: str) -> None: ...


def test_a_non_serial_task_needs_its_own_queue(app: keyqueue.App) -> None:
    @app.task(key="{x}")
    def serial(x: str) -> None: ...

    with pytest.raises(ConfigError, match="must be the only task of its queue 'unit'"):
        @app.task(key="{x}", policy="latest")
        def newest(x: str) -> None: ...

    @app.task(key="{x}", policy="latest", queue="prices")
    def newest_elsewhere(x: str) -> None: ...

    assert app.queues == ["prices", "unit"]


def test_a_queue_with_a_processor_takes_no_tasks(app: keyqueue.App) -> None:
    app.register_processor("echo", lambda key: keyqueue.BaseProcessor())
    with pytest.raises(ConfigError, match="has a processor registered"):
        @app.task(key="{x}", queue="echo")
        def x(x: str) -> None: ...


def test_module_level_tasks_belong_to_the_first_app(fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="shared", key="{user}")
    def notify(user: str) -> None: ...

    first = keyqueue.App("first", url="nats://127.0.0.1:1", autoload_plugins=False)
    second = keyqueue.App("second", url="nats://127.0.0.1:1", autoload_plugins=False)
    assert keyqueue.default_app() is first
    assert notify.app is first
    assert first.find_task("notify") is notify
    with pytest.raises(ConfigError, match="has no task 'notify'; its tasks: none"):
        second.find_task("notify")


def test_without_an_app_the_default_app_is_created(fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="shared", key="{user}")
    def notify(user: str) -> None: ...

    assert isinstance(notify.app, keyqueue.App)  # typed as the Dispatcher it sends through
    assert notify.app.name == "default"


def _app(name: str, **options: Any) -> keyqueue.App:
    return keyqueue.App(name, url="nats://127.0.0.1:1", autoload_plugins=False, **options)


def test_a_shared_task_belongs_to_the_app_that_claims_its_queue_not_to_the_first(
        fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="billing", key="{order}")
    def invoice(order: str) -> None: ...

    @keyqueue.task(queue="reports", key="{day}")
    def report(day: str) -> None: ...

    @keyqueue.task(queue="emails", key="{user}")
    def welcome(user: str) -> None: ...

    shop = _app("shop")  # the first app: the default one
    billing = _app("billing")  # claims queue billing by its name
    ops = _app("ops")
    ops.add_queue("reports")  # claims queue reports by declaring it
    assert invoice.app is billing and billing.find_task("invoice") is invoice
    assert report.app is ops and ops.queues == ["reports"]
    assert welcome.app is shop  # no app claims queue emails: the default app takes it
    assert sorted(shop.tasks) == ["welcome"] and shop.queues == ["emails"]
    assert app_module.shared_tasks_elsewhere(shop, "billing") == [(invoice, "app 'billing'")]
    assert app_module.shared_tasks_elsewhere(billing, "billing") == []


def test_an_app_claims_a_queue_with_a_task_of_its_own_there(fresh_defaults: app_module._Defaults) -> None:
    _app("shop")
    backoffice = _app("backoffice")

    @backoffice.task(key="{order}", queue="refunds")
    def refund(order: str) -> None: ...

    @keyqueue.task(queue="refunds", key="{order}")
    def notify_refund(order: str) -> None: ...

    assert notify_refund.app is backoffice
    assert backoffice.queue_tasks("refunds") == {"refund": refund, "notify_refund": notify_refund}


def test_two_apps_claiming_a_shared_tasks_queue_is_an_error_naming_both(
        fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="billing", key="{order}")
    def invoice(order: str) -> None: ...

    first, second, bystander = _app("billing"), _app("billing"), _app("shop")
    for use in (lambda: invoice.app, lambda: first.tasks, lambda: second.queues):
        with pytest.raises(ConfigError, match=r"'invoice' \(queue 'billing'\) could belong to app 'billing' and "
                                              r"app 'billing'.*set_as_default=False"):
            use()
    assert bystander.tasks == {}  # not its queue: another pair's ambiguity is not its error


def test_an_app_created_with_set_as_default_false_takes_no_shared_task(fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="billing", key="{order}")
    def invoice(order: str) -> None: ...

    shop = _app("shop")
    billing = _app("billing", set_as_default=False)
    assert invoice.app is shop and "invoice" not in billing.tasks
    # What a worker of billing serving queue billing warns of (keyqueue.app.worker).
    assert app_module.shared_tasks_elsewhere(billing, "billing") == [(invoice, "app 'shop'")]


# --- the dispatcher -------------------------------------------------------------------------------

T = TypeVar("T")


class RecordingDispatcher:
    """A ``Dispatcher`` without an app: records what tasks send, answers ``ask`` with ``reply``."""

    def __init__(self, reply: Any = None) -> None:
        self.reply = reply
        self.published: list[keyqueue.TaskRequest] = []
        self.asked: list[tuple[keyqueue.TaskRequest, float]] = []
        self.synced = 0

    async def publish(self, requests: Sequence[keyqueue.TaskRequest]) -> list[keyqueue.Receipt]:
        start = len(self.published) + 1
        self.published.extend(requests)
        return [keyqueue.Receipt(r.request_id, r.key, seq, False, r.queue, r.message_type)
                for seq, r in enumerate(requests, start)]

    async def ask(self, request: keyqueue.TaskRequest, timeout: float) -> tuple[Mapping[str, str], bytes]:
        self.asked.append((request, timeout))
        return {H.STATUS: H.STATUS_OK, H.CONTENT_TYPE: CBOR}, dumps(self.reply, CBOR)

    def run_sync(self, make: Callable[[], Awaitable[T]], **_: Any) -> T:
        self.synced += 1

        async def run() -> T:
            return await make()

        return asyncio.run(run())


def charge_task(dispatcher: Callable[[], Dispatcher]) -> keyqueue.Task[Any]:
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, int]: ...  # type: ignore[empty-body]

    return keyqueue.Task(charge, keyqueue.TaskSpec("charge", "shop"), "{order_id}", dispatcher)


async def test_a_task_sends_and_asks_through_its_dispatcher() -> None:
    dispatcher = RecordingDispatcher(reply={"charged": 5})
    charge = charge_task(lambda: dispatcher)

    receipt = await charge.enqueue(order_id="o1", amount=5)
    assert await charge.call("o2", 5) == {"charged": 5}
    assert await charge.options(timeout=3).call(order_id="o3", amount=5) == {"charged": 5}
    receipts = await charge.enqueue_many([{"order_id": "o4", "amount": 1}, {"order_id": "o4", "amount": 2}])

    assert charge.app is dispatcher
    assert [(r.key, dict(r.arguments)) for r in dispatcher.published] == [
        ("o1", {"order_id": "o1", "amount": 5}), ("o4", {"order_id": "o4", "amount": 1}),
        ("o4", {"order_id": "o4", "amount": 2}),
    ]
    assert (receipt.request_id, [r.seq for r in receipts]) == (dispatcher.published[0].request_id, [2, 3])
    assert [(r.key, r.message_type, timeout) for r, timeout in dispatcher.asked] == [
        ("o2", "charge", DEFAULT_CALL_TIMEOUT), ("o3", "charge", 3),
    ]


def test_delay_runs_the_enqueue_through_the_dispatchers_sync_form() -> None:
    dispatcher = RecordingDispatcher()
    charge = charge_task(lambda: dispatcher)

    receipt = charge.delay(order_id="o1", amount=5)

    assert dispatcher.synced == 1
    assert [r.request_id for r in dispatcher.published] == [receipt.request_id]


async def test_the_dispatcher_is_looked_up_each_time_the_task_is_used() -> None:
    first, second = RecordingDispatcher(), RecordingDispatcher()
    current: list[Dispatcher] = [first]
    charge = charge_task(lambda: current[0])

    await charge.enqueue(order_id="o1", amount=1)
    current[0] = second
    await charge.enqueue(order_id="o2", amount=2)

    assert [r.key for r in first.published] == ["o1"]
    assert [r.key for r in second.published] == ["o2"]


# --- keys and arguments ---------------------------------------------------------------------------


def test_keys_come_from_a_template_or_a_function(app: keyqueue.App) -> None:
    @app.task(key="{user}.{doc}")
    def edit(user: str, doc: str, text: str = "") -> None: ...

    @app.task(key=lambda sku, price: sku.lower())
    def reprice(sku: str, price: int) -> None: ...

    @app.task(key="{address.city}")
    def ship(address: Address) -> None: ...

    assert edit.fields_for(("u1",), {"doc": "d9"}) == ("u1.d9", {"user": "u1", "doc": "d9", "text": ""})
    assert reprice.fields_for(("ABC", 3), {})[0] == "abc"
    key, fields = ship.fields_for((Address("Oslo", "0150"),), {})
    assert (key, fields) == ("Oslo", {"address": {"city": "Oslo", "zip": "0150"}})


def test_a_bad_key_value_is_an_invalid_key(app: keyqueue.App) -> None:
    @app.task(key="{name}")
    def greet(name: str) -> None: ...

    with pytest.raises(InvalidKey, match="contains ' '"):
        greet.fields_for(("two words",), {})
    with pytest.raises(InvalidKey, match="empty"):
        greet.fields_for(("",), {})


def test_arguments_are_bound_like_a_call(app: keyqueue.App) -> None:
    @app.task(key="{a}")
    def f(a: str, b: int = 2, *, c: bool = False) -> None: ...

    assert f.fields_for(("x",), {"c": True}) == ("x", {"a": "x", "b": 2, "c": True})
    with pytest.raises(TypeError, match=r"f\(\): missing a required argument: 'a'"):
        f.fields_for((), {})
    with pytest.raises(TypeError, match="unexpected keyword argument 'd'"):
        f.fields_for(("x",), {"d": 1})


def test_non_plain_arguments_are_refused_naming_the_argument(app: keyqueue.App) -> None:
    @app.task(key="{a}")
    def f(a: str, when: Any) -> None: ...

    with pytest.raises(MalformedBody, match=r"f: argument 'when'\[0\]: set is not a plain value"):
        f.fields_for(("x", [{1}]), {})


def test_the_worker_rebuilds_the_call_from_the_body(app: keyqueue.App) -> None:
    @app.task(key="{a}")
    def f(a: str, /, address: Address, *rest: int, flag: bool = False, **extra: str) -> None: ...

    _, fields = f.fields_for(("x", Address("Oslo", "0150"), 1, 2), {"flag": True, "note": "n"})
    args, kwargs = f.codec.to_call(loads(dumps(fields, CBOR), CBOR))
    assert args == ["x", Address("Oslo", "0150"), 1, 2]
    assert kwargs == {"flag": True, "note": "n"}
    with pytest.raises(MalformedBody, match="unexpected argument"):
        f.codec.to_call({**fields, "zzz": 1})
    with pytest.raises(MalformedBody, match="do not fit its signature"):
        f.codec.to_call({"address": {"city": "c", "zip": "z"}})


def test_old_versions_are_upgraded_and_newer_ones_refused() -> None:
    upgrades = {1: lambda a: {**a, "currency": "EUR"}, 2: lambda a: {**a, "amount": a["amount"] * 100}}
    headers = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: "charge", H.MESSAGE_VERSION: "1", H.MSG_ID: "r1"}
    body = dumps({"amount": 5}, CBOR)
    assert decode_arguments("charge", 3, upgrades, headers, body) == {"amount": 500, "currency": "EUR"}
    with pytest.raises(UnsupportedVersion, match="charge version 4 is not supported"):
        decode_arguments("charge", 3, upgrades, {**headers, H.MESSAGE_VERSION: "4"}, body)
    with pytest.raises(MalformedBody, match="upgrading version 1 to 2 failed: KeyError"):
        decode_arguments("charge", 2, {1: lambda a: {"x": a["missing"]}}, headers, body)


def test_replies_become_results_or_typed_errors() -> None:
    ok = {H.STATUS: H.STATUS_OK, H.CONTENT_TYPE: CBOR}
    assert decode_result(ok, dumps({"a": 1}, CBOR), "r") == {"a": 1}
    assert decode_result(ok, dumps({"city": "c", "zip": "z"}, CBOR), "r", Address) == Address("c", "z")
    assert decode_result(ok, b"", "r") is None
    with pytest.raises(Superseded) as superseded:
        decode_result({H.STATUS: H.STATUS_SUPERSEDED, H.SUPERSEDED_BY: "r9"}, b"", "r1")
    assert (superseded.value.request_id, superseded.value.by) == ("r1", "r9")
    dead = {H.STATUS: H.STATUS_DEAD_LETTERED, H.ERROR_TYPE: "ValueError", H.ERROR_MESSAGE: "bad amount"}
    with pytest.raises(DeadLettered) as dead_lettered:
        decode_result(dead, b"", "r1")
    assert (dead_lettered.value.type_name, dead_lettered.value.message) == ("ValueError", "bad amount")
    with pytest.raises(RemoteError, match="MalformedBody: result"):
        decode_result({H.STATUS: H.STATUS_ERROR, H.ERROR_TYPE: "MalformedBody", H.ERROR_MESSAGE: "result"}, b"", "r")


# --- sync forms -----------------------------------------------------------------------------------


async def test_delay_is_refused_inside_a_running_loop(app: keyqueue.App) -> None:
    @app.task(key="{x}")
    def f(x: str) -> None: ...

    with pytest.raises(ConfigError, match="in async code, await the async form"):
        f.delay(x="a")


async def test_an_unreachable_server_is_a_clear_error(app: keyqueue.App) -> None:
    @app.task(key="{x}")
    def f(x: str) -> None: ...

    with pytest.raises(keyqueue.ConnectionFailed, match=r"cannot reach NATS at nats://127\.0\.0\.1:1"):
        await asyncio.wait_for(f.enqueue(x="a"), 10)


# --- timeout= on every call -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    sensor: str
    value: int


async def test_every_call_takes_a_timeout() -> None:
    dispatcher = RecordingDispatcher(reply=1)
    charge = charge_task(lambda: dispatcher)

    async def ingest(readings: list[Reading]) -> list[int]: ...  # type: ignore[empty-body]

    batch: keyqueue.BatchTask[Reading, int] = keyqueue.BatchTask(
        ingest, keyqueue.TaskSpec("ingest", "readings", policy="batch"), "{sensor}", lambda: dispatcher)

    await charge.call(order_id="o1", amount=5, timeout=4)
    await charge.options(request_id="r2").call(order_id="o2", amount=5, timeout=5)
    await charge.options(timeout=9).call(order_id="o3", amount=5, timeout=6)  # the call's own wins
    assert await batch.call(Reading("s1", 1), timeout=7) == 1
    await batch.options(request_id="r5").call(Reading("s2", 1), timeout=8)
    await batch.options(timeout=2).call(Reading("s3", 1))
    await batch.call(Reading("s4", 1))

    assert [(r.key, timeout) for r, timeout in dispatcher.asked] == [
        ("o1", 4), ("o2", 5), ("o3", 6), ("s1", 7), ("s2", 8), ("s3", 2), ("s4", DEFAULT_CALL_TIMEOUT)]
    assert [dict(r.arguments) for r, _ in dispatcher.asked][:3] == [
        {"order_id": f"o{n}", "amount": 5} for n in (1, 2, 3)]
    assert dispatcher.asked[1][0].request_id == "r2"


async def test_a_parameter_named_timeout_is_the_functions() -> None:
    dispatcher = RecordingDispatcher()

    async def wait(name: str, timeout: float) -> None: ...

    task = keyqueue.Task(wait, keyqueue.TaskSpec("wait", "shop"), "{name}", lambda: dispatcher)
    await task.call(name="n", timeout=3)
    await task.options(timeout=9).call(name="n", timeout=3)
    assert [(dict(r.arguments), timeout) for r, timeout in dispatcher.asked] == [
        ({"name": "n", "timeout": 3}, DEFAULT_CALL_TIMEOUT), ({"name": "n", "timeout": 3}, 9)]


# --- argument types, checked at enqueue -----------------------------------------------------------


async def test_arguments_that_do_not_fit_their_annotations_are_refused_at_enqueue() -> None:
    dispatcher = RecordingDispatcher()

    async def charge(ctx: keyqueue.Context, order_id: str, amount: int, rate: float = 1.0,
                     note: str | None = None, tags: list[str] | None = None, limits: dict[str, int] | None = None,
                     address: Address = Address("", ""), raw: bytes = b"", *extra: int, **meta: bool) -> None: ...

    task = keyqueue.Task(charge, keyqueue.TaskSpec("charge", "shop"), "{order_id}", lambda: dispatcher)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"amount": "ten"}, "argument 'amount' must be int, not str"),
        ({"amount": True}, "argument 'amount' must be int, not bool"),
        ({"amount": 1.5}, "argument 'amount' must be int, not float"),
        ({"rate": "1"}, "argument 'rate' must be float, not str"),
        ({"rate": False}, "argument 'rate' must be float, not bool"),
        ({"note": 3}, "argument 'note' must be str | None, not int"),
        ({"tags": "a,b"}, "argument 'tags' must be list[str] | None, not str"),
        ({"tags": ["a", 2]}, "argument 'tags'[1] must be str, not int"),
        ({"limits": {"a": "1"}}, "argument 'limits'['a'] must be int, not str"),
        ({"address": "Oslo"}, "argument 'address' must be Address (or a map of its fields), not str"),
        ({"raw": "text"}, "argument 'raw' must be bytes, not str"),
        ({"order_id": 7}, "argument 'order_id' must be str, not int"),
        ({"flag": 1}, "argument 'meta'['flag'] must be bool, not int"),
    ]
    for given, message in refused:
        with pytest.raises(TypeError) as error:
            await task.enqueue(**{"order_id": "o1", "amount": 1, **given})
        assert str(error.value) == f"charge(): {message}", given
    with pytest.raises(TypeError, match=r"^charge\(\): argument 'extra'\[1\] must be int, not str$"):
        await task.enqueue("o1", 1, 1.0, None, None, None, Address("", ""), b"", 1, "2")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^item 1: charge\(\): argument 'amount' must be int, not str$"):
        await task.enqueue_many([{"order_id": "o1", "amount": 1}, {"order_id": "o1", "amount": "1"}])
    assert dispatcher.published == []

    # A tuple for a list and a map of its fields for a dataclass: taken at run time, not by the types.
    await task.enqueue(order_id="o1", amount=1, rate=2, note=None, tags=("a", "b"),  # type: ignore[call-overload]
                       limits={"a": 1}, address={"city": "Oslo", "zip": "0150"}, flag=True)
    await task.enqueue(order_id="o2", amount=1, address=Address("Oslo", "0150"), raw=b"\x00")
    assert len(dispatcher.published) == 2


async def test_unannotated_or_complex_annotations_and_defaults_are_not_checked() -> None:
    dispatcher = RecordingDispatcher()

    async def loose(key, anything: Any, seq: Sequence[int], pick: int | Sequence[int],  # type: ignore[no-untyped-def]
                    n: int = "default") -> None: ...  # type: ignore[assignment]

    task = keyqueue.Task(loose, keyqueue.TaskSpec("loose", "shop"), "{key}", lambda: dispatcher)
    await task.enqueue(key="k", anything={"a": [1]}, seq=["x"], pick="y")  # type: ignore[list-item, arg-type]
    assert dict(dispatcher.published[0].arguments) == {
        "key": "k", "anything": {"a": [1]}, "seq": ["x"], "pick": "y", "n": "default"}


async def test_a_batch_item_is_checked_against_the_lists_item_type() -> None:
    dispatcher = RecordingDispatcher()

    async def ingest(readings: list[Reading]) -> None: ...
    async def count(values: list[int]) -> None: ...

    readings: keyqueue.BatchTask[Reading, None] = keyqueue.BatchTask(
        ingest, keyqueue.TaskSpec("ingest", "readings", policy="batch"), "{sensor}", lambda: dispatcher)
    counts: keyqueue.BatchTask[int, None] = keyqueue.BatchTask(
        count, keyqueue.TaskSpec("count", "counts", policy="batch"), "all", lambda: dispatcher)
    with pytest.raises(TypeError, match=r"^ingest\(\): item must be Reading \(or a map of its fields\), not str$"):
        await readings.enqueue("s1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^item 1: count\(\): item must be int, not str$"):
        await counts.enqueue_many([1, "2"])  # type: ignore[list-item]
    await readings.enqueue({"sensor": "s1", "value": 1})  # type: ignore[arg-type]  # a map of its fields: taken
    await counts.enqueue_many([1, 2])
    assert len(dispatcher.published) == 3
