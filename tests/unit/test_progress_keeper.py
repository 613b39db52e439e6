"""``ProgressKeeper`` alone: a run's progress coalesced on its way to the records stream (the first
value at once, then at most one write per interval carrying the latest, the last one at the end)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import pytest

from keyqueue.app.progress import ProgressKeeper
from keyqueue.errors import KeyqueueTimeout, LeaseLost


class Store:
    """Records the values written; each write may be held until the test lets it finish."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.values: list[bytes] = []
        self.wrote = asyncio.Event()
        self.fail_with = fail_with

    async def write(self, body: bytes, headers: Mapping[str, str]) -> None:
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        self.values.append(body)
        self.wrote.set()

    async def next_write(self) -> None:
        async with asyncio.timeout(10):
            await self.wrote.wait()
        self.wrote.clear()


async def _settle() -> None:
    """Let the keeper's task run whatever it can without time passing."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_first_value_is_written_at_once_and_a_burst_only_by_its_last_value_at_close() -> None:
    store = Store()
    keeper = ProgressKeeper(store.write, interval=3600)  # no interval ends during the test
    keeper.offer(b"0", {})
    await store.next_write()
    for n in range(1, 100):
        keeper.offer(str(n).encode(), {})
    await _settle()
    assert store.values == [b"0"], "the burst waits for the interval"
    await keeper.close()
    assert store.values == [b"0", b"99"] and keeper.written == 2
    keeper.offer(b"late", {})  # after the run: ignored
    await _settle()
    assert store.values == [b"0", b"99"]


async def test_each_interval_writes_the_latest_value_then_the_keeper_goes_quiet() -> None:
    store = Store()
    keeper = ProgressKeeper(store.write, interval=0.01)
    keeper.offer(b"a", {})
    await store.next_write()
    keeper.offer(b"b", {})
    keeper.offer(b"c", {})
    await store.next_write()  # the interval's end carries the latest
    assert store.values == [b"a", b"c"]
    await keeper.close()  # nothing new: nothing more written
    assert store.values == [b"a", b"c"]


async def test_a_run_with_no_progress_writes_nothing_and_a_cut_off_run_drops_what_waits() -> None:
    idle = Store()
    await ProgressKeeper(idle.write).close()
    assert idle.values == []
    store = Store()
    keeper = ProgressKeeper(store.write, interval=3600)
    keeper.offer(b"1", {})
    await store.next_write()
    keeper.offer(b"2", {})
    await keeper.close(flush=False)
    assert store.values == [b"1"]


async def test_a_failed_write_is_logged_and_the_next_value_tries_again_a_lost_lease_ends_the_writing(
        caplog: pytest.LogCaptureFixture) -> None:
    store = Store(fail_with=KeyqueueTimeout("no answer"))
    keeper = ProgressKeeper(store.write, interval=3600, describe="request r1 (key k)")
    keeper.offer(b"1", {})
    await _settle()
    keeper.offer(b"2", {})
    await keeper.close()
    assert store.values == [b"2"]
    assert "the progress of request r1 (key k) was not kept (the next one tries again): no answer" in caplog.text
    lost = Store(fail_with=LeaseLost("gone"))
    keeper = ProgressKeeper(lost.write, interval=0.01)
    keeper.offer(b"1", {})
    await _settle()
    keeper.offer(b"2", {})
    await keeper.close()
    assert lost.values == [], "a run whose key is lost writes no more"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "gone" in r.getMessage()]
