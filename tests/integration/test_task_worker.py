"""The task API against a real nats-server: a worker in this process, policies, hooks, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

import keyqueue
from keyqueue.admin.dead_letters import dead_letters
from keyqueue.builtins.processor import DECODE_OFF_LOOP_BYTES
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, dumps, loads
from keyqueue.wire import headers as H

MakeApp = Callable[..., keyqueue.App]


@pytest.fixture
async def make_app(nats_url: str) -> AsyncIterator[MakeApp]:
    apps: list[keyqueue.App] = []

    def make(name: str = "shop", **options: Any) -> keyqueue.App:
        app = keyqueue.App(name, url=nats_url, set_as_default=False, autoload_plugins=False, **options)
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.close()


async def stored(app: keyqueue.App, queue: str, count: int) -> None:
    """Wait until ``queue``'s inbox holds ``count`` requests (they are enqueued from tasks)."""
    api = JetStreamApi(await app.connection())
    async with asyncio.timeout(10):
        while True:
            with contextlib.suppress(keyqueue.StreamNotFound):
                info = await api.stream_info(QueueNames(queue).inbox_stream)
                if info["state"]["messages"] >= count:
                    return
            await asyncio.sleep(0.01)


async def test_enqueue_call_and_typed_remote_errors(make_app: MakeApp) -> None:
    app = make_app()
    order: list[tuple[str, int]] = []

    @app.task(key="{order_id}", max_attempts=2, backoff=0.01)
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, Any]:
        if amount < 0:
            raise ValueError(f"negative amount {amount}")
        if amount == 0:
            raise keyqueue.Reject("zero is not an amount")
        order.append((order_id, amount))
        return {"order_id": order_id, "charged": amount, "fencing": list(ctx.fencing)}

    @app.task(key="{order_id}")
    def refund(order_id: str) -> str:
        return f"refunded {order_id}"

    async with app.worker(concurrency=4):
        receipt = await charge.enqueue(order_id="o1", amount=1)
        assert (receipt.key, receipt.duplicate, receipt.queue, receipt.task) == ("o1", False, "shop", "charge")
        result = await charge.call(order_id="o1", amount=2, timeout=10)
        assert result["charged"] == 2 and result["fencing"][0] >= 1
        assert await refund.call(order_id="o2") == "refunded o2"
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await charge.call(order_id="o3", amount=-5)
        assert (dead.value.type_name, dead.value.message) == ("ValueError", "negative amount -5")
        with pytest.raises(keyqueue.DeadLettered, match="Reject: zero is not an amount"):
            await charge.call(order_id="o3", amount=0)
        items = [{"order_id": f"k{i % 2}", "amount": i} for i in range(1, 21)]
        receipts = await charge.enqueue_many(items)
        assert [r.seq for r in receipts] == sorted(r.seq for r in receipts)
        assert await charge.call(order_id="k0", amount=100) is not None  # after the batch, in order
    for key in ("k0", "k1"):
        amounts = [a for k, a in order if k == key]
        assert amounts[:-1] == sorted(amounts[:-1]) and len(amounts) == 10 + (key == "k0")


async def test_bad_requests_are_dead_lettered_with_their_reason_and_never_block_the_key(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{x}")
    async def echo(x: str) -> str:
        return x

    nc = await app.connection()
    await echo.enqueue(x="k")  # creates the queue's streams
    publisher = Publisher(nc, QueueNames("shop"))
    base = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: "echo", H.MESSAGE_VERSION: "1"}
    bad = [
        ({**base, H.MESSAGE_TYPE: "ehco"}, dumps({"x": "k"}, CBOR)),
        ({**base, H.MESSAGE_VERSION: "9"}, dumps({"x": "k"}, CBOR)),
        (base, b"\xff\x00not cbor"),
        (base, dumps({"y": "k"}, CBOR)),
    ]
    for index, (headers, body) in enumerate(bad):
        await publisher.enqueue(OutgoingRequest("k", {**headers, H.MSG_ID: f"bad{index}"}, body, f"bad{index}"))
    async with app.worker():
        assert await echo.call(x="k") == "k"  # behind the four bad ones on the same key
    letters = [await JetStreamApi(nc).get_msg("KQ_shop_DLQ", seq=seq, direct=False) for seq in range(1, 5)]
    assert [m.headers[H.DLQ_ERROR_TYPE] for m in letters if m] == [
        "UnknownMessageType", "UnsupportedVersion", "MalformedBody", "MalformedBody"]
    assert all(m is not None and m.headers[H.DLQ_REASON] == "rejected" for m in letters)
    assert letters[0] is not None and "registered types: echo" in letters[0].headers[H.ERROR_MESSAGE]
    assert letters[3] is not None and "unexpected argument(s) y" in letters[3].headers[H.ERROR_MESSAGE]


