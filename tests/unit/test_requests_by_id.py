"""Requests by id without a server: request id rules, result_ttl checks, results and cancels in eager mode."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import keyqueue
from keyqueue.app.cancel import CancelWatch
from keyqueue.jetstream.records import CANCEL_STATE
from keyqueue.jetstream.subjects import request_id_token, validate_request_id
from keyqueue.tasks.rate_limit import RateLimit, parse_rate_limit
from keyqueue.testing import eager
from keyqueue.wire import headers as H


def test_request_ids_are_what_a_header_carries() -> None:
    for good in ("charge-o17-1", "01J9ZQ4R3M5V6W7X8Y9Z0A1B2C", "import:2024-05-01/7", "a.b*c>", "x" * 256):
        assert validate_request_id(good) == good
    for bad in ("", " lead", "two words", "tab\there", "cr\rlf\n", "é", "x" * 257):
        with pytest.raises(keyqueue.InvalidRequestId):
            validate_request_id(bad)
    with pytest.raises(keyqueue.InvalidRequestId, match="must be a string"):
        validate_request_id(17)  # type: ignore[arg-type]


def test_a_request_id_becomes_one_subject_token() -> None:
    assert request_id_token("01J9ZQ4R3M5V6W7X8Y9Z0A1B2C") == "01J9ZQ4R3M5V6W7X8Y9Z0A1B2C"
    tokens = {request_id_token(i) for i in ("a.b", "a*", "a>", "a/b", "a.b.")}
    assert len(tokens) == 5
    assert all(t.startswith("~") and not set(t) & set(".*> ") for t in tokens)


def test_result_ttl_is_checked_at_declaration() -> None:
    app = keyqueue.App("shop", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)
    with pytest.raises(keyqueue.ConfigError, match="result_ttl must be at least 1 second"):
        app.task(key="{k}", result_ttl=0.5)(lambda k: k)
    with pytest.raises(keyqueue.ConfigError, match="result_ttl must be at least 1 second"):
        keyqueue.App("shop", url="nats://127.0.0.1:1", set_as_default=False, result_ttl=0)


async def test_results_and_cancels_in_eager_mode() -> None:
    app = keyqueue.App("shop", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)
    ran: list[int] = []

    @app.task(key="{order}", result_ttl=60, max_attempts=1)
    async def charge(order: str, amount: int) -> dict[str, int]:
        ran.append(amount)
        if amount < 0:
            raise ValueError("negative")
        return {"charged": amount}

    @app.task(key="{order}")
    async def note(order: str) -> None:
        return None

    with eager(app, autorun=False, propagate=False) as runner:
        first = await charge.enqueue(order="o1", amount=1)
        second = await charge.enqueue(order="o1", amount=2)
        failed = await charge.enqueue(order="o2", amount=-1)
        noted = await note.enqueue(order="o3")
        with pytest.raises(keyqueue.KeyqueueTimeout):
            await first.result(timeout=0)
        assert await second.cancel() == "cancelled"
        await runner.drain()
        assert ran == [1, -1]
        assert runner.cancelled == [second.request_id]
        assert await first.result() == {"charged": 1}
        assert await app.result(first.request_id) == {"charged": 1}
        with pytest.raises(keyqueue.Cancelled):
            await second.result()
        with pytest.raises(keyqueue.DeadLettered, match="negative"):
            await failed.result()
        with pytest.raises(keyqueue.ResultNotKept, match="note keeps no results"):
            await noted.result()
        assert await first.cancel() == "done"
        with pytest.raises(keyqueue.InvalidRequestId):
            await charge.options(request_id="not ok").enqueue(order="o1", amount=1)


def test_rate_limits_are_parsed_at_declaration() -> None:
    assert parse_rate_limit("10/m") == RateLimit(10, 60.0, "10/m")
    assert (parse_rate_limit(" 3 / s").count, parse_rate_limit("1/h").period) == (3, 3600.0)
    app = keyqueue.App("shop", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)
    for bad in ("10", "10/d", "0/m", "-1/s", "ten/m", "10/min", ""):
        with pytest.raises(keyqueue.ConfigError, match="is not a rate: write N/s, N/m or N/h"):
            app.task(key="{k}", rate_limit=bad)


def test_a_rate_limit_waits_for_the_oldest_run_to_leave_the_window() -> None:
    limit = RateLimit(2, 60.0)
    assert limit.wait([], 100.0) == 0.0
    assert limit.wait([90.0], 100.0) == 0.0
    assert limit.wait([50.0, 90.0], 100.0) == 10.0  # 50 + 60 - 100
    assert limit.wait([10.0, 30.0], 100.0) == 0.0  # both left the window
    assert limit.window([10.0, 50.0, 90.0, 95.0], 100.0) == [90.0, 95.0]


async def test_rate_limits_in_eager_mode_on_the_runners_clock() -> None:
    app = keyqueue.App("shop", url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)
    runs: list[tuple[str, int, float]] = []

    with eager(app) as runner:
        start = runner.now.timestamp()

        @app.task(key="{user}", rate_limit="2/m")
        async def ping(user: str, n: int) -> None:
            runs.append((user, n, runner.now.timestamp() - start))

        for n in range(5):
            await ping.enqueue(user="u1", n=n)
        assert runner.rate_waits == [60.0, 60.0]
        await ping.enqueue(user="u2", n=0)
        await ping.enqueue(user="u2", n=1)
        await runner.advance(30)
        await ping.enqueue(user="u1", n=5)  # at 150 only u1's run at 120 is inside its window
        await ping.enqueue(user="u1", n=6)  # ... and now the one at 150 too: it waits until 180
    assert runs == [("u1", 0, 0.0), ("u1", 1, 0.0), ("u1", 2, 60.0), ("u1", 3, 60.0), ("u1", 4, 120.0),
                    ("u2", 0, 120.0), ("u2", 1, 120.0), ("u1", 5, 150.0), ("u1", 6, 180.0)]
    assert runner.rate_waits == [60.0, 60.0, 30.0]


class _Records:
    """The part of ``RequestRecords`` a ``CancelWatch`` answers through, in memory."""

    def __init__(self) -> None:
        self.nc = SimpleNamespace(stats={"reconnects": 0})
        self.state: dict[str, tuple[str, int]] = {}

    async def cancel_state(self, request_id: str) -> tuple[str, int] | None:
        return self.state.get(request_id)

    async def answer_cancel(self, request_id: str, state: str, expected_last: int) -> int:
        assert self.state[request_id][1] == expected_last
        self.state[request_id] = (state, expected_last + 1)
        return expected_last + 1


def _record(request_id: str, state: str = "requested") -> Any:
    return SimpleNamespace(headers={CANCEL_STATE: state, H.REQUEST_ID: request_id})


async def test_a_cancel_and_a_start_on_one_loop_always_see_each_other() -> None:
    records = _Records()
    watch = CancelWatch(records)  # type: ignore[arg-type]
    # The cancel comes first: the request never starts.
    records.state["r1"] = ("requested", 1)
    await watch._on_record(_record("r1"))
    assert watch.start_run("r1") is None
    # The start comes first: the cancel finds it running, the run sees it, and the answer is "running".
    flag = watch.start_run("r2")
    assert flag is not None and not flag()
    records.state["r2"] = ("requested", 5)
    await watch._on_record(_record("r2"))
    assert flag()
    await watch.close()  # waits for the answer in flight
    assert records.state["r2"] == ("running", 6)
    # Finished lately: "done".
    watch = CancelWatch(records)  # type: ignore[arg-type]
    assert watch.start_run("r3") is not None
    watch.end_run("r3")
    records.state["r3"] = ("requested", 9)
    await watch._on_record(_record("r3"))
    await watch.close()
    assert records.state["r3"] == ("done", 10)
    # Another worker's answer "cancelled" also keeps the request from starting here.
    await watch._on_record(_record("r4", "cancelled"))
    assert watch.start_run("r4") is None
