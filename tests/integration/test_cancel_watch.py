"""A worker's view of the cancel records (``keyqueue.app.cancel.CancelWatch``) against a real nats-server.

Before: after a reconnect only the first session to start a request reloaded the records (the
others started theirs on the set from before the outage, so a cancel answered ``pending`` ran);
the reload read the records one round trip each; and the set of cancelled ids only grew.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import keyqueue
from keyqueue.app.cancel import CancelWatch
from keyqueue.chaos.proxy import FaultProxy
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.records import CANCEL_STATE, CANCEL_TTL, TTL, RequestRecords
from keyqueue.wire import headers as H


@contextlib.asynccontextmanager
async def proxied_watch(nats_url: str, reconnected: asyncio.Event | None = None
                        ) -> AsyncIterator[tuple[FaultProxy, CancelWatch]]:
    """A started watch of queue ``ledger`` on a connection through a proxy the test can cut
    (``reconnected`` is set when that connection is back after a cut)."""
    proxy = FaultProxy.for_url(nats_url)
    await proxy.start()

    async def back() -> None:
        if reconnected is not None:
            reconnected.set()

    nc = await connect(proxy.url, name="watcher", reconnected=back)
    records = RequestRecords(nc, "ledger")
    await records.ensure()
    watch = CancelWatch(records)
    await watch.start()
    try:
        yield proxy, watch
    finally:
        await watch.close()
        await nc.close()
        await proxy.close()


async def test_every_session_starting_after_a_reconnect_sees_the_cancels_written_meanwhile(nats_url: str) -> None:
    writer = await connect(nats_url, name="canceller")
    reconnected = asyncio.Event()
    async with proxied_watch(nats_url, reconnected) as (proxy, watch):
        proxy.refuse(True)
        proxy.reset()  # the watch's subscription misses what is written now
        await RequestRecords(writer, "ledger").request_cancel("r-1")
        proxy.refuse(False)
        await reconnected.wait()

        async def session_starts() -> bool:
            """What a key session does before its next request: refresh, then check the request."""
            await watch.refresh()
            return "r-1" in watch.cancelled

        # Two sessions of the worker start a request in the same turn of the loop: both wait for the reload.
        assert await asyncio.gather(session_starts(), session_starts(), session_starts()) == [True, True, True]
    await writer.close()


async def test_the_reload_reads_the_records_a_page_per_round_trip(nats_url: str) -> None:
    writer = await connect(nats_url, name="canceller")
    records = RequestRecords(writer, "ledger")
    await records.ensure()
    api = JetStreamApi(writer)
    count = 3000
    for start in range(0, count, 500):  # the records as request_cancel writes them, pipelined
        await asyncio.gather(*(api.publish(records.cancel_subject(f"r-{n}"),
                                           b"", {CANCEL_STATE: "requested", H.REQUEST_ID: f"r-{n}",
                                                 TTL: f"{CANCEL_TTL}s"})
                               for n in range(start, start + 500)))
    async with proxied_watch(nats_url) as (_, watch):
        assert len(watch.cancelled) == count  # loaded at start
        nc = watch.records.nc
        nc.stats["reconnects"] += 1  # as after an outage: the next refresh reads every record again
        watch.cancelled.clear()
        sent = nc.stats["out_msgs"]
        await watch.refresh()
        requests = nc.stats["out_msgs"] - sent
        assert len(watch.cancelled) == count
        assert requests <= 10, f"{requests} requests to read {count} cancel records"  # before: one each
    await writer.close()


async def test_the_cancelled_set_forgets_requests_that_are_done(nats_url: str) -> None:
    """A long-running worker's set holds the cancels still to act on, not every cancel it ever saw."""
    started, release = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    def declare(app: keyqueue.App) -> keyqueue.Task:  # type: ignore[type-arg]
        @app.task(key="{account}", max_attempts=1, result_ttl=60)
        async def work(ctx: keyqueue.Context, account: str, n: int) -> int:
            runs.append(n)
            if n == 0:
                started.set()
                await release.wait()
            return n
        return work

    producer = keyqueue.App("ledger", url=nats_url, set_as_default=False, autoload_plugins=False)
    worker_app = keyqueue.App("ledger", url=nats_url, set_as_default=False, autoload_plugins=False)
    work, _ = declare(producer), declare(worker_app)
    try:
        async with worker_app.worker(concurrency=2, linger=0.01):
            first = await work.enqueue(account="a", n=0)
            await started.wait()
            behind = [await work.enqueue(account="a", n=n) for n in range(1, 21)]
            assert await first.cancel() == "running"
            assert await asyncio.gather(*(r.cancel() for r in behind)) == ["pending"] * 20
            release.set()
            last = await work.enqueue(account="a", n=99)
            assert await last.result(timeout=20) == 99
            watch = await worker_app.transport().cancel_watch("ledger")  # type: ignore[attr-defined]
            assert runs == [0, 99]
            assert watch.cancelled == {}, f"{len(watch.cancelled)} ids kept for requests that are done"
            assert all(watch.is_cancelled(r.request_id) for r in behind)  # still refused if read again
    finally:
        await worker_app.close()
        await producer.close()