@dataclass(frozen=True)
class Reading:
    sensor: str
    value: int


async def test_batch_takes_every_available_request_in_one_call(make_app: MakeApp) -> None:
    app = make_app()
    calls: list[list[int]] = []
    events: list[str] = []

    class Events:
        @keyqueue.hookimpl
        def keyqueue_request_started(self, request_id: str) -> None:
            events.append("started")

        @keyqueue.hookimpl
        def keyqueue_request_succeeded(self, message_type: str) -> None:
            events.append(f"succeeded:{message_type}")

    app = make_app("batching", plugins=[Events()])

    @app.task(key="{sensor}", policy="batch", max_batch=50)
    async def ingest(ctx: keyqueue.Context, readings: list[Reading]) -> list[int]:
        assert len(ctx.request_ids) == len(readings)
        calls.append([r.value for r in readings])
        return [r.value * 10 for r in readings]

    callers = [asyncio.create_task(ingest.call(Reading("t1", v))) for v in range(5)]
    await stored(app, "batching", 5)
    async with app.worker() as worker:
        results = await asyncio.gather(*callers)
    assert len(calls) == 1 and sorted(calls[0]) == [0, 1, 2, 3, 4]  # concurrent callers: any order
    assert results == [0, 10, 20, 30, 40]  # each caller gets its own item's result
    assert events == ["started"] + ["succeeded:ingest"] * 5
    assert worker.queue_workers["batching"].counts["started"] == 1
    assert await requests_waiting(JetStreamApi(await app.connection()), QueueNames("batching")) == 0


async def test_latest_runs_the_newest_and_tells_the_others_who_replaced_them(make_app: MakeApp) -> None:
    superseded: list[tuple[str, str]] = []

    class Watcher:
        @keyqueue.hookimpl
        def keyqueue_request_superseded(self, request_id: str, superseded_by: str) -> None:
            superseded.append((request_id, superseded_by))

    app = make_app("prices", plugins=[Watcher()])
    ran: list[int] = []

    @app.task(key="{sku}", policy="latest")
    async def reprice(sku: str, price: int) -> int:
        ran.append(price)
        return price

    callers = []
    for n in range(4):  # one at a time, so the inbox order is p0, p1, p2, p3
        callers.append(asyncio.create_task(reprice.options(request_id=f"p{n}").call(sku="s1", price=n)))
        await stored(app, "prices", n + 1)
    async with app.worker():
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert ran == [3]
    assert outcomes[3] == 3
    for n, outcome in enumerate(outcomes[:3]):
        assert isinstance(outcome, keyqueue.Superseded)
        assert (outcome.request_id, outcome.by) == (f"p{n}", "p3")
    assert superseded == [("p0", "p3"), ("p1", "p3"), ("p2", "p3")]


async def test_merge_folds_the_pending_requests_through_the_hook(make_app: MakeApp) -> None:
    class Union:
        @keyqueue.hookimpl
        def keyqueue_merge_arguments(self, task: keyqueue.TaskSpec, arguments: Sequence[dict[str, Any]]) -> Any:
            return {"doc": arguments[-1]["doc"], "ids": sorted({i for a in arguments for i in a["ids"]})}

    app = make_app("index", plugins=[Union()])
    runs: list[list[int]] = []

    @app.task(key="{doc}", policy="merge")
    async def reindex(doc: str, ids: list[int]) -> int:
        runs.append(ids)
        return len(ids)

    callers = [asyncio.create_task(reindex.call(doc="d", ids=ids)) for ids in ([3, 1], [2], [1, 4])]
    await stored(app, "index", 3)
    async with app.worker():
        assert await asyncio.gather(*callers) == [4, 4, 4]
    assert runs == [[1, 2, 3, 4]]


async def store_raw(app: keyqueue.App, queue: str, key: str, request_id: str, body: bytes,
                    message_type: str, version: str = "1") -> None:
    """Store a request as another producer might have written it (maybe one no worker can read)."""
    headers = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: message_type, H.MESSAGE_VERSION: version, H.MSG_ID: request_id}
    await Publisher(await app.connection(), QueueNames(queue)).enqueue(OutgoingRequest(key, headers, body, request_id))


