"""Periodic requests (``App.periodic``) against a real nats-server: no beat process, one request per
tick with several workers, kept across restarts, and the ``keyqueue schedules`` commands."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

from click.testing import CliRunner
from command_output import Command
from schedule_fleet import QUEUE, Runs, fleet, make_app, worker

import keyqueue
from keyqueue.cli import main
from keyqueue.jetstream.schedules import ScheduleStore
from keyqueue.server.embedded import EmbeddedServer

ROOT = Path(__file__).parents[2]


def every_second(app: keyqueue.App) -> None:
    app.periodic("tick", "work", every=1, kwargs={"key": "clock", "tag": "tick"})


def nightly(app: keyqueue.App) -> None:
    app.periodic("nightly", "work", cron="30 2 * * *", timezone="Europe/Oslo", kwargs={"key": "n", "tag": "nightly"})


def both(app: keyqueue.App) -> None:
    every_second(app)
    nightly(app)


async def stored(url: str) -> dict[str, int]:
    """The periodic schedules on the server, with the sequence each was stored at."""
    runs = Runs()
    app = make_app(url, runs)
    try:
        store = ScheduleStore(await app.connection(), QUEUE)
        return {name: d.seq for name, d in (await store.periodic()).items()}
    finally:
        await app.close()


async def test_three_workers_enqueue_one_request_per_tick(nats_url: str) -> None:
    runs = Runs()
    async with fleet(nats_url, runs, 3, extra=every_second):
        began = dt.datetime.now(dt.UTC)
        await runs.count(4, timeout=30)
        ended = dt.datetime.now(dt.UTC)
        ticks = list(runs.done)
    ids = [r.request_id for r in ticks]
    assert len(set(ids)) == len(ids) and all(i.startswith("tick-") for i in ids), ids
    # Three workers, one tick a second: three requests per tick would be ~3 per second.
    assert len(ids) <= (ended - began).total_seconds() + 2, f"{len(ids)} requests in {ended - began}"
    assert {r.worker for r in ticks} <= {"w0", "w1", "w2"}
    assert not runs.overlaps


async def test_workers_keep_the_servers_schedules_matching_the_app(nats_url: str) -> None:
    runs = Runs()
    async with fleet(nats_url, runs, 3, extra=both):
        first = await stored(nats_url)
    assert set(first) == {"tick", "nightly"}
    async with worker(nats_url, runs, "restarted", extra=both):
        assert await stored(nats_url) == first, "an unchanged schedule was stored again (its timer restarted)"
    async with worker(nats_url, runs, "upgraded", extra=every_second):
        now = await stored(nats_url)
    assert now == {"tick": first["tick"]}, "a schedule the app no longer declares was kept"

    def changed(app: keyqueue.App) -> None:
        app.periodic("tick", "work", every=2, kwargs={"key": "clock", "tag": "tick"})

    async with worker(nats_url, runs, "changed", extra=changed):
        assert (await stored(nats_url))["tick"] > first["tick"]


async def test_schedules_keep_ticking_across_a_server_restart(nats_server: EmbeddedServer) -> None:
    runs = Runs()
    # A short lease: the key a tick holds when the server goes down passes on sooner.
    async with fleet(nats_server.url, runs, 2, ack_wait=3, extra=every_second):
        await runs.count(2, timeout=30)
        await nats_server.restart()
        restarted = dt.datetime.now(dt.UTC)
        await runs.wait(lambda done: sum(r.started > restarted for r in done) >= 2, timeout=60,
                        what="two ticks after the restart")
    ids = [r.request_id for r in runs.done]
    assert len(set(ids)) == len(ids)


async def test_the_schedules_commands(nats_url: str) -> None:
    runs = Runs()
    async with worker(nats_url, runs, "w0", extra=both):
        await runs.count(1, timeout=30)

    def cli(*args: str) -> Callable[[], object]:
        return lambda: CliRunner().invoke(main, [*args, "--url", nats_url])

    listed = await asyncio.to_thread(cli("schedules", QUEUE))
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["NAME", "TASK", "KEY", "SCHEDULE", "TIMEZONE", "NEXT", "RUN", "(UTC)"]
    assert any(line.split()[:5] == ["nightly", "work", "n", "0", "30"] and "Europe/Oslo" in line for line in lines)
    assert any(line.split()[:5] == ["tick", "work", "clock", "every", "1s"] for line in lines)

    as_json = await asyncio.to_thread(cli("schedules", "list", QUEUE, "--json"))
    report = json.loads(as_json.output)
    nightly_row = next(s for s in report["schedules"] if s["name"] == "nightly")
    next_run = dt.datetime.fromisoformat(nightly_row["next_run"]).astimezone(ZoneInfo("Europe/Oslo"))
    assert (next_run.hour, next_run.minute, next_run.second) == (2, 30, 0)
    assert nightly_row["kwargs"] == {"key": "n", "tag": "nightly"}
    # An every= schedule has a next run too (it once showed null), within its interval.
    tick_row = next(s for s in report["schedules"] if s["name"] == "tick")
    tick_next = dt.datetime.fromisoformat(tick_row["next_run"])
    assert abs(tick_next - dt.datetime.now(dt.UTC)) <= dt.timedelta(seconds=2)
    assert not any(line.split()[:5] == ["tick", "work", "clock", "every", "1s"] and "?" in line for line in lines)

    removed = await asyncio.to_thread(cli("schedules", "remove", QUEUE, "nightly"))
    assert removed.exit_code == 0 and "removed" in removed.output
    assert set(await stored(nats_url)) == {"tick"}
    again = await asyncio.to_thread(cli("schedules", "remove", QUEUE, "nightly"))
    assert again.exit_code == 1 and "has no periodic schedule 'nightly'" in again.output
    unknown = await asyncio.to_thread(cli("schedules", "nosuchqueue"))
    assert unknown.exit_code == 1


async def test_the_reminders_example(nats_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    command = await Command.start(sys.executable, "-m", "examples.reminders", cwd=ROOT,
                                  env={**env, "KEYQUEUE_URL": nats_url, "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert await command.wait(timeout=60) == 0, command.output
    lines = [line for line in command.lines if line.startswith(("reminder", "bob", "two-second"))]
    reminders = [line.split(":")[1].split("(")[0].strip() for line in lines if line.startswith("reminder")]
    assert reminders == ["call ada", "drink water", "stand up"], command.output
    assert any(line.startswith("two-second digest") for line in lines), command.output
