"""``batch_read``: what a batched direct get's replies say (the key's first requests, and whether more remain)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg

from keyqueue.errors import KeyqueueError
from keyqueue.jetstream.queue_io import batch_read


def reply(headers: dict[str, str], data: bytes = b"") -> Any:
    return Msg(None, subject="_INBOX.x", data=data, headers=headers)  # type: ignore[arg-type]


def stored(seq: int) -> Any:
    return reply({"Nats-Subject": "kq.shop.in.o1", "Nats-Sequence": str(seq), "Nats-Msg-Id": f"r{seq}",
                  "X-MESSAGE-TYPE": "charge"}, b"body%d" % seq)


def test_requests_in_order_then_the_end_of_batch_says_more_remain() -> None:
    msgs, more = batch_read([stored(3), stored(7), reply({"Status": "204", "Nats-Num-Pending": "2"})])
    assert [(m.seq, m.subject, m.data) for m in msgs] == [(3, "kq.shop.in.o1", b"body3"),
                                                          (7, "kq.shop.in.o1", b"body7")]
    assert msgs[0].headers == {"Nats-Msg-Id": "r3", "X-MESSAGE-TYPE": "charge"}
    assert more


def test_nothing_left_after_them() -> None:
    assert batch_read([stored(3), reply({"Status": "204", "Nats-Num-Pending": "0"})])[1] is False


def test_no_request_is_a_404() -> None:
    assert batch_read([reply({"Status": "404"})]) == ([], False)


def test_another_status_is_its_error() -> None:
    with pytest.raises(KeyqueueError):
        batch_read([reply({"Status": "408", "Description": "Request Timeout"})])