async def dead_letter_errors(app: keyqueue.App, queue: str) -> list[tuple[str, str, str]]:
    letters = await dead_letters(JetStreamApi(await app.connection()), queue)
    return [(d.request_id, d.reason, d.error_type) for d in letters]


async def test_a_batch_request_that_cannot_be_read_is_dead_lettered_alone_and_the_rest_run(
    make_app: MakeApp,
) -> None:
    app = make_app("batching")
    calls: list[list[int]] = []

    @app.task(key="{sensor}", policy="batch", max_batch=50)
    async def ingest(readings: list[Reading]) -> list[int]:
        calls.append([r.value for r in readings])
        return [r.value * 10 for r in readings]

    first = asyncio.create_task(ingest.call(Reading("t1", 1)))
    await stored(app, "batching", 1)
    await store_raw(app, "batching", "t1", "bad-cbor", b"\xff\x00not cbor", "ingest")
    await store_raw(app, "batching", "t1", "unknown", dumps({"item": {"sensor": "t1", "value": 7}}, CBOR), "ingets")
    await store_raw(app, "batching", "t1", "newer", dumps({"item": {"sensor": "t1", "value": 8}}, CBOR), "ingest",
                    version="9")
    second = asyncio.create_task(ingest.call(Reading("t1", 2)))
    await stored(app, "batching", 5)
    async with app.worker():
        assert await asyncio.gather(first, second) == [10, 20]
    assert calls == [[1, 2]]
    assert await dead_letter_errors(app, "batching") == [
        ("bad-cbor", "rejected", "MalformedBody"), ("unknown", "rejected", "UnknownMessageType"),
        ("newer", "rejected", "UnsupportedVersion")]


async def test_latest_skips_a_newest_request_that_cannot_be_read_and_runs_the_newest_good_one(
    make_app: MakeApp,
) -> None:
    app = make_app("prices")
    ran: list[int] = []

    @app.task(key="{sku}", policy="latest")
    async def reprice(sku: str, price: int) -> int:
        ran.append(price)
        return price

    callers = []
    for n in range(2):
        callers.append(asyncio.create_task(reprice.options(request_id=f"p{n}").call(sku="s1", price=n)))
        await stored(app, "prices", n + 1)
    await store_raw(app, "prices", "s1", "p2", dumps({"sku": "s1", "price": 2}, CBOR), "reprice", version="2")
    await store_raw(app, "prices", "s1", "p3", dumps({"sku": "s1", "prize": 3}, CBOR), "reprice")
    async with app.worker():
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert ran == [1]
    assert isinstance(outcomes[0], keyqueue.Superseded) and outcomes[0].by == "p1"
    assert outcomes[1] == 1
    assert await dead_letter_errors(app, "prices") == [("p2", "rejected", "UnsupportedVersion"),
                                                        ("p3", "rejected", "MalformedBody")]


async def test_merge_folds_the_readable_requests_and_dead_letters_the_others_alone(make_app: MakeApp) -> None:
    app = make_app("index")
    runs: list[list[int]] = []

    def union(arguments: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"doc": arguments[-1]["doc"], "ids": sorted({i for a in arguments for i in a["ids"]})}

    @app.task(key="{doc}", policy="merge", merge=union)
    async def reindex(doc: str, ids: list[int]) -> int:
        runs.append(ids)
        return len(ids)

    first = asyncio.create_task(reindex.call(doc="d", ids=[3, 1]))
    await stored(app, "index", 1)
    await store_raw(app, "index", "d", "extra", dumps({"doc": "d", "ids": [9], "force": True}, CBOR), "reindex")
    await store_raw(app, "index", "d", "garbled", b"\xa1", "reindex")
    second = asyncio.create_task(reindex.call(doc="d", ids=[2]))
    await stored(app, "index", 4)
    async with app.worker():
        assert await asyncio.gather(first, second) == [3, 3]
    assert runs == [[1, 2, 3]]
    assert await dead_letter_errors(app, "index") == [("extra", "rejected", "MalformedBody"),
                                                       ("garbled", "rejected", "MalformedBody")]


