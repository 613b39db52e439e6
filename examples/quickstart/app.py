"""The quickstart app: orders are keys, so each order's requests run one at a time, in order.

Run a worker for it with ``keyqueue worker examples.quickstart.app:app`` (see README.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

import keyqueue

app = keyqueue.App("shop")
"""Connects to $KEYQUEUE_URL, else to the app's embedded nats-server (see docs/tutorial.md)."""


@app.task(key="{order_id}", max_attempts=3, backoff=0.1)
async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, Any]:
    """Charge an order. Two charges of one order never overlap and run in the order enqueued."""
    if amount <= 0:
        raise ValueError(f"amount must be positive, got {amount}")
    await ctx.progress({"step": "charging", "amount": amount})
    await asyncio.sleep(0.01)  # the payment provider
    return {"order_id": order_id, "charged": amount, "attempt": ctx.attempt}


@keyqueue.task(queue="shop", key="{order_id}")
def refund(order_id: str, amount: int) -> dict[str, Any]:
    """A sync task (declared on the default app, which is `app` here): it runs in a thread."""
    return {"order_id": order_id, "refunded": amount}


@app.task(queue="shop-prices", key="{sku}", policy="latest")
async def reprice(sku: str, price: int) -> dict[str, Any]:
    """Only the newest price of a SKU matters: older pending requests are superseded."""
    return {"sku": sku, "price": price}
