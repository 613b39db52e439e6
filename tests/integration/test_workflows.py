"""Workflows (chain, group, chord) against a real nats-server, with a worker in this process.

Celery's canvas examples give their documented results; results pass typed from step to step;
a failed step stops the workflow and says why for each step that will not run, and its
dead-letter replay resumes it; cancel stops what has not started; steps that share a key keep
that key's order; the sync face works; bad input is refused with a clear error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from click.testing import CliRunner

import keyqueue
from keyqueue import chain, chord, group
from keyqueue.admin.dead_letters import dead_letters, replay
from keyqueue.builtins import workflows as workflows_plugin
from keyqueue.cli import main
from keyqueue.dashboard.state import Monitor
from keyqueue.dashboard.web import DashboardOptions, create_app
from keyqueue.events import decode_events, events_stream
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames

MakeApp = Callable[..., keyqueue.App]


class Outcomes:
    """A plugin that hears each request's outcome once its key session has removed it."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}
        self.dead_lettered: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()

    @keyqueue.hookimpl
    def keyqueue_request_succeeded(self, request_id: str) -> None:
        self.seen[request_id] = "succeeded"
        self.changed.set()

    @keyqueue.hookimpl
    def keyqueue_request_superseded(self, request_id: str, superseded_by: str) -> None:
        self.seen[request_id] = f"superseded by {superseded_by}"
        self.changed.set()

    @keyqueue.hookimpl
    def keyqueue_request_dead_lettered(self, request_id: str) -> None:
        self.dead_lettered[request_id] += 1
        self.changed.set()

    async def wait(self, wanted: dict[str, str]) -> None:
        await self._until(lambda: all(self.seen.get(i) == outcome for i, outcome in wanted.items()))

    async def moved_to_dlq(self, times: int) -> None:
        """Wait until requests were moved to the dead-letter queue ``times`` times in all (a failure is
        told to its caller before the move: a replay right after it may find nothing)."""
        await self._until(lambda: sum(self.dead_lettered.values()) >= times)

    async def _until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(20):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    async def done(self, *request_ids: str) -> None:
        """Wait until each request succeeded and left its inbox (a step's record is written by then)."""
        await self.wait(dict.fromkeys(request_ids, "succeeded"))


@pytest.fixture
async def make_app(nats_url: str) -> AsyncIterator[MakeApp]:
    apps: list[keyqueue.App] = []

    def make(name: str = "canvas", **options: Any) -> keyqueue.App:
        app = keyqueue.App(name, url=nats_url, set_as_default=False, autoload_plugins=False, **options)
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.close()


def arithmetic(app: keyqueue.App) -> tuple[Any, Any, Any]:
    """Celery's example tasks: ``add``, ``mul`` and ``xsum``, each under a key of its own arguments."""

    @app.task(key="n{x}")
    async def add(x: int, y: int) -> int:
        return x + y

    @app.task(key="n{x}")
    async def mul(x: int, y: int) -> int:
        return x * y

    @app.task(key="sums")
    async def xsum(numbers: list[int]) -> int:
        return sum(numbers)

    return add, mul, xsum


async def test_celerys_canvas_examples_give_their_documented_results(make_app: MakeApp) -> None:
    app = make_app()
    add, mul, xsum = arithmetic(app)
    async with app.worker(concurrency=8):
        # docs.celeryq.dev, "Canvas: Designing Work-flows", each with the result it documents.
        assert await chain(add.s(4, 4) | mul.s(8)).call(timeout=20) == 64
        assert await chain(add.s(4, 4), mul.s(8), mul.s(10)).call(timeout=20) == 640
        assert await (add.s(2, 2) | add.s(4) | add.s(8)).call(timeout=20) == 16
        assert await add.s(2).call(4, timeout=20) == 6                              # a partial: add(4, 2)
        assert await (add.s(4) | mul.s(8)).call(16, timeout=20) == 160               # (16 + 4) * 8
        assert await (add.si(2, 2) | add.si(4, 4)).call(timeout=20) == 8             # immutable: takes nothing
        assert await group(add.s(i, i) for i in range(10)).call(timeout=20) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
        assert await chord((add.s(i, i) for i in range(10)), xsum.s()).call(timeout=20) == 90
        assert await (group(add.s(i, i) for i in range(10)) | xsum.s()).call(timeout=20) == 90  # upgraded to a chord
        assert await (add.s(2, 2) | group(add.s(4), add.s(8))).call(timeout=20) == [8, 12]
        # Nested: a chord in a chain, a group of chains, a chain of groups.
        assert await (add.s(1, 1) | chord([add.s(1), mul.s(3)], xsum.s()) | mul.s(2)).call(timeout=20) == 18
        assert await group(add.s(1, 1) | mul.s(5), add.s(2, 2) | mul.s(5)).call(timeout=20) == [10, 20]
        assert await (group(add.s(1, 1), add.s(2, 2)) | group(xsum.s(), xsum.s())).call(timeout=20) == [6, 6]


