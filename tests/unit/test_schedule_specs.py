"""Delays and periodic schedules without a server: the checks at the call, cron as nats-server reads
it, and eager mode on a clock the test moves."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest

import keyqueue
from keyqueue.jetstream.cron import at_pattern, cron_pattern, every_pattern, next_cron, next_every, parse_every
from keyqueue.jetstream.due import due_request
from keyqueue.jetstream.schedules import PERIODIC_VERSION, ScheduleNames, require_version
from keyqueue.testing import eager

UTC = dt.UTC


@pytest.mark.parametrize(("given", "sent"), [
    ("0 9 * * mon-fri", "0 0 9 * * mon-fri"),
    ("*/15 * * * * *", "*/15 * * * * *"),
    ("@daily", "@daily"),
    ("  0  0 12 1 jan ?  ", "0 0 12 1 jan ?"),
    ("5/10 * * * *", "0 5/10 * * * *"),
    # Sunday as 7, as many crontabs write it: nats-server takes only 0, so 7 is rewritten.
    ("0 9 * * 7", "0 0 9 * * 0"),
    ("0 9 * * 5-7", "0 0 9 * * 0,5,6"),
    ("0 0 9 * * 1,7", "0 0 9 * * 0,1"),
])
def test_cron_expressions_the_server_reads(given: str, sent: str) -> None:
    assert cron_pattern(given) == sent


@pytest.mark.parametrize(("given", "says"), [
    ("0 9 * *", "has 4 fields"),
    ("0 0 9 * * 8", "day of week field '8' is outside 0-6"),
    ("61 * * * *", "minute field '61' is outside 0-59"),
    ("0 0 9 L * *", "'L' is not a number"),
    ("0 0 9 * * MON#2", "'MON#2' is not a number"),
    ("0 0 9 5-1 * *", "starts after it ends"),
    ("0 0 9 * * */0", "the step must be positive"),
    ("@reboot", "the named schedules are"),
    ("0 0 0 30 2 *", "never fires"),
    ("", "non-empty"),
])
def test_cron_expressions_the_server_would_refuse(given: str, says: str) -> None:
    with pytest.raises(keyqueue.InvalidSchedule, match=says.replace("(", r"\(").replace("*", r"\*")):
        cron_pattern(given)


def test_next_cron_in_a_time_zone_and_every() -> None:
    oslo = ZoneInfo("Europe/Oslo")
    fire = next_cron("0 30 2 * * *", oslo, dt.datetime(2026, 3, 30, 12, 0, tzinfo=UTC))  # in summer time
    assert fire is not None and fire.isoformat() == "2026-03-31T02:30:00+02:00"
    fire = next_cron("0 30 2 * * *", oslo, dt.datetime(2026, 1, 10, 12, 0, tzinfo=UTC))  # in winter time
    assert fire is not None and fire.astimezone(UTC).isoformat() == "2026-01-11T01:30:00+00:00"
    weekday = next_cron("0 0 9 * * mon-fri", ZoneInfo("UTC"), dt.datetime(2026, 11, 21, 10, tzinfo=UTC))  # Saturday
    assert weekday == dt.datetime(2026, 11, 23, 9, tzinfo=ZoneInfo("UTC"))
    since = dt.datetime(2026, 1, 1, 0, 0, 0, 400_000, tzinfo=UTC)
    assert next_every(60, since, since) == dt.datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    later = since + dt.timedelta(minutes=5, seconds=1)
    assert next_every(60, since, later) == dt.datetime(2026, 1, 1, 0, 6, tzinfo=UTC)
    assert every_pattern(parse_every(dt.timedelta(minutes=1))) == "@every 60s"
    assert every_pattern(parse_every(1.5)) == "@every 1500ms"
    assert at_pattern(dt.datetime(2030, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1)))) == \
        "@at 2030-01-01T00:00:00Z"


@pytest.mark.parametrize(("every", "says"), [(0, "positive"), (-5, "positive"), (0.5, "at least 1 second"),
                                             ("10", "number of seconds")])
def test_bad_intervals(every: Any, says: str) -> None:
    with pytest.raises(keyqueue.InvalidSchedule, match=says):
        parse_every(every)


def test_periodic_declarations_are_checked_at_the_call() -> None:
    app = keyqueue.App("specs", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)

    @app.task(key="{key}")
    async def work(key: str, n: int) -> int:
        return n

    with pytest.raises(keyqueue.InvalidSchedule, match="not both or neither"):
        app.periodic("p", work, kwargs={"key": "k", "n": 1})
    with pytest.raises(keyqueue.InvalidSchedule, match="applies to cron= only"):
        app.periodic("p", work, every=60, timezone="Europe/Oslo", kwargs={"key": "k", "n": 1})
    with pytest.raises(keyqueue.InvalidSchedule, match="not an IANA time zone"):
        app.periodic("p", work, cron="@daily", timezone="Mars/Olympus", kwargs={"key": "k", "n": 1})
    with pytest.raises(keyqueue.InvalidSchedule, match="name"):
        app.periodic("has space", work, every=60, kwargs={"key": "k", "n": 1})
    with pytest.raises(TypeError, match="'n' must be int"):
        app.periodic("p", work, every=60, kwargs={"key": "k", "n": "one"})
    declared = app.periodic("p", "work", cron="0 9 * * *", kwargs={"key": "k", "n": 1})
    assert (declared.pattern, declared.key, declared.queue) == ("0 0 9 * * *", "k", "specs")
    with pytest.raises(keyqueue.ConfigError, match="already has a periodic schedule"):
        app.periodic("p", work, every=60, kwargs={"key": "k", "n": 1})


def test_an_old_server_is_named() -> None:
    old = SimpleNamespace(connected_server_version=SimpleNamespace(major=2, minor=11, patch=4),
                          connected_url=SimpleNamespace(netloc="127.0.0.1:4222"))
    with pytest.raises(keyqueue.InvalidSchedule, match=r"need nats-server >= 2.14.0 .* is 2.11.4"):
        require_version(old, PERIODIC_VERSION, "periodic schedules")  # type: ignore[arg-type]


def test_a_due_message_becomes_an_inbox_request() -> None:
    names = ScheduleNames("q")
    fired = {"X-MESSAGE-TYPE": "t", "X-KQ-Delayed-Request-Id": "r1", "Nats-Scheduler": "kq.q.at.r1",
             "Nats-Schedule-Next": "purge"}
    delayed = due_request("kq.q.due.a.b", fired, b"x", 7, names)
    assert (delayed.key, delayed.request_id, dict(delayed.headers)) == \
        ("a.b", "r1", {"X-MESSAGE-TYPE": "t", "Nats-Msg-Id": "r1"})
    tick = due_request("kq.q.due.k", {"X-KQ-Periodic": "nightly", "Nats-Scheduler": "kq.q.periodic.nightly"}, b"",
                       42, names)
    assert (tick.request_id, tick.headers["Nats-Msg-Id"]) == ("nightly-42", "nightly-42")


async def test_eager_mode_runs_delays_and_ticks_on_the_tests_clock() -> None:
    app = keyqueue.App("eager-clock", set_as_default=False, autoload_plugins=False)
    ran: list[str] = []

    @app.task(key="{key}")
    async def work(key: str, tag: str) -> str:
        ran.append(tag)
        return tag

    app.periodic("tick", work, every=60, kwargs={"key": "clock", "tag": "tick"})
    with eager(app) as runner:
        start = runner.now
        receipt = await work.options(countdown=30).enqueue(key="k", tag="later")
        await work.options(eta=start + dt.timedelta(seconds=10)).enqueue(key="k", tag="sooner")
        await work.enqueue(key="k", tag="now")
        assert receipt.due == start + dt.timedelta(seconds=30) and ran == ["now"]
        await runner.advance(9.9)
        assert ran == ["now"]
        await runner.advance(0.1)
        assert ran == ["now", "sooner"]
        await runner.advance(50)
        assert ran == ["now", "sooner", "later", "tick"]
        await runner.advance_to(start + dt.timedelta(minutes=3))
        assert ran[-2:] == ["tick", "tick"] and runner.now == start + dt.timedelta(minutes=3)
        # Waiting for a delayed request's result is the clock passing its due time.
        assert await work.options(countdown=120).call(key="c", tag="called") == "called"
        assert runner.now == start + dt.timedelta(minutes=5) and ran[-3:] == ["tick", "called", "tick"]
        with pytest.raises(keyqueue.InvalidSchedule, match="naive"):
            await work.options(eta=dt.datetime(2030, 1, 1)).enqueue(key="k", tag="x")
        with pytest.raises(keyqueue.InvalidSchedule, match="only moves forward"):
            await runner.advance(-1)


async def test_a_delayed_request_cancelled_in_eager_mode_never_runs() -> None:
    app = keyqueue.App("eager-cancel", set_as_default=False, autoload_plugins=False)
    ran: list[str] = []

    @app.task(key="{key}")
    async def work(key: str, tag: str) -> None:
        ran.append(tag)

    with eager(app) as runner:
        receipt = await work.options(countdown=10).enqueue(key="k", tag="cancelled")
        await work.options(countdown=10).enqueue(key="k", tag="kept")
        assert await receipt.cancel() == "cancelled"
        await runner.advance(10)
    assert ran == ["kept"]
