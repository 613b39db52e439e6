"""Typed usage of keyqueue's public API, checked by mypy (``make lint``), never run.

Each ``# type: ignore[...]`` marks a line mypy must reject: with ``warn_unused_ignores`` a line
that stops being an error fails the check, so the negative cases are tested too.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, assert_type

import keyqueue
from keyqueue.testing import EagerDeadLetter, eager

app = keyqueue.App("typed", url="nats://127.0.0.1:4222")


@app.task(key="{order_id}", max_attempts=5)
async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, Any]:
    assert_type(ctx.attempt, int)
    assert_type(ctx.fencing, tuple[int, int])
    await ctx.progress({"amount": amount})
    return {"order_id": order_id, "charged": amount}


@app.task(key="{order_id}")
def refund(order_id: str, reason: str = "") -> None:
    """A sync task without a context."""


@app.task(key=lambda sku, price: sku, policy="latest", queue="typed-prices")
async def reprice(sku: str, price: int) -> int:
    return price


@dataclass(frozen=True)
class Reading:
    sensor: str
    value: float


@app.task(key="{sensor}", policy="batch", queue="typed-readings")
async def ingest(ctx: keyqueue.Context, readings: list[Reading]) -> list[float]:
    return [r.value for r in readings]


@keyqueue.task(queue="typed", key="{user}")
def notify(user: str) -> str:
    return user


@app.task(max_attempts=3)
async def add(x: int, y: int) -> int:
    """An unkeyed task: no key=."""
    return x + y


@app.task
async def double(x: int) -> int:
    """An unkeyed task with every default, declared without parentheses."""
    return 2 * x


async def unkeyed() -> None:
    assert_type(await add.call(x=1, y=2), int)
    assert_type(await double.call(x=2), int)
    await double.enqueue(x="2")  # type: ignore[arg-type]
    await add.enqueue(x=1, y="2")  # type: ignore[arg-type]
    assert (await add.enqueue(x=1, y=2)).key == keyqueue.UNKEYED
    app.task(policy="batch")  # type: ignore[call-overload]  # a batch task needs a key


def sync_view() -> None:
    """The sync face, typed as the async one."""
    receipt = charge.delay(order_id="o1", amount=5)
    assert_type(charge.call_sync(order_id="o1", amount=5), dict[str, Any])
    assert_type(charge.options(timeout=10, expires=60).call_sync(order_id="o1", amount=5), dict[str, Any])
    assert_type(refund.call_sync(order_id="o1", timeout=2.5), None)
    assert_type(ingest.call_sync(Reading("s", 1.0)), float)
    assert_type(app.status_sync(receipt.request_id), keyqueue.RequestStatus)
    report = app.status_sync(receipt.request_id, progress=True)
    assert_type(report, keyqueue.StatusReport)
    assert_type(report.progress, keyqueue.Progress | None)
    assert_type(app.progress_sync(receipt.request_id), keyqueue.Progress | None)
    assert_type(app.cancel_sync(receipt.request_id), keyqueue.CancelState)
    charge.call_sync(order_id="o1", amount="5")  # type: ignore[call-overload]


async def producer() -> None:
    receipt = await charge.enqueue(order_id="o1", amount=5)
    assert_type(receipt, keyqueue.Receipt)
    assert_type(receipt.seq, int)
    assert_type(await app.status(receipt.request_id), keyqueue.RequestStatus)
    assert_type(await app.status(receipt.request_id, progress=True), keyqueue.StatusReport)
    assert_type(await receipt.progress(), keyqueue.Progress | None)
    assert_type(await charge.call(order_id="o1", amount=5), dict[str, Any])
    assert_type(await charge.call("o1", 5), dict[str, Any])
    assert_type(await charge.options(timeout=10, request_id="r1").call(order_id="o1", amount=5), dict[str, Any])
    assert_type(await refund.call(order_id="o1"), None)
    assert_type(await reprice.call(sku="s", price=3), int)
    assert_type(await notify.call(user="u"), str)
    assert_type(await ingest.call(Reading("s", 1.0)), float)
    # timeout= on every call: the result stays typed (the arguments of a Task are unchecked beside it).
    assert_type(await charge.call(order_id="o1", amount=5, timeout=10), dict[str, Any])
    assert_type(await refund.call(order_id="o1", timeout=2.5), None)
    assert_type(await charge.options(request_id="r2").call(order_id="o1", amount=5, timeout=10), dict[str, Any])
    assert_type(await ingest.call(Reading("s", 1.0), timeout=10), float)
    assert_type(await ingest.options(request_id="r3").call(Reading("s", 1.0), timeout=10), float)
    await ingest.enqueue_many([Reading("s", 1.0), Reading("s", 2.0)])
    receipts = await charge.enqueue_many([{"order_id": "o1", "amount": 1}])
    assert_type(receipts, list[keyqueue.Receipt])
    delayed = await charge.options(countdown=60).enqueue(order_id="o1", amount=5)
    assert_type(delayed.due, datetime.datetime | None)
    assert_type(await charge.options(eta=delayed.due).enqueue_many([{"order_id": "o1", "amount": 1}]),
                list[keyqueue.Receipt])
    await ingest.options(countdown=1.5).enqueue_many([Reading("s", 1.0)])
    await charge.options(countdown=60).enqueue(order_id="o1", amount="5")  # type: ignore[call-overload]

    await charge.enqueue(order_id="o1", amount="5")  # type: ignore[call-overload]
    await charge.enqueue(order_id="o1")  # type: ignore[call-overload]
    await charge.call(order_id=1, amount=5)  # type: ignore[call-overload]
    await charge.options(timeout=1).call(order_id="o1", amount=None)  # type: ignore[call-overload]
    await refund.enqueue(order_id="o1", nope=1)  # type: ignore[call-arg]
    await reprice.call(sku=1, price=3)  # type: ignore[call-overload]
    await ingest.call({"sensor": "s"})  # type: ignore[arg-type]
    await ingest.call(Reading("s", 1.0), timeout="10")  # type: ignore[arg-type]
    await charge.call(order_id="o1", amount=5, timeout="10")  # type: ignore[call-overload]
    bad: str = await reprice.call(sku="s", price=3)  # type: ignore[assignment]
    del bad

    try:
        await charge.call(order_id="o1", amount=-1)
    except keyqueue.DeadLettered as exc:
        assert_type(exc.type_name, str)
    except keyqueue.Superseded as exc:
        assert_type(exc.by, str)


def sync_producer() -> None:
    assert_type(refund.delay(order_id="o1"), keyqueue.Receipt)
    assert_type(charge.delay(order_id="o1", amount=1), keyqueue.Receipt)
    charge.delay(order_id="o1")  # type: ignore[call-overload]
    assert_type(charge.delay_on_commit(order_id="o1", amount=1), str)
    assert_type(charge.options(request_id="pay-o1").delay_on_commit(order_id="o1", amount=1), str)
    charge.delay_on_commit(order_id="o1")  # type: ignore[call-overload]


async def workflows() -> None:
    flow = charge.s("o1", 5) | refund.si("o1")
    assert_type(flow, keyqueue.Chain)
    assert_type(keyqueue.group(charge.s("o2", 1), charge.s("o3", 2)), keyqueue.Group)
    receipt = await keyqueue.chord([charge.s("o4", 1)], refund.si("o4")).enqueue(workflow_id="wf-typed")
    assert_type(receipt, keyqueue.WorkflowReceipt)
    assert_type(await receipt.status(), str)
    assert_type(flow.delay(), keyqueue.WorkflowReceipt)


async def worker() -> None:
    async with app.worker(concurrency=8, queues=["typed"]) as running:
        assert_type(running, keyqueue.Worker)
    with eager(app) as runner:
        assert_type(await charge.call(order_id="o1", amount=5), dict[str, Any])
        assert_type(runner.dead_letters, list[EagerDeadLetter])


class Plugin:
    @keyqueue.hookimpl
    def keyqueue_register(self, app: keyqueue.App) -> None:
        app.register_processor("typed-echo", lambda key: Echo())

    @keyqueue.hookimpl
    async def keyqueue_request_succeeded(self, queue: str, request_id: str, elapsed: float) -> None:
        return None


class Echo(keyqueue.BaseProcessor):
    async def handle(self, ctx: keyqueue.RequestContext, request: keyqueue.Request) -> keyqueue.Reply | None:
        return keyqueue.Reply(request.data)


plugged = keyqueue.App("typed-plugged", plugins=[Plugin()], set_as_default=False)
