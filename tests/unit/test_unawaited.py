"""The bookkeeping of deletes nobody waits for (``keyqueue.jetstream.unawaited``): pure logic,
with a stand-in client; tests/integration/test_unawaited_deletes.py runs it against nats-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.msg import Msg

from keyqueue.jetstream import unawaited
from keyqueue.jetstream.unawaited import ANSWER_WITHIN, UnawaitedDeletes


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
    for seq, (sent, give_up) in list(deletes._waiting.items()):
        deletes._waiting[seq] = (sent - ANSWER_WITHIN, give_up - ANSWER_WITHIN)
    assert deletes._timer is not None
    deletes._timer.cancel()
    deletes._look()
    await asyncio.gather(*deletes._sending)
    assert nc.sent[3:] == [("$JS.API.STREAM.MSG.DELETE.L", b'{"seq":2,"no_erase":true}', "_INBOX.test.2")]
    assert deletes.sent_again == 1
    assert list(deletes._waiting) == [2]
    assert deletes._timer is not None and deletes._timer.when() > loop.time()

    # While disconnected nothing is sent, and the delete keeps waiting for the next look.
    nc.is_connected = False
    deletes._waiting[2] = (loop.time() - ANSWER_WITHIN, loop.time() + 60)
    deletes._look()
    assert len(nc.sent) == 4 and list(deletes._waiting) == [2]

    deletes._answered(Msg(None, subject="_INBOX.test.2", data=b'{"success":true}'))  # type: ignore[arg-type]
    assert deletes.waiting == 0
    await deletes.close()
    assert deletes._timer is None
