"""The quickstart producer: enqueue, call, and see a remote error come back typed.

Run it with ``python -m examples.quickstart.produce`` while a worker runs (see README.md).
"""

from __future__ import annotations

import asyncio

import keyqueue
from examples.quickstart.app import app, charge, refund


async def main() -> None:
    receipt = await charge.enqueue(order_id="o1", amount=5)
    print(f"enqueued charge for o1: request {receipt.request_id}, inbox seq {receipt.seq}")

    result = await charge.call(order_id="o1", amount=7)  # waits up to 30 s for the result
    print(f"charged: {result}")

    print(f"refunded: {await refund.options(timeout=10).call(order_id='o1', amount=7)}")

    try:
        await charge.options(timeout=10).call(order_id="o2", amount=-1)
    except keyqueue.RemoteError as exc:  # DeadLettered is a RemoteError
        print(f"charge failed remotely: {exc.type_name}: {exc.message}")

    receipts = await charge.enqueue_many([{"order_id": f"o{i}", "amount": i} for i in range(3, 13)])
    print(f"enqueued {len(receipts)} more charges in one pipelined batch")
    await app.close()


if __name__ == "__main__":
    asyncio.run(main())