@dataclass(frozen=True)
class Order:
    id: str
    total: int


@dataclass(frozen=True)
class Shipment:
    order: str
    parcels: int


async def test_results_pass_typed_from_step_to_step(make_app: MakeApp) -> None:
    app = make_app("typed")
    keys: list[str] = []

    @app.task(key="{order_id}")
    async def price(ctx: keyqueue.Context, order_id: str, items: list[int]) -> Order:
        keys.append(ctx.key)
        return Order(order_id, sum(items))

    @app.task(key="ship.{order.id}")  # a key over a field of the dataclass the step before returned
    async def ship(ctx: keyqueue.Context, order: Order, per_parcel: int) -> Shipment:
        assert isinstance(order, Order)
        keys.append(ctx.key)
        return Shipment(order.id, -(-order.total // per_parcel))

    async with app.worker():
        shipment = await (price.s("o1", [5, 7, 9]) | ship.s(per_parcel=10)).call(timeout=20)
        assert shipment == Shipment("o1", 3) and isinstance(shipment, Shipment)
        both = await group(price.s("o2", [1]) | ship.s(per_parcel=1), price.s("o3", [2, 2]) | ship.s(per_parcel=4)
                           ).call(timeout=20)
        assert both == [Shipment("o2", 1), Shipment("o3", 1)] and all(isinstance(s, Shipment) for s in both)
    assert keys[:2] == ["o1", "ship.o1"]  # each step under its own key


async def test_links_errbacks_and_where_a_failed_workflow_stopped(make_app: MakeApp) -> None:
    outcomes = Outcomes()
    app = make_app("links", result_ttl=60, plugins=[outcomes])
    add, mul, _ = arithmetic(app)
    seen: list[Any] = []

    @app.task(key="n{x}", max_attempts=2, backoff=0.01)
    async def explode(x: int) -> int:
        raise ValueError(f"no good: {x}")

    @app.task(key="log")
    async def note(value: Any, tag: str) -> None:
        seen.append((tag, value))

    @app.task(key="log")
    async def on_error(failure: keyqueue.StepFailure, tag: str) -> str:
        seen.append((tag, failure))
        return failure.task

    async with app.worker():
        # link: a callback beside the flow gets the result; the workflow's result is the chain's.
        linked = await add.s(2, 2).link(note.s("linked")).enqueue()
        assert await linked.result(timeout=20) == 4
        await outcomes.done(f"{linked.workflow_id}_1")  # the link, step 1, runs beside the end
        flow = (add.s(1, 1) | explode.s() | mul.s(10) | add.s(1)).link_error(on_error.s("errback"))
        receipt = await flow.enqueue()
        with pytest.raises(keyqueue.WorkflowFailed) as failed:
            await receipt.result(timeout=20)
        # Steps 4 to 7 are the errback's copies for steps 0 to 3: step 1's runs.
        await outcomes.done(f"{receipt.workflow_id}_0", f"{receipt.workflow_id}_5")
        assert failed.value.step == 1 and failed.value.task == "explode"
        assert failed.value.type_name == "ValueError" and failed.value.reason == "max-attempts"
        assert isinstance(failed.value, keyqueue.DeadLettered)
        assert await receipt.status() == "failed"
        view = await app.workflow(receipt.workflow_id)
        assert view is not None and view.state == "failed" and view.stopped_at == 1
        states = [(s.task, s.state) for s in view.steps if s.role == "step"]
        assert states == [("add", "done"), ("explode", "failed"), ("mul", "not-run"), ("add", "not-run")]
        for later in view.steps[2:4]:
            assert later.reason == "step 1 (explode) failed: ValueError: no good: 2"
        errback = next(s for s in view.steps if s.role == "errback" and s.state == "done")
        assert errback.task == "on_error"
    assert ("linked", 4) in seen
    [(_tag, failure)] = [entry for entry in seen if entry[0] == "errback"]
    assert isinstance(failure, keyqueue.StepFailure)
    assert (failure.workflow_id, failure.step, failure.task, failure.key, failure.reason) == (
        receipt.workflow_id, 1, "explode", "n2", "max-attempts")


async def test_a_dead_letter_replay_of_the_failed_step_resumes_the_workflow(make_app: MakeApp, nc: Any) -> None:
    outcomes = Outcomes()
    app = make_app("replays", plugins=[outcomes])
    events: list[dict[str, Any]] = []
    got_event = asyncio.Event()

    async def on_event(msg: Any) -> None:
        events.extend(e for e in decode_events(msg.headers, msg.data) if str(e.get("event")).startswith("workflow_"))
        got_event.set()

    await nc.subscribe("kq.replays.events.>", cb=on_event)
    add, mul, xsum = arithmetic(app)
    broken = threading.Event()
    broken.set()
    runs: list[int] = []

    @app.task(key="flaky", max_attempts=1)
    async def flaky(x: int) -> int:
        runs.append(x)
        if broken.is_set():
            raise ConnectionError("the bank is down")
        return x

    async with app.worker():
        receipt = await chord([add.s(1, 1), add.s(2, 2) | flaky.s()], xsum.s() | mul.s(10)).enqueue()
        with pytest.raises(keyqueue.WorkflowFailed):
            await receipt.result(timeout=20)
        await outcomes.done(f"{receipt.workflow_id}_0", f"{receipt.workflow_id}_1")
        view = await app.workflow(receipt.workflow_id)
        assert view is not None
        assert [s.state for s in view.steps] == ["done", "done", "failed", "not-run", "not-run"]
        assert view.steps[3].reason == view.steps[4].reason == (
            "step 2 (flaky) failed: ConnectionError: the bank is down")
        nc = await app.connection()
        api, publisher = JetStreamApi(nc), Publisher(nc, QueueNames("replays"))
        step = f"{receipt.workflow_id}_2"
        await outcomes.moved_to_dlq(1)
        [letter] = await dead_letters(api, "replays")
        assert letter.request_id == step
        assert await replay(api, publisher, "replays") == 1  # still broken: it fails again, and says so again
        with pytest.raises(keyqueue.WorkflowFailed):
            await receipt.result(timeout=20)
        await outcomes.moved_to_dlq(2)  # its replay, under an id of its own
        assert len(runs) == 2
        broken.clear()
        assert await replay(api, publisher, "replays") == 1
        assert await receipt.result(timeout=20) == 60  # (2 + 4) * 10
        assert await receipt.status() == "done"
        assert runs == [4, 4, 4]
        async with asyncio.timeout(20):  # events are best effort, published after the change they tell
            while not any(e["event"] == "workflow_done" for e in events):
                got_event.clear()
                await got_event.wait()
        assert [e["event"] for e in events if e["run_id"] == receipt.workflow_id] == [
            "workflow_started", "workflow_failed", "workflow_failed", "workflow_resumed", "workflow_joined",
            "workflow_done"]
        stored = await workflow_events(app, "replays", receipt.workflow_id)
        assert stored[:2] == ["workflow_started", "workflow_failed"]  # they reach the events stream


async def workflow_events(app: keyqueue.App, queue: str, workflow_id: str) -> list[str]:
    """The workflow's lifecycle events in the queue's events stream, in order."""
    api = JetStreamApi(await app.connection())
    names: list[str] = []
    async for page in api.pages(events_stream(queue), f"kq.{queue}.events.>"):
        for msg in page:
            names.extend(e["event"] for e in decode_events(msg.headers, msg.data) if e.get("run_id") == workflow_id)
    return names


async def test_cancel_stops_every_step_that_has_not_started(make_app: MakeApp) -> None:
    outcomes = Outcomes()
    app = make_app("cancels", plugins=[outcomes])
    started, release = asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    @app.task(key="{name}")
    async def slow(name: str) -> str:
        ran.append(name)
        started.set()
        await release.wait()
        return name

    @app.task(key="{name}")
    async def step(value: Any, name: str) -> str:
        ran.append(name)
        return name

    async with app.worker(concurrency=4):
        # A pending request on the group's key keeps the group's parts waiting behind it.
        receipt = await (slow.s("first") | group(step.s("a"), step.s("b")) | step.s("after")).enqueue()
        await started.wait()
        assert await receipt.status() == "running"
        assert await receipt.cancel() == "cancelled"
        release.set()  # the running step is not interrupted; nothing after it runs
        with pytest.raises(keyqueue.WorkflowCancelled):
            await receipt.result(timeout=20)
        # The running step finishes and hands on; its key's holder skips each part of the group.
        wf = receipt.workflow_id
        await outcomes.wait({f"{wf}_0": "succeeded", f"{wf}_1": "superseded by (cancelled)",
                             f"{wf}_2": "superseded by (cancelled)"})
        view = await app.workflow(receipt.workflow_id)
        assert view is not None and view.state == "cancelled"
        assert view.steps[0].state == "done"
        assert [s.state for s in view.steps[1:]] == ["cancelled", "cancelled", "not-run"]
        assert await receipt.cancel() == "cancelled" and await receipt.status() == "cancelled"
        done = await (slow.si("x") | step.s("y")).enqueue()
        assert await done.result(timeout=20) == "y"
        assert await app.cancel(done.workflow_id) == "done"
        # A step's own request cancelled (by its id) stops its workflow there too.
        release.clear()
        started.clear()
        await slow.enqueue(name="busy")
        await started.wait()
        one = await (step.si(0, "busy") | step.s("never")).enqueue()
        assert await app.cancel(f"{one.workflow_id}_0", queue="cancels", key="busy") == "pending"
        release.set()
        with pytest.raises(keyqueue.WorkflowCancelled):
            await one.result(timeout=20)
    assert ran == ["first", "x", "y", "busy"]


async def test_steps_that_share_a_key_keep_its_order(make_app: MakeApp) -> None:
    outcomes = Outcomes()
    app = make_app("order", plugins=[outcomes])
    log: list[tuple[str, str]] = []
    busy: set[str] = set()

    @app.task(key="{key}")
    async def work(key: str, tag: str) -> str:
        assert key not in busy, f"two runs of key {key} at once"
        busy.add(key)
        log.append((key, tag))
        await asyncio.sleep(0.005)
        busy.discard(key)
        return tag

    @app.task(key="{key}")
    async def then(previous: Any, key: str, tag: str) -> str:
        log.append((key, tag))
        return tag

    gate = asyncio.Event()

    @app.task(key="{key}")
    async def hold(key: str) -> str:
        await gate.wait()  # the chain's first step holds on until b0 is stored on key b
        log.append((key, "held"))
        return "held"

    async with app.worker(concurrency=8):
        # The group's parts share key k: one at a time, in the group's order, behind what k had.
        await work.enqueue(key="k", tag="before")
        result = await group(work.s("k", f"g{i}") for i in range(8)).enqueue()
        behind = await work.options(request_id="k-behind").enqueue(key="k", tag="behind")
        assert await result.result(timeout=20) == [f"g{i}" for i in range(8)]
        await outcomes.done(behind.request_id)
        # A chain's later step joins its key's order when it is enqueued: behind what was there first.
        chained = await (hold.si("a") | then.s("b", "b1")).enqueue()
        await work.enqueue(key="b", tag="b0")
        gate.set()
        assert await chained.result(timeout=20) == "b1"
    on_k = [tag for key, tag in log if key == "k"]
    assert on_k == ["before", *[f"g{i}" for i in range(8)], "behind"]
    assert [tag for key, tag in log if key == "b"] == ["b0", "b1"] and ("a", "held") in log


async def test_the_sync_face_starts_and_reads_workflows(make_app: MakeApp) -> None:
    app = make_app("syncwf")
    add, mul, xsum = arithmetic(app)

    def view() -> list[Any]:
        receipt = (add.s(1, 2) | mul.s(3)).delay()
        found = [receipt.result_sync(timeout=20), receipt.status_sync(), app.status_sync(receipt.workflow_id)]
        found.append(chord([add.s(1, 1), add.s(2, 2)], xsum.s()).call_sync(timeout=20))
        found.append(app.result_sync(receipt.workflow_id, timeout=5))
        found.append(receipt.cancel_sync())
        return found

    async with app.worker():
        assert await asyncio.to_thread(view) == [9, "done", "done", 6, 9, "done"]


async def test_bad_workflows_are_refused_with_clear_errors(make_app: MakeApp) -> None:
    app = make_app("badwf")
    add, mul, _ = arithmetic(app)

    @app.task(key="{x}", policy="latest", queue="badwf-latest")
    async def newest(x: int) -> int:
        return x

    @app.task(key="w")
    async def word(x: int) -> str:
        return "seven"

    with pytest.raises(TypeError, match="add"):
        await (add.s(1) | mul.s(2)).enqueue()  # the first step lacks an argument: nothing is stored
    with pytest.raises(TypeError, match=r"workflow step 1: mul\(\) \(its first parameter takes the result"):
        await (add.s(1, 2) | mul.s(2, 3)).enqueue()
    with pytest.raises(TypeError, match="must be int, not str"):
        await (add.s(1, 2) | mul.s("two")).enqueue()
    with pytest.raises(keyqueue.ConfigError, match="policy 'latest'"):
        newest.s(1)
    with pytest.raises(keyqueue.InvalidRequestId, match="wf-"):
        await add.s(1, 2).enqueue(workflow_id="order 17")
    with pytest.raises(keyqueue.ConfigError, match="empty"):
        group([])
    async with app.worker():
        # A result that does not fit the next step's signature stops the workflow at that step.
        with pytest.raises(keyqueue.WorkflowFailed, match="not-enqueued") as failed:
            await (word.s(7) | mul.s(2)).call(timeout=20)
        assert failed.value.step == 1 and failed.value.type_name == "TypeError"
        first = await (add.s(1, 2) | mul.s(2)).enqueue(workflow_id="wf-order-17")
        again = await (add.s(1, 2) | mul.s(2)).enqueue(workflow_id="wf-order-17")  # a producer's retry
        assert (first.duplicate, again.duplicate) == (False, True)
        assert again.steps[0].duplicate
        assert await again.result(timeout=20) == 6
        with pytest.raises(keyqueue.ConfigError, match="names another workflow"):
            await (add.s(5, 5) | mul.s(2)).enqueue(workflow_id="wf-order-17")


async def test_the_command_line_shows_a_workflow_and_where_it_stopped(make_app: MakeApp, nats_url: str) -> None:
    outcomes = Outcomes()
    app = make_app("cliwf", plugins=[outcomes])
    add, mul, xsum = arithmetic(app)

    @app.task(key="card-{x}", max_attempts=1)
    async def declined(x: int) -> int:
        raise ValueError(f"card {x} declined")

    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, [*args, "--url", nats_url])

    async with app.worker():
        good = await (add.s(1, 2) | mul.s(3)).enqueue()
        assert await good.result(timeout=20) == 9
        bad = await (add.s(1, 1) | declined.s() | chord([add.s(1), add.s(2)], xsum.s())).enqueue()
        with pytest.raises(keyqueue.WorkflowFailed):
            await bad.result(timeout=20)
        await outcomes.done(f"{bad.workflow_id}_0")
    shown = await asyncio.to_thread(cli, "workflow", "show", bad.workflow_id)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == f"workflow {bad.workflow_id}  queue cliwf  failed (stopped at step 1: declined on key card-2)"
    rows = [line.split() for line in lines[4:]]
    assert [row[:6] for row in rows[:2]] == [["0", "add", "cliwf", "n1", "done", "1"],
                                             ["1", "declined", "cliwf", "card-2", "failed", "1"]]
    assert [row[4] for row in rows[2:]] == ["not-run"] * 3
    assert lines[-1].endswith("step 1 (declined) failed: ValueError: card 2 declined")
    as_json = json.loads((await asyncio.to_thread(cli, "workflow", "show", bad.workflow_id, "--json")).output)
    assert [s["state"] for s in as_json["steps"]] == ["done", "failed", "not-run", "not-run", "not-run"]
    assert (await asyncio.to_thread(cli, "status", "cliwf", good.workflow_id)).output == "done\n"
    assert (await asyncio.to_thread(cli, "result", "cliwf", good.workflow_id)).output == "9\n"
    listed = (await asyncio.to_thread(cli, "workflow", "list", "cliwf")).output
    assert good.workflow_id in listed and "step 1 (declined)" in listed
    assert (await asyncio.to_thread(cli, "cancel", "cliwf", bad.workflow_id)).output == "cancelled\n"
    failed = await asyncio.to_thread(cli, "result", "cliwf", bad.workflow_id)
    assert failed.exit_code == 1 and "was cancelled" in failed.output
    waiting = await (add.s(7, 7) | mul.s(2)).enqueue()  # no worker now: its first step waits on key n7
    assert (await asyncio.to_thread(cli, "status", "cliwf", waiting.workflow_id)).output == "pending\n"
    inspected = (await asyncio.to_thread(cli, "inspect", "cliwf", "n7")).output
    assert f"step 0 of workflow {waiting.workflow_id}" in inspected
    missing = await asyncio.to_thread(cli, "workflow", "show", "wf-nothing")
    assert missing.exit_code == 1 and "no workflow wf-nothing" in missing.output


async def test_the_dashboard_shows_a_workflows_steps_keys_and_where_it_stopped(make_app: MakeApp) -> None:
    outcomes = Outcomes()
    app = make_app("dashwf", plugins=[outcomes])
    add, mul, _ = arithmetic(app)

    @app.task(key="card-{x}", max_attempts=1)
    async def declined(x: int) -> int:
        raise ValueError(f"card {x} declined")

    async with app.worker():
        good = await (add.s(1, 2) | mul.s(3)).enqueue()
        assert await good.result(timeout=20) == 9
        bad = await (add.s(1, 1) | declined.s() | mul.s(2)).enqueue()
        with pytest.raises(keyqueue.WorkflowFailed):
            await bad.result(timeout=20)
        await outcomes.done(f"{bad.workflow_id}_0")
    monitor = Monitor(await app.connection(), queues=["dashwf"])
    transport = httpx2.ASGITransport(app=create_app(monitor, DashboardOptions()))
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as web:
        page = await web.get(f"/queues/dashwf/workflows/{bad.workflow_id}")
        assert page.status_code == 200
        html = page.text
        assert "stopped at step 1 (declined) on key" in html and 'href="/queues/dashwf/dlq?key=card-2"' in html
        assert html.count('data-state="done"') == 1 and html.count('data-state="not-run"') == 1
        assert 'href="/queues/dashwf/keys/card-2"' in html
        assert "step 1 (declined) failed: ValueError: card 2 declined" in html
        listed = (await web.get("/queues/dashwf/workflows")).text
        assert f'data-workflow="{good.workflow_id}"' in listed and f'data-workflow="{bad.workflow_id}"' in listed
        as_json = (await web.get(f"/queues/dashwf/workflows/{good.workflow_id}?format=json")).json()
        assert as_json["state"] == "done" and [s["key"] for s in as_json["steps"]] == ["n1", "n3"]
        assert (await web.get("/queues/dashwf/workflows/wf-missing")).status_code == 404


async def test_a_crash_loop_dead_letter_says_where_the_workflow_stopped(make_app: MakeApp) -> None:
    """A step whose holders keep dying is dead-lettered by the session (``crash-loop``) without the
    processor: the lifecycle hook records it (called here as a worker's dispatcher calls it)."""
    app = make_app("loops")
    add, mul, _ = arithmetic(app)
    receipt = await (add.s(1, 1) | mul.s(2)).enqueue()  # no worker: its first step waits on key n1
    await workflows_plugin.keyqueue_request_dead_lettered(
        worker=app.worker(), queue="loops", key="n1", request_id=f"{receipt.workflow_id}_0", message_type="add",
        reason="crash-loop", attempts=11, error="WorkerLost: its holders kept dying on it")
    with pytest.raises(keyqueue.WorkflowFailed) as failed:
        await receipt.result(timeout=10)
    assert (failed.value.step, failed.value.reason, failed.value.type_name) == (0, "crash-loop", "WorkerLost")
    view = await app.workflow(receipt.workflow_id)
    assert view is not None and [s.state for s in view.steps] == ["failed", "not-run"]
    assert view.steps[1].reason == "step 0 (add) failed: WorkerLost: its holders kept dying on it"