async def test_a_large_body_is_decoded_off_the_event_loop(make_app: MakeApp) -> None:
    app = make_app()
    loop = asyncio.get_running_loop()
    decoded_in: dict[int, threading.Thread] = {}

    async def alive() -> str:
        return "alive"

    def upgrade(fields: dict[str, Any]) -> dict[str, Any]:
        # Runs inside the decode. It needs the event loop: if the decode blocked it, this would time out.
        decoded_in[len(fields["blob"])] = threading.current_thread()
        if len(fields["blob"]) > DECODE_OFF_LOOP_BYTES:
            assert asyncio.run_coroutine_threadsafe(alive(), loop).result(timeout=10) == "alive"
        return {**fields, "size": len(fields["blob"])}

    @app.task(key="{k}", version=2, upgrades={1: upgrade})
    async def load(k: str, blob: list[int], size: int) -> int:
        return size

    await load.enqueue(k="warm-up", blob=[], size=0)  # creates the queue's streams
    big = [i % 100 for i in range(DECODE_OFF_LOOP_BYTES + 1)]
    for blob in (big, [1, 2, 3]):
        await store_raw(app, "shop", "k", f"v1-{len(blob)}", dumps({"k": "k", "blob": blob}, CBOR), "load")
    async with app.worker():
        assert await load.call(k="k", blob=[], size=0) == 0  # behind both on the same key
    assert decoded_in[len(big)] is not threading.main_thread()
    assert decoded_in[3] is threading.main_thread()  # small bodies skip the thread hop
    assert await dead_letter_errors(app, "shop") == []


