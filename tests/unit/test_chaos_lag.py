"""The soak's watch of its own event loop, which carries every worker's fault proxy."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

from loop_turns import LoopTurns

from keyqueue.chaos.checker import check
from keyqueue.chaos.fleet import Fleet, LogTail, LoopLag
from keyqueue.chaos.soak import SoakResult


class Notes:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def note(self, w: str, kind: str, **fields: Any) -> None:
        self.records.append((w, kind, fields))


async def test_a_loop_held_past_the_tick_is_noted_once_with_how_late_it_ran() -> None:
    notes = Notes()
    lag = LoopLag(cast(Fleet, notes))
    until = asyncio.Event()
    watching = asyncio.create_task(lag.run(until))
    await asyncio.sleep(0)  # the watch is waiting on its tick
    time.sleep(0.6)  # noqa: ASYNC251 - the loop is held, as a busy soak process holds it
    await asyncio.sleep(LoopLag.TICK * 2)  # the watch wakes, late
    until.set()
    await watching
    held = [fields["seconds"] for w, kind, fields in notes.records if (w, kind) == ("soak", "lag")
            and fields["seconds"] >= 0.4]
    assert len(held) == 1 and held[0] <= 2.0, notes.records
    assert [round(x, 3) for x in lag.lags] == [fields["seconds"] for _, _, fields in notes.records]


def test_the_summary_says_when_the_soaks_own_loop_ran_late() -> None:
    result = SoakResult(check([], {}), Counter(), 1.0, 0, Path("run.jsonl"), lags=(0.3, 2.9))
    assert "ran late 2 times, at most 2.90s" in result.summary()
    assert "ran late" not in SoakResult(check([], {}), Counter(), 1.0, 0, Path("run.jsonl")).summary()


async def test_the_log_is_parsed_off_the_soaks_loop(tmp_path: Path) -> None:
    # Parsing a long soak's whole log on the loop held every worker's proxy for seconds.
    log = tmp_path / "run.jsonl"
    log.write_text('{"w": "w1", "kind": "ready", "t": 1.0}\n{"w": "w1", "kind": "start", "t": 2.0}\n{"w": "w')
    tail = LogTail(log)
    parsed_on: list[threading.Thread] = []
    parse = tail.new_records

    def on_which_thread() -> list[dict[str, object]]:
        parsed_on.append(threading.current_thread())
        return parse()

    tail.new_records = on_which_thread  # type: ignore[method-assign]
    assert [r["kind"] for r in await tail.read()] == ["ready", "start"]  # the unfinished line waits
    assert parsed_on and parsed_on[0] is not threading.main_thread()
    with log.open("a") as more:
        more.write('2", "kind": "ready", "t": 3.0}\n')
    assert [(r["w"], r["kind"]) for r in await tail.read()] == [("w2", "ready")]


async def test_reads_at_once_each_take_their_own_lines(tmp_path: Path) -> None:
    # Reads run in threads: two at once (a restart's wait for ready beside another) must not both
    # take the same lines, nor move the offset twice past them.
    log = tmp_path / "run.jsonl"
    log.write_text("".join(f'{{"w": "w1", "kind": "ready", "t": {n}}}\n' for n in range(20_000)))
    tail = LogTail(log)
    first, second = await asyncio.gather(tail.read(), tail.read())
    assert sorted(r["t"] for r in [*first, *second]) == list(range(20_000))  # type: ignore[type-var]
    with log.open("a") as more:
        more.write('{"w": "w2", "kind": "ready", "t": 1.5}\n')
    assert [r["w"] for r in await tail.read()] == ["w2"]


class _SlowToReap:
    """A process that ends some tenths of a second after its SIGKILL, as a big worker does."""

    pid = 0  # never signalled: the test replaces os.kill

    def __init__(self) -> None:
        self.reaped_in: str | None = None

    def poll(self) -> int | None:
        return None

    def wait(self) -> int:
        time.sleep(0.4)
        self.reaped_in = threading.current_thread().name
        return -9


async def test_a_killed_worker_is_reaped_off_the_soaks_loop(tmp_path: Path, monkeypatch: Any) -> None:
    # Fleet.kill waited for the killed process on the soak's loop: each kill -9 held every worker's
    # proxy for as long as the process took to end (the loop watch saw 0.3-0.4 s).
    from keyqueue.chaos.fleet import WorkerSpec

    fleet = Fleet(WorkerSpec("q", ack_wait=2.0, concurrency=1, replicas=1), {"w0": "nats://127.0.0.1:1"},
                  tmp_path / "run.jsonl")
    proc = _SlowToReap()
    fleet.procs["w0"] = cast(Any, proc)
    monkeypatch.setattr("os.kill", lambda pid, sig: None)
    try:
        async with LoopTurns(every=0.01) as turns:
            await fleet.kill("w0")
    finally:
        os.close(fleet.fd)
    assert proc.reaped_in is not None and proc.reaped_in != threading.main_thread().name
    assert turns.count >= 10  # the loop ran on through the 0.4 s the process took to end
    assert [r["kind"] for r in LogTail(tmp_path / "run.jsonl").new_records()] == ["killed"]
