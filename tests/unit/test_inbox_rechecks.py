"""``InboxRechecks``: the re-checks asked in one turn of the loop are one read; each key gets its own answer."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from keyqueue.errors import ReplyLost
from keyqueue.jetstream.rechecks import InboxRechecks, remains


def test_a_request_remains_when_the_last_one_is_at_or_after_the_cursor() -> None:
    assert remains(7, 7) and remains(9, 7)
    assert not remains(6, 7) and not remains(None, 1)


class Inboxes:
    """The last stored sequence of each key, and every read asked of it."""

    def __init__(self, last: dict[str, int]) -> None:
        self.last = last
        self.reads: list[list[str]] = []
        self.fail: Exception | None = None

    async def __call__(self, keys: list[str]) -> Mapping[str, int]:
        self.reads.append(keys)
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        return {k: self.last[k] for k in keys if k in self.last}


async def test_keys_asked_together_are_one_read_and_each_gets_its_answer() -> None:
    inboxes = Inboxes({"a": 5, "b": 3, "c": 9})
    rechecks = InboxRechecks(inboxes)
    answers = await asyncio.gather(rechecks.remains("a", 5), rechecks.remains("b", 4), rechecks.remains("c", 2),
                                   rechecks.remains("d", 1))
    assert list(answers) == [True, False, True, False]  # gather gives a list (typed as a tuple)
    assert inboxes.reads == [["a", "b", "c", "d"]]
    # The next turn's asks are the next read.
    assert await rechecks.remains("a", 6) is False
    assert inboxes.reads[1:] == [["a"]]


async def test_a_big_turn_is_several_reads_of_at_most_the_batch() -> None:
    inboxes = Inboxes({f"k{i}": i for i in range(10)})
    rechecks = InboxRechecks(inboxes, batch_keys=4)
    answers = await asyncio.gather(*(rechecks.remains(f"k{i}", 5) for i in range(10)))
    assert answers == [i >= 5 for i in range(10)]
    assert [len(keys) for keys in inboxes.reads] == [4, 4, 2]


async def test_a_failed_read_is_everyones_answer_and_the_next_asks_read_again() -> None:
    inboxes = Inboxes({"a": 5})
    inboxes.fail = ReplyLost("the connection dropped")
    rechecks = InboxRechecks(inboxes)
    results = await asyncio.gather(rechecks.remains("a", 1), rechecks.remains("b", 1), return_exceptions=True)
    assert [type(r) for r in results] == [ReplyLost, ReplyLost]
    inboxes.fail = None
    assert await rechecks.remains("a", 1) is True


async def test_the_sender_cut_off_before_it_sent_leaves_no_one_waiting() -> None:
    inboxes = Inboxes({"a": 5})
    rechecks = InboxRechecks(inboxes)
    first = asyncio.ensure_future(rechecks.remains("a", 1))
    second = asyncio.ensure_future(rechecks.remains("b", 1))
    await asyncio.sleep(0)  # both asked; the first waits for the turn to end to send for both
    first.cancel()
    with pytest.raises(ReplyLost):  # the second asks again, as a session's re-check does
        await second
    assert first.cancelled() and inboxes.reads == []
    assert await rechecks.remains("a", 1) is True
