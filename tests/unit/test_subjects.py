"""The rules for subjects keyqueue takes from messages and publishes to (pure logic; the server's
side of them: tests/integration/test_hostile_requests.py)."""

from __future__ import annotations

import pytest

from keyqueue.core.processor import Request
from keyqueue.errors import InvalidSubject
from keyqueue.jetstream.subjects import MAX_CONTROL_LINE, MAX_SUBJECT_LENGTH, check_publish_line, validate_subject


@pytest.mark.parametrize("subject", ["_INBOX.abc.1", "_INBOX.ünï.2", "a" * MAX_SUBJECT_LENGTH])
def test_a_subject_nats_carries_is_accepted(subject: str) -> None:
    assert validate_subject(subject, "an inbox") == subject


@pytest.mark.parametrize(("subject", "reason"), [
    ("", "empty"),
    ("a" * (MAX_SUBJECT_LENGTH + 1), "bytes long"),
    ("é" * (MAX_SUBJECT_LENGTH // 2 + 1), "bytes long"),
    ("_INBOX..1", "empty token"),
    ("_INBOX.1.", "empty token"),
    ("_INBOX.a b", "' '"),
    ("_INBOX.a\tb", "'\\\\t'"),
    ("_INBOX.a\x00b", "'\\\\x00'"),
    ("_INBOX.*", "'\\*'"),
    ("_INBOX.>", "'>'"),
])
def test_a_subject_nats_cannot_carry_is_refused_with_its_reason(subject: str, reason: str) -> None:
    with pytest.raises(InvalidSubject, match=reason) as caught:
        validate_subject(subject, "the reply inbox")
    assert caught.value.what == "the reply inbox"
    assert len(str(caught.value)) < 400  # a long subject is cut in the message


def test_a_publish_line_is_refused_only_past_the_servers_control_line() -> None:
    room = MAX_CONTROL_LINE - 64
    check_publish_line("s" * (room - 40), "r" * 40)
    with pytest.raises(InvalidSubject, match="max_control_line"):
        check_publish_line("s" * (room - 40), "r" * 41)
    with pytest.raises(InvalidSubject):
        check_publish_line("é" * (room // 2 + 1))


def test_a_request_checks_each_header_that_becomes_a_subject() -> None:
    def request(**headers: str) -> Request:
        return Request("k", 1, "kq.q.inbox.k", {"Nats-Msg-Id": "r1", **headers}, b"")

    request().check_subjects()
    request(**{"X-Reply-Inbox": "_INBOX.ok.1"}).check_subjects()
    with pytest.raises(InvalidSubject, match="X-Reply-Inbox"):
        request(**{"X-Reply-Inbox": "_INBOX.not ok"}).check_subjects()
    with pytest.raises(InvalidSubject, match="request id"):
        request(**{"Nats-Msg-Id": "r" * 257}).check_subjects()