async def test_hooks_nest_in_order_and_a_failing_hook_does_not_stop_the_worker(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    log: list[str] = []

    class Plugin:
        def __init__(self, name: str) -> None:
            self.name = name

        @keyqueue.hookimpl
        def keyqueue_worker_started(self) -> None:
            log.append(f"{self.name}:worker_started")

        @keyqueue.hookimpl
        async def keyqueue_key_acquired(self, key: str, fencing: tuple[int, int]) -> None:
            log.append(f"{self.name}:acquired:{key}")

        @keyqueue.hookimpl
        def keyqueue_request_succeeded(self, message_type: str) -> None:
            log.append(f"{self.name}:succeeded:{message_type}")

        @keyqueue.hookimpl
        def keyqueue_key_released(self, key: str, outcome: str) -> None:
            log.append(f"{self.name}:released:{outcome}")

        @keyqueue.hookimpl
        def keyqueue_worker_stopping(self) -> None:
            log.append(f"{self.name}:worker_stopping")

    class Broken:
        @keyqueue.hookimpl
        def keyqueue_key_acquired(self) -> None:
            raise RuntimeError("broken plugin")

        @keyqueue.hookimpl
        def keyqueue_request_succeeded(self) -> None:
            raise RuntimeError("broken plugin")

    class Tracing:
        @keyqueue.hookimpl
        def keyqueue_wrap_enqueue(self, request: keyqueue.TaskRequest) -> Any:
            @contextlib.contextmanager
            def span() -> Iterator[None]:
                request.headers[H.TRACEPARENT] = f"00-{'a' * 32}-{'b' * 16}-01"
                yield
                log.append(f"enqueued:{request.receipt.seq if request.receipt else None}")

            return span()

        @keyqueue.hookimpl
        def keyqueue_wrap_process(self, requests: Sequence[keyqueue.Request]) -> Any:
            @contextlib.contextmanager
            def span() -> Iterator[None]:
                log.append(f"process:{requests[0].headers.get(H.TRACEPARENT, '')[:5]}")
                yield

            return span()

    app = make_app(plugins=[Plugin("A"), Broken(), Plugin("B"), Tracing()])

    @app.task(key="{x}")
    async def echo(x: str) -> str:
        return x

    with caplog.at_level(logging.ERROR, logger="keyqueue.plugins"):
        async with app.worker():
            assert await echo.call(x="k") == "k"
            assert await echo.call(x="k") == "k"  # the worker carries on after the broken hooks
    assert log[:2] == ["B:worker_started", "A:worker_started"]
    assert log[-2:] == ["A:worker_stopping", "B:worker_stopping"]
    assert "enqueued:1" in log and "process:00-aa" in log
    middle = [entry for entry in log if entry.startswith(("A:", "B:"))][2:-2]
    assert middle[:2] == ["B:acquired:k", "A:acquired:k"]
    assert middle[2:4] == ["A:succeeded:echo", "B:succeeded:echo"]
    assert middle[-2:] == ["A:released:released", "B:released:released"]
    assert caplog.text.count("RuntimeError: broken plugin") >= 3


async def test_sync_tasks_run_in_threads_with_progress_and_delay_works_from_threads(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{job}")
    def crunch(ctx: keyqueue.Context, job: str, n: int) -> int:
        for step in range(n):
            ctx.progress_sync({"step": step})
        return n

    nc = await app.connection()
    progress = await nc.subscribe(QueueNames("shop").progress("j1"))
    async with app.worker():
        assert await crunch.call(job="j1", n=3) == 3
        receipt = await asyncio.to_thread(crunch.delay, job="j2", n=1)
        assert receipt.key == "j2"
    steps = [loads((await progress.next_msg(timeout=5)).data, CBOR) for _ in range(3)]
    assert steps == [{"step": 0}, {"step": 1}, {"step": 2}]


async def test_a_timed_out_attempt_fails_like_any_error(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{x}", timeout=0.1, max_attempts=1)
    async def slow(x: str) -> None:
        await asyncio.sleep(30)

    async with app.worker():
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await slow.call(x="a")
    assert dead.value.type_name == "KeyqueueTimeout"
    assert "exceeded its timeout of 0.1s" in dead.value.message


async def test_the_pinned_client_hook_fires(make_app: MakeApp) -> None:
    pins: list[tuple[str, str]] = []
    pinned = asyncio.Event()

    class Pins:
        @keyqueue.hookimpl
        def keyqueue_worker_pinned(self, queue: str, pin_id: str) -> None:
            pins.append((queue, pin_id))
            pinned.set()

    app = make_app("pinned", plugins=[Pins()])
    app.configure_queue(keyqueue.QueueConfig("pinned", priority_policy="pinned_client"))

    @app.task(key="{x}")
    async def echo(x: str) -> str:
        return x

    async with app.worker():
        assert await echo.call(x="a") == "a"
        await asyncio.wait_for(pinned.wait(), 10)
    assert pins[0][0] == "pinned" and pins[0][1]


async def test_a_worker_that_cannot_start_raises_why(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{x}")
    async def echo(x: str) -> str:
        return x

    nc = await app.connection()
    # A stream of the queue's name that keyqueue did not make: a layout no command changes in place.
    await JetStreamApi(nc).add_stream({"name": QueueNames(echo.queue).inbox_stream,
                                       "subjects": [f"elsewhere.{echo.queue}.>"], "storage": "memory"})
    with pytest.raises(keyqueue.TopologyMismatch, match="subjects"):
        async with app.worker():
            pass
    with pytest.raises(keyqueue.ConfigError, match="no tasks or processors for queue"):
        async with app.worker(queues=["nope"]):
            pass


# --- a task calling a task on the key its own run holds: CallOnOwnKey, never a wait ----------------


async def inbox_last_seq(app: keyqueue.App, queue: str) -> int:
    """How many requests ``queue``'s inbox has ever stored."""
    info = await JetStreamApi(await app.connection()).stream_info(QueueNames(queue).inbox_stream)
    last_seq: int = info["state"]["last_seq"]
    return last_seq


async def test_a_call_on_the_key_the_task_holds_fails_at_once_and_dead_letters_its_request(
    make_app: MakeApp,
) -> None:
    app = make_app()

    @app.task(key="{order_id}", max_attempts=3, backoff=0.01)
    async def charge(order_id: str, amount: int) -> int:
        result: int = await charge.call(order_id=order_id, amount=amount, timeout=60)  # its own key
        return result

    @app.task(key="{order_id}", max_attempts=3, backoff=0.01)
    def refund(order_id: str) -> str:
        # A sync task reaches the loop through run_sync; another task on the same queue and key.
        return app.run_sync(lambda: charge.call(order_id=order_id, amount=1))

    async with app.worker():
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await charge.call(order_id="o1", amount=5, timeout=20)
        assert (dead.value.type_name, dead.value.reason) == ("CallOnOwnKey", "rejected")
        assert dead.value.message == (
            "charge called charge on key 'o1' of queue 'shop', which its own run holds: that request cannot "
            "start before this run ends; enqueue it instead (charge.enqueue(...) runs after this one), or call "
            "a task on another key")
        with pytest.raises(keyqueue.DeadLettered, match="CallOnOwnKey: refund called charge on key 'o2'"):
            await refund.call(order_id="o2", timeout=20)
    assert await inbox_last_seq(app, "shop") == 2  # the two outer requests: no inner one, no retry stored one
    letters = await dead_letters(JetStreamApi(await app.connection()), "shop")
    assert [(d.key, d.error_type, d.attempts) for d in letters] == [("o1", "CallOnOwnKey", 1),
                                                                     ("o2", "CallOnOwnKey", 1)]


async def test_a_task_may_call_other_keys_and_queues_and_enqueue_on_its_own_key(make_app: MakeApp) -> None:
    app = make_app()
    ran: list[str] = []

    @app.task(key="{order_id}")
    async def ship(order_id: str, step: str) -> str:
        ran.append(f"{order_id}:{step}")
        if step == "start":
            await ship.enqueue(order_id=order_id, step="after")  # runs once this run ends
            assert await ship.call(order_id=f"{order_id}-parcel", step="pack") == "packed"
            assert await bill.call(order_id=order_id) == "billed"  # same key, another queue
        return "packed" if step == "pack" else "shipped"

    @app.task(queue="billing", key="{order_id}")
    def bill(order_id: str) -> str:
        return "billed"

    async with app.worker():
        assert await ship.call(order_id="o1", step="start", timeout=20) == "shipped"
        assert await ship.call(order_id="o1", step="last", timeout=20) == "shipped"
    assert ran == ["o1:start", "o1-parcel:pack", "o1:after", "o1:last"]


async def test_a_wrongly_typed_argument_is_refused_at_enqueue_not_dead_lettered(make_app: MakeApp) -> None:
    app = make_app()

    @app.task(key="{order_id}")
    async def charge(order_id: str, amount: int) -> int:
        return amount

    with pytest.raises(TypeError) as refused:
        await charge.enqueue(order_id="o1", amount="ten")  # type: ignore[call-overload]
    assert str(refused.value) == "charge(): argument 'amount' must be int, not str"
    with pytest.raises(TypeError) as refused_item:
        await charge.enqueue_many([{"order_id": "o1", "amount": 1}, {"order_id": "o1", "amount": True}])
    assert str(refused_item.value) == "item 1: charge(): argument 'amount' must be int, not bool"
    receipt = await charge.enqueue(order_id="o1", amount=1)
    assert receipt.seq == 1  # nothing was stored before


async def test_enqueue_many_that_is_partly_refused_says_which_were_stored(make_app: MakeApp) -> None:
    app = make_app("capped")
    app.configure_queue(keyqueue.QueueConfig("capped", max_backlog_per_key=2))

    @app.task(key="{k}")
    async def note(k: str, n: int) -> int:
        return n

    with pytest.raises(keyqueue.PartiallyEnqueued) as caught:
        await note.enqueue_many([{"k": "a", "n": 1}, {"k": "a", "n": 2}, {"k": "b", "n": 3}, {"k": "a", "n": 4}])
    results = caught.value.results
    assert [type(r).__name__ for r in results] == ["Receipt", "Receipt", "Receipt", "BacklogFull"]
    assert [r.key for r in caught.value.receipts] == ["a", "a", "b"]
    assert list(caught.value.errors) == [3]
    assert "1 of 4 note requests were not stored (first: item 3: key 'a'" in str(caught.value)


async def test_a_request_too_large_for_a_whole_dead_letter_copy_is_refused_at_enqueue(make_app: MakeApp) -> None:
    app = make_app("big")

    @app.task(key="{k}", max_attempts=1)
    async def load(k: str, blob: bytes) -> None:
        raise ValueError("x" * 5000)  # a long error message: its copy must still keep the whole body

    limit = (await app.connection()).max_payload
    with pytest.raises(keyqueue.PayloadTooLarge, match="less 2048 bytes kept for its dead-letter copy's headers"):
        await load.enqueue(k="a", blob=b"\0" * (limit - 1024))
    receipt = await load.enqueue(k="a", blob=b"\1" * (limit - 2048 - 400))  # fits, with room for its copy
    async with app.worker():
        with pytest.raises(keyqueue.DeadLettered):
            await load.call(k="a", blob=b"", timeout=20)
    [letter, _] = await dead_letters(JetStreamApi(await app.connection()), "big")
    assert letter.request_id == receipt.request_id
    assert letter.truncated_from is None  # whole: a replay runs it as it was
    assert loads(letter.data, CBOR)["blob"] == b"\1" * (limit - 2048 - 400)
