"""Progress by request id, against a real nats-server and a real worker: each request's last
``ctx.progress`` is kept (coalesced: a burst of reports costs a few writes), and ``App.progress``,
``App.status(..., progress=True)``, their sync forms, ``keyqueue status --progress``, ``keyqueue
inspect`` and the dashboard's key page return it, while the request runs and after it is done."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from typing import Any

import httpx2
from click.testing import CliRunner
from nats.aio.client import Client

import keyqueue
from keyqueue.admin.diagnosis import diagnose_key
from keyqueue.app.progress import PROGRESS_INTERVAL
from keyqueue.cli import main
from keyqueue.dashboard.state import Monitor
from keyqueue.dashboard.web import create_app
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.records import RequestRecords

BURST = 300
"""Progress reports the task makes in a burst, after the first."""


async def _kept(app: keyqueue.App, nc: Client, request_id: str) -> keyqueue.Progress:
    """The request's kept progress, once the worker has written it: its write is awaited as it
    reaches the server (a subscription on its subject), then read back by id (again a moment later
    if the server delivered the write before it stored it)."""
    arrived = asyncio.Event()

    async def on_write(msg: Any) -> None:
        arrived.set()

    sub = await nc.subscribe(RequestRecords(nc, "imports").progress_subject(request_id), cb=on_write)
    try:
        async with asyncio.timeout(20):
            while (kept := await app.progress(request_id)) is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), 0.1)
    finally:
        await sub.unsubscribe()
    return kept


async def _records_seq(nc: Client) -> int:
    info = await JetStreamApi(nc).stream_info("KQ_imports_RECORDS")
    return int(info["state"]["last_seq"])


async def test_a_requests_last_progress_is_kept_and_read_by_its_id(nats_url: str, nc: Client) -> None:
    app = keyqueue.App("imports", nats_url, autoload_plugins=False, set_as_default=False, result_ttl=600)
    go_on = asyncio.Event()

    @app.task(key="{batch}", max_attempts=1)
    async def ingest(ctx: keyqueue.Context, batch: str, rows: int) -> int:
        await ctx.progress({"done": 0, "of": rows})
        await go_on.wait()
        for done in range(1, BURST + 1):
            await ctx.progress({"done": done, "of": rows})
        return rows

    try:
        async with app.worker():
            receipt = await ingest.enqueue(batch="b1", rows=BURST)
            first = await _kept(app, nc, receipt.request_id)
            assert (first.value, first.task, first.attempt, first.key) == ({"done": 0, "of": BURST}, "ingest", 1, "b1")
            report = await app.status(receipt.request_id, progress=True)
            assert report == keyqueue.StatusReport("running", first)
            # The sync forms, from a thread without a loop (a Django view's).
            assert await asyncio.to_thread(app.progress_sync, receipt.request_id) == first
            assert await asyncio.to_thread(lambda: app.status_sync(receipt.request_id, progress=True)) == report

            # The dashboard's key page and `keyqueue inspect` show the head request's kept progress.
            diagnosis = await diagnose_key(JetStreamApi(nc), "imports", "b1")
            assert diagnosis.progress == first
            monitor = Monitor(nc, queues=["imports"])
            await monitor.poll()
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(monitor)),
                                          base_url="http://127.0.0.1") as web:
                page = (await web.get("/queues/imports/keys/b1")).text
            assert 'data-testid="kept-progress"><code class="progress">{&#34;done&#34;: 0, &#34;of&#34;: 300}' in page

            before, began = await _records_seq(nc), time.monotonic()
            go_on.set()
            assert await receipt.result(timeout=20) == BURST
            took = time.monotonic() - began
        writes = await _records_seq(nc) - before - 1  # less the result's own write
        # 300 reports in a burst: at most one write per interval while it runs, and the last at the end.
        assert 1 <= writes <= 2 + math.ceil(took / PROGRESS_INTERVAL), (writes, took)
        last = await app.progress(receipt.request_id)
        assert last is not None and last.value == {"done": BURST, "of": BURST}
        assert await receipt.progress() == last
        assert await app.status(receipt.request_id, progress=True) == keyqueue.StatusReport("done", last)

        def command(*args: str) -> str:  # the command line runs its own event loop: in a thread
            done = CliRunner().invoke(main, list(args), env={"KEYQUEUE_URL": nats_url})
            assert done.exit_code == 0, done.output
            return done.output

        shown = await asyncio.to_thread(command, "status", "imports", receipt.request_id, "--progress")
        assert shown.startswith(f"done\nprogress: {{\"done\": {BURST}, \"of\": {BURST}}} (attempt 1, "), shown
        as_json: dict[str, Any] = json.loads(await asyncio.to_thread(
            command, "status", "imports", receipt.request_id, "--json"))
        assert as_json["status"] == "done" and as_json["progress"]["value"] == {"done": BURST, "of": BURST}
    finally:
        await app.close()


async def test_a_task_that_keeps_no_results_keeps_its_progress_and_one_with_result_ttl_0_keeps_none(
        nats_url: str, nc: Client) -> None:
    app = keyqueue.App("imports", nats_url, autoload_plugins=False, set_as_default=False)

    @app.task(key="{batch}")
    def plain(ctx: keyqueue.Context, batch: str) -> None:
        ctx.progress_sync("half way")  # a sync task, in a thread

    @app.task(key="{batch}", queue="transient", result_ttl=0)
    async def transient(ctx: keyqueue.Context, batch: str) -> None:
        await ctx.progress("half way")

    try:
        async with app.worker():
            receipt = await plain.enqueue(batch="b2")
            await plain.call(batch="b2", timeout=20)  # the same key: once this is answered, the one before ran
            found = await app.progress(receipt.request_id)
            assert found is not None and (found.value, found.task) == ("half way", "plain")
            opted_out = await transient.enqueue(batch="b2")
            await transient.call(batch="b2", timeout=20)
            assert await app.progress(opted_out.request_id) is None
            assert await app.progress("never-enqueued") is None
    finally:
        await app.close()


async def test_progress_reported_after_its_run_ended_is_not_kept(nats_url: str, nc: Client) -> None:
    """A run's progress keeper is built at its first value; a value reported by a thread the run
    left behind, once the run has ended, is published but not kept (the run itself reported none)."""
    app = keyqueue.App("imports", nats_url, autoload_plugins=False, set_as_default=False)
    late = threading.Event()
    reported = threading.Event()

    @app.task(key="{batch}")
    def leaves_a_thread(ctx: keyqueue.Context, batch: str) -> None:
        def later() -> None:
            late.wait(20)
            ctx.progress_sync("after the run")  # the key is still held: published, offered to keep
            reported.set()

        threading.Thread(target=later, daemon=True).start()

    @app.task(key="{batch}")
    async def next_on_the_key(batch: str, wait: bool) -> None:
        if wait:
            late.set()  # the first run has ended; its thread reports while this one holds the key
            await asyncio.to_thread(reported.wait, 20)

    try:
        async with app.worker():
            receipt = await leaves_a_thread.enqueue(batch="b3")
            await next_on_the_key.call(batch="b3", wait=True, timeout=20)
            assert reported.is_set()
            # A keeper built for the late value would have written it at once: by the end of the
            # key's next request, it would be stored.
            await next_on_the_key.call(batch="b3", wait=False, timeout=20)
            assert await app.progress(receipt.request_id) is None
    finally:
        await app.close()
