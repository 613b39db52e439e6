"""A FastAPI app that enqueues keyqueue tasks (docs/web.md, "FastAPI").

The app connects when the web server starts, in its lifespan: a server that cannot be reached
fails the start-up (uvicorn exits) instead of the first request, and the connection is closed at
shutdown. Run it as the test does::

    keyqueue worker shop_api:tasks                      # the tasks, in a worker
    uvicorn shop_api:api --workers 2                    # the web app
"""

from __future__ import annotations

from fastapi import FastAPI

import keyqueue

tasks = keyqueue.App("fastapi-shop", result_ttl=600)


@tasks.task(key="{order_id}")
async def charge(order_id: str, amount: int) -> dict[str, object]:
    return {"order_id": order_id, "charged": amount}


api = FastAPI(lifespan=tasks.lifespan)  # connect at start-up, close at shutdown


@api.post("/orders/{order_id}/pay")
async def pay(order_id: str, amount: int = 5) -> dict[str, str]:
    receipt = await charge.enqueue(order_id=order_id, amount=amount)
    return {"request_id": receipt.request_id}


@api.get("/requests/{request_id}")
async def status(request_id: str, wait: bool = False) -> dict[str, object]:
    result = await tasks.result(request_id, timeout=30) if wait else None
    return {"status": await tasks.status(request_id), "result": result}


@api.get("/orders/{order_id}/charge")
def charge_now(order_id: str, amount: int = 1) -> object:
    """A plain def endpoint runs in FastAPI's thread pool, where the sync forms work."""
    return charge.call_sync(order_id=order_id, amount=amount, timeout=30)
