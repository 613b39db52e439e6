"""The dead-letter copy: always within max_payload, always sendable by nats-py, never losing the request id."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import _HEADER_KEY_RE  # what nats-py itself accepts as a header name

from keyqueue.errors import PayloadTooLarge
from keyqueue.jetstream.api import StoredMsg
from keyqueue.jetstream.dlq_copy import DeadLetterCopy, dead_letter_copy, minimal_dead_letter_copy
from keyqueue.wire import header_block_size
from keyqueue.wire import headers as H

WHY = {H.DLQ_REASON: "max-attempts", H.DLQ_ERROR_TYPE: "ValueError", H.ERROR_MESSAGE: "x" * 512,
       H.DLQ_ATTEMPTS: "5", H.DLQ_ORIGINAL_SUBJECT: "kq.shop.in.o1", H.DLQ_ORIGINAL_SEQ: "17",
       H.DLQ_TIME: "2025-01-01T00:00:00+00:00"}

REQUEST = {H.CONTENT_TYPE: H.CBOR, H.MESSAGE_TYPE: "charge", H.MESSAGE_VERSION: "1", H.MSG_ID: "01REQ"}


def stored(headers: dict[str, str], data: bytes = b"body", seq: int = 17) -> StoredMsg:
    return StoredMsg("kq.shop.in.o1", seq, headers, data)


def assert_sendable(copy: DeadLetterCopy, max_payload: int) -> None:
    assert header_block_size(copy.headers) + len(copy.data) <= max_payload
    for name, value in copy.headers.items():
        assert _HEADER_KEY_RE.fullmatch(name), name
        assert "\r" not in value and "\n" not in value
        value.encode("utf-8")


def test_a_copy_that_fits_is_the_request_plus_why_under_its_own_dedupe_id() -> None:
    copy = dead_letter_copy(stored({**REQUEST, "traceparent": "00-ab-cd-01"}), WHY, 1024 * 1024)
    assert copy == DeadLetterCopy({H.CONTENT_TYPE: H.CBOR, H.MESSAGE_TYPE: "charge", H.MESSAGE_VERSION: "1",
                                   "traceparent": "00-ab-cd-01", H.MSG_ID: "dlq:17", H.DLQ_REQUEST_ID: "01REQ",
                                   **WHY}, b"body")


def test_two_requests_with_one_request_id_get_two_dedupe_ids() -> None:
    first, second = (dead_letter_copy(stored(REQUEST, seq=seq), WHY, 4096) for seq in (3, 9))
    assert (first.headers[H.MSG_ID], second.headers[H.MSG_ID]) == ("dlq:3", "dlq:9")
    assert first.headers[H.DLQ_REQUEST_ID] == second.headers[H.DLQ_REQUEST_ID] == "01REQ"


def test_a_copy_too_big_keeps_as_much_of_the_body_as_fits_and_says_how_big_it_was() -> None:
    body = bytes(range(256)) * 40
    copy = dead_letter_copy(stored(REQUEST, body), WHY, 8192)
    assert copy.headers[H.DLQ_TRUNCATED] == str(len(body)) and not copy.minimal
    assert header_block_size(copy.headers) + len(copy.data) == 8192  # not a byte wasted, not one too many
    assert body.startswith(copy.data) and copy.headers[H.MESSAGE_TYPE] == "charge"


def test_headers_nats_py_refuses_or_changes_travel_escaped_and_jetstream_instructions_do_not_apply() -> None:
    odd = {
        "X-Odd(name)": "refused by nats-py: not a token",
        "X-Ctl\x01": "control character in the name",
        "X-Multi": "line one\r\nline two",
        "X-Surrogate": "a\ud800b",
        "Nats-Expected-Last-Subject-Sequence": "4",
        "Nats-TTL": "60",
        "x-kq-dlq-reason": "a request header named like the copy's own",
        "nats-msg-id": "a second request id, in another letter case",
    }
    copy = dead_letter_copy(stored({**REQUEST, **odd, "X-Fine": "café"}), WHY, 1024 * 1024)
    assert_sendable(copy, 1024 * 1024)
    assert json.loads(copy.headers[H.DLQ_ESCAPED_HEADERS]) == odd
    assert copy.headers["X-Fine"] == "café" and copy.headers[H.DLQ_REASON] == "max-attempts"
    assert not [name for name in copy.headers if name.lower().startswith("nats-") and name != H.MSG_ID]


def test_headers_too_big_for_any_body_leave_a_minimal_copy() -> None:
    copy = dead_letter_copy(stored({**REQUEST, "X-Huge": "h" * 5000}, b"body"), WHY, 4096)
    assert copy.minimal and copy.data == b""
    assert copy.headers == {H.MSG_ID: "dlq:17", H.DLQ_REQUEST_ID: "01REQ", **WHY, H.DLQ_TRUNCATED: "4"}


def test_a_minimal_copy_shortens_keyqueues_own_values_to_fit_but_never_its_dedupe_id() -> None:
    copy = minimal_dead_letter_copy(stored(REQUEST, b"12345"), WHY, 400)
    assert_sendable(copy, 400)
    assert copy.headers[H.MSG_ID] == "dlq:17" and copy.headers[H.DLQ_TRUNCATED] == "5"
    assert copy.headers[H.ERROR_MESSAGE].endswith("...") and copy.headers[H.DLQ_REASON] == "max-attempts"
    with pytest.raises(PayloadTooLarge):
        minimal_dead_letter_copy(stored(REQUEST), WHY, 40)


def test_why_values_that_cannot_travel_are_made_single_line() -> None:
    copy = dead_letter_copy(stored(REQUEST), {**WHY, H.ERROR_MESSAGE: "boom\r\nTraceback: ..."}, 4096)
    assert copy.headers[H.ERROR_MESSAGE] == "boom Traceback: ..."


@given(
    headers=st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=40), max_size=6),
    body=st.binary(max_size=3000),
    max_payload=st.integers(min_value=1200, max_value=4000),
)
def test_every_copy_is_sendable_within_max_payload_and_loses_no_header(
    headers: dict[str, str], body: bytes, max_payload: int
) -> None:
    msg = stored({**REQUEST, **headers}, body)
    copy = dead_letter_copy(msg, WHY, max_payload)
    assert_sendable(copy, max_payload)
    assert copy.headers[H.MSG_ID] == "dlq:17"
    if copy.minimal:
        return
    escaped = json.loads(copy.headers.get(H.DLQ_ESCAPED_HEADERS, "{}"))
    for name, value in msg.headers.items():
        if name != H.MSG_ID:
            assert copy.headers.get(name) == value or escaped.get(name) == value, name
    assert copy.data == body or (body.startswith(copy.data) and copy.headers[H.DLQ_TRUNCATED] == str(len(body)))
