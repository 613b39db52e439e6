"""The app the dashboard's browser tests run workers of (``tests.browser.dashboard_app:app``).

Queue ``shop``: ``hold`` keeps its key for a while (long enough to see who holds it), ``pay``
fails on its first run and succeeds once replayed from the DLQ (its request id then ends in
``.replay-<seq>``), so a replay visibly empties the DLQ. ``pack`` reports its progress and
holds its key a while; ``ship`` fails and is retried again and again (a failing key);
``invoice`` may run once a minute per key (a rate limit); ``report`` reports progress every 0.2 s
for as long as it runs (busy, not stuck). The periodic schedule ``nightly-stocktake`` runs at 03:00
in Oslo.
"""

from __future__ import annotations

import asyncio
from typing import Any

import keyqueue


def build(url: str | None = None) -> tuple[keyqueue.App, dict[str, Any]]:
    """The app and its tasks by name (``url``: its server; None: ``$KEYQUEUE_URL``)."""
    app = keyqueue.App("dash", url, set_as_default=False, autoload_plugins=False)

    @app.task(queue="shop", key="{order_id}")
    async def hold(ctx: keyqueue.Context, order_id: str, seconds: float) -> dict[str, Any]:
        await asyncio.sleep(seconds)
        return {"order_id": order_id}

    @app.task(queue="shop", key="{order_id}", max_attempts=1)
    async def pay(ctx: keyqueue.Context, order_id: str, amount: int) -> dict[str, Any]:
        if ".replay-" not in ctx.request_id:
            raise ValueError(f"card declined for order {order_id}")
        return {"order_id": order_id, "paid": amount}

    @app.task(queue="shop", key="{order_id}")
    async def touch(ctx: keyqueue.Context, order_id: str) -> None:
        return None

    @app.task(queue="shop", key="{order_id}")
    async def pack(ctx: keyqueue.Context, order_id: str, seconds: float) -> None:
        await ctx.progress({"step": "packing", "order_id": order_id})
        await asyncio.sleep(seconds)

    @app.task(queue="shop", key="{order_id}", max_attempts=100, backoff=0.3)
    async def ship(ctx: keyqueue.Context, order_id: str) -> None:
        raise ConnectionError(f"carrier unreachable for {order_id}")

    @app.task(queue="shop", key="{order_id}", rate_limit="1/m")
    async def invoice(ctx: keyqueue.Context, order_id: str) -> None:
        return None

    @app.task(queue="shop", key="{order_id}")
    async def report(ctx: keyqueue.Context, order_id: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await ctx.progress({"step": "reporting", "left": round(end - loop.time(), 1)})
            await asyncio.sleep(0.2)

    # Never due while a test runs: the Schedules page lists it with its next run.
    app.periodic("nightly-stocktake", touch, cron="0 3 * * *", timezone="Europe/Oslo", kwargs={"order_id": "stock"})
    return app, {"hold": hold, "pay": pay, "touch": touch, "pack": pack, "ship": ship, "invoice": invoice,
                 "report": report}


app, _tasks = build()
