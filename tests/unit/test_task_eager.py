"""keyqueue.testing's eager mode: tasks run in process, in order per key, through the real codecs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import keyqueue
from keyqueue.testing import eager


def make_app() -> keyqueue.App:
    return keyqueue.App("eager", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)


async def test_call_returns_the_result_through_the_codecs() -> None:
    app = make_app()

    @app.task(key="{order_id}")
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, Any]:
        await ctx.progress({"step": 1})
        return {"order_id": order_id, "charged": amount, "key": ctx.key}

    with eager(app) as runner:
        assert await charge.call(order_id="o1", amount=5) == {"order_id": "o1", "charged": 5, "key": "o1"}
        receipt = await charge.enqueue(order_id="o1", amount=6)
    assert (receipt.key, receipt.seq, receipt.duplicate) == ("o1", 2, False)
    assert [p.value for p in runner.progress] == [{"step": 1}, {"step": 1}]
    assert len(runner.succeeded) == 2


async def test_progress_by_request_id_reads_the_last_report_in_eager_mode() -> None:
    app = make_app()

    @app.task(key="{order_id}")
    async def pack(ctx: keyqueue.Context, order_id: str) -> None:
        for step in range(3):
            await ctx.progress({"step": step})

    with eager(app):
        receipt = await pack.enqueue(order_id="o1")
        assert await app.progress(receipt.request_id) == keyqueue.Progress({"step": 2}, receipt.request_id, "o1",
                                                                           "pack", 1, None)
        report = await app.status(receipt.request_id, progress=True)
        assert (report.status, report.progress) == ("done", await receipt.progress())
        assert await app.progress("other") is None


async def test_per_key_order_holds_for_requests_enqueued_while_the_key_runs() -> None:
    app = make_app()
    log: list[str] = []

    @app.task(key="{key}")
    async def step(key: str, n: int) -> None:
        log.append(f"start {key}{n}")
        if n == 1:
            await step.enqueue(key=key, n=2)  # same key: runs after this one ends
            await step.enqueue(key="other", n=9)  # another key: runs now
        log.append(f"end {key}{n}")

    with eager(app):
        await step.enqueue(key="k", n=1)
    assert log == ["start k1", "start other9", "end other9", "end k1", "start k2", "end k2"]


async def test_failures_retry_then_raise_or_dead_letter() -> None:
    app = make_app()
    attempts: list[int] = []

    @app.task(key="{x}", max_attempts=3)
    async def flaky(ctx: keyqueue.Context, x: str) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("not yet")
        return "ok"

    @app.task(key="{x}", max_attempts=2)
    async def broken(x: str) -> None:
        raise ValueError(f"bad {x}")

    with eager(app):
        assert await flaky.call(x="a") == "ok"
        with pytest.raises(ValueError, match="bad b"):
            await broken.enqueue(x="b")
    assert attempts == [1, 2, 3]

    with eager(app, propagate=False) as runner, pytest.raises(keyqueue.DeadLettered) as dead:
        await broken.call(x="c")
    assert (dead.value.type_name, dead.value.message) == ("ValueError", "bad c")
    [letter] = runner.dead_letters
    assert (letter.key, letter.reason, letter.attempts, letter.task) == ("c", "max-attempts", 2, "broken")


async def test_a_reject_is_dead_lettered_at_once() -> None:
    app = make_app()
    calls = 0

    @app.task(key="{x}", max_attempts=5)
    async def picky(x: str) -> None:
        nonlocal calls
        calls += 1
        raise keyqueue.Reject("never valid")

    with eager(app, propagate=False) as runner, pytest.raises(keyqueue.DeadLettered, match="Reject: never valid"):
        await picky.call(x="a")
    assert calls == 1 and runner.dead_letters[0].reason == "rejected"


async def test_a_result_that_cannot_travel_is_a_remote_error() -> None:
    app = make_app()

    @app.task(key="{x}")
    async def bad_result(x: str) -> object:
        return object()

    with eager(app), pytest.raises(keyqueue.RemoteError, match="MalformedBody: the result of bad_result"):
        await bad_result.call(x="a")


async def test_policies_see_every_pending_request_when_drained_together() -> None:
    app = make_app()
    seen: dict[str, list[Any]] = {"latest": [], "batch": [], "merge": []}

    @app.task(key="{sku}", policy="latest", queue="prices")
    async def reprice(sku: str, price: int) -> int:
        seen["latest"].append(price)
        return price

    @app.task(key="{sensor}", policy="batch", queue="readings")
    async def ingest(readings: list[dict[str, Any]]) -> list[int]:
        seen["batch"].append([r["value"] for r in readings])
        return [r["value"] * 10 for r in readings]

    def union(arguments: Any) -> dict[str, Any]:
        return {"doc": arguments[-1]["doc"], "ids": sorted({i for a in arguments for i in a["ids"]})}

    @app.task(key="{doc}", policy="merge", queue="index", merge=union)
    async def reindex(doc: str, ids: list[int]) -> list[int]:
        seen["merge"].append(ids)
        return ids

    with eager(app, autorun=False) as runner:
        for price in (1, 2, 3):
            await reprice.enqueue(sku="s", price=price)
        for value in (1, 2, 3):
            await ingest.enqueue({"sensor": "t", "value": value})
        await reindex.enqueue(doc="d", ids=[3, 1])
        await reindex.enqueue(doc="d", ids=[2])
        await runner.drain()
    assert seen == {"latest": [3], "batch": [[1, 2, 3]], "merge": [[1, 2, 3]]}
    assert len(runner.succeeded) == 8


async def test_a_superseded_caller_learns_which_request_replaced_it() -> None:
    app = make_app()

    @app.task(key="{sku}", policy="latest", queue="prices")
    async def reprice(sku: str, price: int) -> int:
        return price

    with eager(app, autorun=False) as runner:
        first = await reprice.enqueue(sku="s", price=1)
        newest = await reprice.enqueue(sku="s", price=2)
        await runner.drain()
        headers, _ = runner._replies[first.request_id]
    assert headers[keyqueue.wire.headers.SUPERSEDED_BY] == newest.request_id


def test_delay_runs_sync_code_eagerly() -> None:
    app = make_app()
    done: list[str] = []

    @app.task(key="{x}")
    def record(x: str) -> None:
        done.append(x)

    with eager(app):
        receipt = record.delay(x="a")
    assert done == ["a"] and receipt.key == "a"


async def test_the_app_publishes_its_tasks_requests_inside_the_enqueue_wrappers() -> None:
    entered: list[tuple[str, int | None]] = []
    stored: dict[str, int] = {}

    class Wrap:
        @keyqueue.hookimpl
        def keyqueue_wrap_enqueue(self, request: keyqueue.TaskRequest) -> Any:
            @contextlib.contextmanager
            def wrapper() -> Iterator[None]:
                entered.append((request.key, request.receipt.seq if request.receipt else None))
                yield
                assert request.receipt is not None
                stored[request.key] = request.receipt.seq

            return wrapper()

    app = keyqueue.App("eager", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False,
                       plugins=[Wrap()])

    @app.task(key="{x}")
    async def echo(x: str) -> str:
        return x

    with eager(app):
        assert echo.app is app
        receipts = await echo.enqueue_many([{"x": "a"}, {"x": "b"}])
        assert await echo.call(x="c") == "c"
    assert entered == [("a", None), ("b", None), ("c", None)]
    assert stored == {"a": receipts[0].seq, "b": receipts[1].seq, "c": 3}
