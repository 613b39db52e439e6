"""A worker's slots (core/slots.py): parked sessions lend their slot and get one back first."""

from __future__ import annotations

import asyncio

from keyqueue.core.slots import Slots


async def test_a_parked_session_lends_its_slot_and_takes_one_back_before_new_keys() -> None:
    held = {"n": 2}
    freed: list[int] = []
    slots = Slots(2, lambda: held["n"], freed=lambda: freed.append(1))
    stopping = asyncio.Event()
    assert slots.free() == 0
    back = asyncio.Event()

    async def parked() -> None:
        async with slots.parked_while(stopping):
            await back.wait()

    session = asyncio.create_task(parked())
    await asyncio.sleep(0)
    assert (slots.free(), freed) == (1, [1])  # lent: a new key may come in
    held["n"] = 3  # it did
    back.set()  # the parked session's backoff ends: no slot is free, so it waits, ahead of new keys
    await asyncio.sleep(0)
    assert not session.done() and slots.free() == -1
    held["n"] = 2  # another session ended
    await slots.changed()
    await session
    assert (slots.parked, slots.resuming, slots.free()) == (0, 0, 0)


async def test_a_draining_worker_lets_parked_sessions_go_on_without_a_slot() -> None:
    slots = Slots(1, lambda: 2)
    stopping = asyncio.Event()

    async def parked() -> None:
        async with slots.parked_while(stopping):
            pass

    session = asyncio.create_task(parked())
    await asyncio.sleep(0)
    assert not session.done()  # no slot
    stopping.set()
    await slots.changed()
    await session
    assert slots.parked == 0
