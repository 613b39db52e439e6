"""The requests-by-id example's app: kept results, cancels, caller-chosen ids and a per-key rate limit."""

from __future__ import annotations

import asyncio
from typing import Any

import keyqueue

app = keyqueue.App("payments")


@app.task(key="{account}", result_ttl=3600, max_attempts=1)
async def charge(ctx: keyqueue.Context, account: str, amount: int) -> dict[str, Any]:
    """Kept for an hour: any process can read the result by request id."""
    if amount <= 0:
        raise ValueError(f"cannot charge {amount}")
    return {"account": account, "charged": amount, "request": ctx.request_id}


@app.task(key="{account}", result_ttl=3600)
async def settle(ctx: keyqueue.Context, account: str, seconds: float) -> str:
    """A long run that stops early when someone asks to cancel it."""
    await ctx.progress("started")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        if ctx.cancel_requested:
            return "stopped early"
        await asyncio.sleep(0.05)
    return "settled"


@app.task(key="{account}", rate_limit="2/s", result_ttl=3600)
async def notify(account: str, n: int) -> int:
    """At most 2 runs per account per second across every worker; other accounts do not wait."""
    return n
