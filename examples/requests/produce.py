"""Produce for the requests-by-id example: ``python -m examples.requests.produce`` (a worker must run)."""

from __future__ import annotations

import asyncio
import time

import keyqueue
from examples.requests.app import app, charge, notify, settle


async def main() -> None:
    async with app:
        # A caller-chosen request id: enqueued twice (a retry, say), stored and run once.
        first = await charge.options(request_id="invoice-17").enqueue(account="a1", amount=5)
        again = await charge.options(request_id="invoice-17").enqueue(account="a1", amount=5)
        print("duplicate:", again.duplicate, "same seq:", first.seq == again.seq)

        # Results by id: from the receipt, or from any process that knows the queue and the id.
        print("result:", await first.result(timeout=10))
        async with keyqueue.App("elsewhere", set_as_default=False) as other:
            print("from another app:", await other.result("invoice-17", queue="payments", timeout=10))
        failed = await charge.enqueue(account="a2", amount=0)
        try:
            await failed.result(timeout=10)
        except keyqueue.DeadLettered as exc:
            print("error kept too:", exc)

        # Cancel: a request behind a long one on its key never runs; the long one is not interrupted.
        started = asyncio.Event()

        async def on_progress(msg: object) -> None:
            started.set()

        progress = await (await app.connection()).subscribe("kq.payments.progress.a3", cb=on_progress)
        long = await settle.enqueue(account="a3", seconds=30)
        behind = await settle.enqueue(account="a3", seconds=1)
        print("cancel the one behind:", await behind.cancel())
        await started.wait()  # the long one runs (its first progress message)
        await progress.unsubscribe()
        print("cancel the long one:", await long.cancel())
        print("the long one:", await long.result(timeout=30))
        try:
            await behind.result(timeout=10)
        except keyqueue.Cancelled as exc:
            print("the one behind:", exc)

        # A per-key rate limit: 6 notifications for a1 take over 2 seconds, a2's are not held up.
        started = time.monotonic()
        hot = [await notify.enqueue(account="a1", n=n) for n in range(6)]
        cold = await notify.enqueue(account="a2", n=0)
        await cold.result(timeout=10)
        print(f"a2 done after {time.monotonic() - started:.1f}s")
        for receipt in hot:
            await receipt.result(timeout=30)
        print(f"a1's 6 done after {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    asyncio.run(main())
