"""A publish's acknowledgement: the plain ones read without the JSON decoder, the others by it,
with the same answers (the bytes are nats-server's own spellings, seen on 2.15)."""

from __future__ import annotations

import json

import pytest
from nats.aio.msg import Msg

from keyqueue.errors import ConnectionFailed, JetStreamError, WrongLastSequence
from keyqueue.jetstream import api
from keyqueue.jetstream.api import PubAck, parse_pub_ack


def reply(data: bytes, headers: dict[str, str] | None = None) -> Msg:
    return Msg(None, subject="_INBOX.x", data=data, headers=headers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "ack", "plain"),
    [
        (b'{"stream":"KQ_orders","seq":1}', PubAck("KQ_orders", 1, False), True),
        (b'{"stream":"S","seq":18446744073709551615}', PubAck("S", 18446744073709551615, False), True),
        (b'{"stream":"S","domain":"hub","seq":42}', PubAck("S", 42, False), True),
        (b'{"stream":"S","seq":2,"duplicate": true}', PubAck("S", 2, True), False),
        (b'{"stream":"S\\u00e9","seq":3}', PubAck("S\u00e9", 3, False), False),
        ('{"stream":"S\u00e9","seq":3}'.encode(), PubAck("S\u00e9", 3, False), False),
        (b'{ "stream": "S", "seq": 4 }', PubAck("S", 4, False), False),
        (b'{"seq":5,"stream":"S"}', PubAck("S", 5, False), False),
    ],
)
def test_a_stored_publish_reads_the_same_with_or_without_the_decoder(
        data: bytes, ack: PubAck, plain: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_pub_ack(reply(data)) == ack
    assert (api._PLAIN_PUB_ACK.fullmatch(data) is not None) is plain
    decoded: list[bytes] = []
    real_loads = json.loads

    def loads(data: bytes) -> object:
        decoded.append(data)
        return real_loads(data)

    monkeypatch.setattr(json, "loads", loads)
    assert parse_pub_ack(reply(data)) == ack
    assert decoded == ([] if plain else [data])


def test_a_refused_publish_still_raises_its_typed_error() -> None:
    refused = b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 2"},"stream":"S","seq":0}'
    with pytest.raises(WrongLastSequence):
        parse_pub_ack(reply(refused))
    with pytest.raises(JetStreamError, match="unreadable"):
        parse_pub_ack(reply(b'{"stream":"S","seq":1'))
    with pytest.raises(JetStreamError, match="unreadable"):  # not UTF-8: the decoder's refusal, typed
        parse_pub_ack(reply(b'{"stream":"S\xff","seq":1}'))


def test_a_no_responders_status_is_not_read_as_an_ack() -> None:
    """A 503 has headers and an empty body: the plain form is tried only on a reply without headers."""
    with pytest.raises(ConnectionFailed, match="no JetStream stream answered"):
        parse_pub_ack(reply(b"", {"Status": "503"}))
