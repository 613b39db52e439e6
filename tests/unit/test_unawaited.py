"""The bookkeeping of deletes nobody waits for (``keyqueue.jetstream.unawaited``): pure logic,
with a stand-in client; tests/integration/test_unawaited_deletes.py runs it against nats-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.msg import Msg

from keyqueue.jetstream import unawaited
from keyqueue.jetstream.unawaited import ANSWER_WITHIN, LONGEST_PATIENCE, UnawaitedDeletes


class _Client:
    """Records publishes; subscriptions are kept and never fed (the test calls the handler)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, str]] = []
        self.is_closed = False
        self.is_connected = True

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> Any:
        class Sub:
            _pending_size = 0
        return Sub()

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: Any = None) -> None:
        self.sent.append((subject, payload, reply))


@pytest.mark.parametrize(
    ("answer", "done"),
    [
        (b'{"type":"io.nats.jetstream.api.v1.stream_msg_delete_response","success":true}', True),
        (b'{"type":"x","error":{"code":400,"err_code":10057,"description":"no message found"}}', True),
        (b'{"type":"x","error":{"code":404,"err_code":10059,"description":"stream not found"}}', True),
        (b'{"type":"x","error":{"code":503,"err_code":10008,"description":"unavailable"}}', False),
        (b"", False),
        (b"[1]", False),
        (b"not json", False),
    ],
)
def test_an_answer_is_done_when_the_record_is_gone(answer: bytes, done: bool) -> None:
    assert unawaited._carried_out(answer) is done


def _late_by(deletes: UnawaitedDeletes, seconds: float) -> None:
    """Move every waiting delete's times ``seconds`` into the past, as if that much time had passed."""
    for seq, (due, give_up, patience) in list(deletes._waiting.items()):
        deletes._waiting[seq] = (due - seconds, give_up - seconds, patience)


async def test_answered_deletes_are_forgotten_and_late_ones_sent_again_until_their_record_expires() -> None:
    nc = _Client()
    deletes = UnawaitedDeletes(nc, "$JS.API.STREAM.MSG.DELETE.L")  # type: ignore[arg-type]
    await deletes.send(1, ttl=30)
    await deletes.send(2, ttl=30)
    await deletes.send(3, ttl=0.1)
    assert [(payload, reply) for _, payload, reply in nc.sent] == [
        (b'{"seq":1,"no_erase":true}', "_INBOX.test.1"),
        (b'{"seq":2,"no_erase":true}', "_INBOX.test.2"),
        (b'{"seq":3,"no_erase":true}', "_INBOX.test.3"),
    ]
    deletes._answered(Msg(None, subject="_INBOX.test.1", data=b'{"success":true}'))  # type: ignore[arg-type]
    deletes._answered(Msg(None, subject="_INBOX.test.junk", data=b'{"success":true}'))  # type: ignore[arg-type]
    assert deletes.waiting == 2

    # A second on: 2 is sent again; 3's record has expired (twice its TTL), so it is given up.
    loop = asyncio.get_running_loop()
    _late_by(deletes, ANSWER_WITHIN)
    assert deletes._timer is not None
    deletes._timer.cancel()
    deletes._look()
    await asyncio.gather(*deletes._sending)
    assert nc.sent[3:] == [("$JS.API.STREAM.MSG.DELETE.L", b'{"seq":2,"no_erase":true}', "_INBOX.test.2")]
    assert deletes.sent_again == 1
    assert list(deletes._waiting) == [2]
    # ... and it waits twice as long for this answer, then four times, never more than LONGEST_PATIENCE.
    due, _, patience = deletes._waiting[2]
    assert patience == 2 * ANSWER_WITHIN and due == pytest.approx(loop.time() + patience, abs=0.05)
    assert deletes._timer is not None and deletes._timer.when() == due
    for expected in (4.0, 8.0, LONGEST_PATIENCE):
        _late_by(deletes, deletes._waiting[2][2])
        deletes._look()
        assert deletes._waiting[2][2] == min(expected, LONGEST_PATIENCE)
    await asyncio.gather(*deletes._sending)
    assert deletes.sent_again == 4

    # A new delete is looked at after ANSWER_WITHIN, not after the longer wait armed for 2.
    await deletes.send(4, ttl=30)
    assert deletes._timer is not None and deletes._timer.when() <= loop.time() + ANSWER_WITHIN

    # While disconnected nothing is sent, and the deletes keep waiting for the next look.
    nc.is_connected = False
    sent = len(nc.sent)
    _late_by(deletes, LONGEST_PATIENCE)
    deletes._look()
    assert len(nc.sent) == sent and sorted(deletes._waiting) == [2, 4]

    deletes._answered(Msg(None, subject="_INBOX.test.2", data=b'{"success":true}'))  # type: ignore[arg-type]
    deletes._answered(Msg(None, subject="_INBOX.test.4", data=b'{"success":true}'))  # type: ignore[arg-type]
    assert deletes.waiting == 0
    await deletes.close()
    assert deletes._timer is None
