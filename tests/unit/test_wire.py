"""The wire format without a server: codecs, message fields, headers, registry and upgrades."""

from __future__ import annotations

import collections
import enum
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Self

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyqueue.wire as wire
from keyqueue.errors import (
    ConfigError,
    MalformedBody,
    MissingHeader,
    PayloadTooLarge,
    UnknownMessageType,
    UnsupportedContentType,
    UnsupportedVersion,
    WireError,
)
from keyqueue.wire import (
    CBOR,
    JSON,
    Message,
    Registry,
    codec,
    decode,
    decode_envelope_fields,
    dumps,
    encode,
    from_fields,
    header_safe,
    loads,
    loads_map,
    new_request_id,
    peek,
    to_fields,
)
from keyqueue.wire import headers as h

REGISTRY = Registry()

# --- sample message types ----------------------------------------------------------------------


@REGISTRY.register
@dataclass(frozen=True)
class ReviewV1(Message):
    TYPE = "Review"
    VERSION = 1

    repo: str


@REGISTRY.register
@dataclass(frozen=True)
class ReviewV2(Message):
    TYPE = "Review"
    VERSION = 2

    repo: str
    branch: str

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, ReviewV1)
        return cls(repo=previous.repo, branch="main")


@REGISTRY.register
@dataclass(frozen=True)
class ReviewV3(Message):
    TYPE = "Review"
    VERSION = 3

    repo: str
    branch: str
    reviewers: tuple[str, ...]

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, ReviewV2)
        return cls(repo=previous.repo, branch=previous.branch, reviewers=(f"owner-of-{previous.repo}",))


@dataclass(frozen=True)
class Inner:
    label: str
    weight: float = 1.0


@REGISTRY.register
@dataclass(frozen=True)
class Sample(Message):
    TYPE = "Sample"
    VERSION = 1

    text: str
    number: int
    ratio: float
    flag: bool
    blob: bytes
    when: datetime
    maybe: int | None
    tags: tuple[str, ...]
    counts: dict[str, int]
    inners: list[Inner]
    pair: tuple[int, str]
    anything: Any = None
    note: str = "default"


@REGISTRY.register
@dataclass(frozen=True)
class Loose(Message):
    """A body that takes any plain value, to feed raw bodies through ``decode``."""

    TYPE = "Loose"
    VERSION = 1

    value: Any = None


@dataclass(frozen=True)
class FlakyV1(Message):
    TYPE = "Flaky"
    VERSION = 1

    n: int


@dataclass(frozen=True)
class FlakyV2(Message):
    TYPE = "Flaky"
    VERSION = 2

    n: int
    half: int

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, FlakyV1)
        if previous.n % 2:
            raise ValueError(f"{previous.n} is odd")
        return cls(n=previous.n, half=previous.n // 2)


def _headers(
    message_type: str = "Review", version: str = "1", content_type: str = CBOR, **extra: str
) -> dict[str, str]:
    return {
        h.CONTENT_TYPE: content_type,
        h.MESSAGE_TYPE: message_type,
        h.MESSAGE_VERSION: version,
        h.MSG_ID: "01J00000000000000000000000",
        **extra,
    }


# --- strategies --------------------------------------------------------------------------------

BIG_INTS = st.integers(min_value=-(2**200), max_value=2**200)
FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TIMEZONES = st.integers(min_value=-23 * 60, max_value=23 * 60).map(lambda m: timezone(timedelta(minutes=m)))
AWARE_DATETIMES = st.datetimes(timezones=TIMEZONES)
JSON_LEAVES = st.none() | st.booleans() | BIG_INTS | FINITE_FLOATS | st.text()
CBOR_LEAVES = JSON_LEAVES | st.binary() | AWARE_DATETIMES | st.sampled_from([float("inf"), float("-inf")])


def _plain(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )


PLAIN = {CBOR: _plain(CBOR_LEAVES), JSON: _plain(JSON_LEAVES)}


def _samples(content_type: str) -> st.SearchStrategy[Sample]:
    return st.builds(
        Sample,
        text=st.text(),
        number=BIG_INTS,
        ratio=FINITE_FLOATS,
        flag=st.booleans(),
        blob=st.binary(),
        when=AWARE_DATETIMES,
        maybe=st.none() | BIG_INTS,
        tags=st.lists(st.text(max_size=10), max_size=5).map(tuple),
        counts=st.dictionaries(st.text(max_size=10), BIG_INTS, max_size=5),
        inners=st.lists(st.builds(Inner, label=st.text(max_size=10), weight=FINITE_FLOATS), max_size=3),
        pair=st.tuples(BIG_INTS, st.text(max_size=10)),
        anything=PLAIN[content_type],
        note=st.text(max_size=10),
    )


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [CBOR, JSON])
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plain_values_round_trip(content_type: str, data: st.DataObject) -> None:
    value = data.draw(PLAIN[content_type])
    assert loads(dumps(value, content_type), content_type) == value


@pytest.mark.parametrize("content_type", [CBOR, JSON])
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_messages_round_trip(content_type: str, data: st.DataObject) -> None:
    sample = data.draw(_samples(content_type))
    encoded = encode(sample, content_type=content_type)
    decoded = decode(encoded.headers, encoded.body, REGISTRY)
    assert decoded == sample
    assert isinstance(decoded, Sample)
    assert isinstance(decoded.tags, tuple) and isinstance(decoded.inners, list)


def test_json_body_carries_bytes_as_base64_and_datetimes_as_iso_text() -> None:
    sample = Sample(
        text="t",
        number=1,
        ratio=2,  # an int where a float is declared is widened
        flag=True,
        blob=b"\x00\xff",
        when=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
        maybe=None,
        tags=("a",),
        counts={"k": 1},
        inners=[Inner("x")],
        pair=(1, "one"),
    )
    encoded = encode(sample, content_type=JSON)
    raw = json.loads(encoded.body)
    assert raw["blob"] == "AP8=" and raw["when"] == "2025-01-02T03:04:05+00:00" and raw["ratio"] == 2.0
    envelope, fields = decode_envelope_fields(encoded.headers, encoded.body)
    assert envelope.message_type == "Sample" and fields["blob"] == "AP8="
    assert decode(encoded.headers, encoded.body, REGISTRY) == sample


def test_encode_sets_every_header() -> None:
    encoded = encode(
        ReviewV1("r"),
        request_id="01J5555555555555555555555X",
        reply_inbox="_INBOX.abc",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        extra_headers={h.TRACESTATE: "congo=t61rcWkgMzE"},
    )
    assert encoded.headers == {
        h.CONTENT_TYPE: CBOR,
        h.MESSAGE_TYPE: "Review",
        h.MESSAGE_VERSION: "1",
        h.MSG_ID: "01J5555555555555555555555X",
        h.REPLY_INBOX: "_INBOX.abc",
        h.TRACEPARENT: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        h.TRACESTATE: "congo=t61rcWkgMzE",
    }
    assert encoded.request_id == "01J5555555555555555555555X"
    envelope = peek(encoded.headers)
    assert envelope == wire.Envelope(
        content_type=CBOR,
        message_type="Review",
        version=1,
        request_id="01J5555555555555555555555X",
        reply_inbox="_INBOX.abc",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


def test_encode_makes_a_new_ulid_request_id_by_default() -> None:
    first, second = encode(ReviewV1("r")), encode(ReviewV1("r"))
    assert first.request_id != second.request_id
    assert first.headers[h.MSG_ID] == first.request_id
    assert len(first.request_id) == 26 and first.request_id.isalnum()
    assert new_request_id() != new_request_id()


def test_peek_reads_header_names_in_any_case_and_media_type_parameters() -> None:
    headers = {
        name.lower(): value
        for name, value in _headers(content_type="Application/JSON; charset=utf-8").items()
    }
    envelope = peek(headers)
    assert envelope.content_type == JSON and envelope.version == 1 and envelope.reply_inbox is None


# --- upgrades ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [CBOR, JSON])
def test_old_versions_upgrade_through_the_chain(content_type: str) -> None:
    for old in (ReviewV1("app"), ReviewV2("app", "main")):
        encoded = encode(old, content_type=content_type)
        assert encoded.headers[h.MESSAGE_VERSION] == str(old.VERSION)
        assert decode(encoded.headers, encoded.body, REGISTRY) == ReviewV3("app", "main", ("owner-of-app",))
    latest = ReviewV3("app", "dev", ("ann", "bob"))
    encoded = encode(latest, content_type=content_type)
    assert decode(encoded.headers, encoded.body, REGISTRY) == latest


def test_registry_lookups() -> None:
    assert REGISTRY.known_types() == ("Loose", "Review", "Sample")
    assert REGISTRY.latest("Review") is ReviewV3
    assert REGISTRY.get("Review", 2) is ReviewV2
    assert "Review" in REGISTRY and "Nope" not in REGISTRY
    assert REGISTRY.upgrade(ReviewV3("a", "b", ())) == ReviewV3("a", "b", ())
    with pytest.raises(UnsupportedVersion):
        REGISTRY.get("Review", 4)


def test_a_failing_upgrade_is_a_malformed_body_naming_the_versions() -> None:
    registry = Registry()
    registry.register(FlakyV1)
    registry.register(FlakyV2)
    good = encode(FlakyV1(4))
    assert decode(good.headers, good.body, registry) == FlakyV2(4, 2)
    bad = encode(FlakyV1(3))
    with pytest.raises(MalformedBody, match="Flaky: upgrading version 1 to 2 failed: ValueError: 3 is odd"):
        decode(bad.headers, bad.body, registry)


@pytest.mark.parametrize("content_type", [CBOR, JSON])
def test_a_newer_version_is_rejected_before_the_body_is_read(content_type: str) -> None:
    with pytest.raises(UnsupportedVersion) as caught:
        decode(_headers(version="4", content_type=content_type), b"\xff garbage \x00{", REGISTRY)
    assert (caught.value.received, caught.value.supported) == (4, 3)
    assert "Review version 4 is not supported" in str(caught.value) and "1..3" in str(caught.value)


# --- registration ------------------------------------------------------------------------------


def test_register_works_as_a_decorator_and_twice_is_harmless() -> None:
    registry = Registry()
    assert registry.register(ReviewV1) is ReviewV1
    assert registry.register(ReviewV1) is ReviewV1
    assert registry.known_types() == ("Review",)


def test_register_rejects_a_gap_and_a_duplicate() -> None:
    registry = Registry()
    with pytest.raises(ConfigError, match="registered after version 0"):
        registry.register(ReviewV2)
    registry.register(ReviewV1)
    with pytest.raises(ConfigError, match="registered after version 1"):
        registry.register(ReviewV3)

    @dataclass(frozen=True)
    class OtherReviewV1(Message):
        TYPE = "Review"
        VERSION = 1
        repo: str

    with pytest.raises(ConfigError, match="registered twice"):
        registry.register(OtherReviewV1)


def test_register_needs_an_upgrade_after_version_1() -> None:
    @dataclass(frozen=True)
    class NoUpgrade(ReviewV1):
        VERSION = 2
        branch: str = "main"

    registry = Registry()
    registry.register(ReviewV1)
    with pytest.raises(ConfigError, match="must define the classmethod upgrade"):
        registry.register(NoUpgrade)


def test_register_checks_the_class() -> None:
    class NotADataclass(Message):
        TYPE = "X"
        VERSION = 1

    @dataclass(frozen=True)
    class BadVersion(Message):
        TYPE = "X"
        VERSION = 0

    @dataclass(frozen=True)
    class BadName(Message):
        TYPE = "two\nlines"
        VERSION = 1

    @dataclass(frozen=True)
    class BadField(Message):
        TYPE = "X"
        VERSION = 1
        items: set[int]

    @dataclass(frozen=True)
    class IntKeys(Message):
        TYPE = "X"
        VERSION = 1
        items: dict[int, str]

    registry = Registry()
    for cls, match in [
        (NotADataclass, "must be decorated"),
        (BadVersion, "VERSION must be a positive int"),
        (BadName, "TYPE must be a non-empty single-line string"),
        (BadField, r"BadField.items: the annotation set\[int\] is not supported"),
        (IntKeys, "map keys must be str"),
        (Inner, "is not a subclass"),
    ]:
        with pytest.raises(ConfigError, match=match):
            registry.register(cls)
    assert registry.known_types() == ()


# --- header errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [h.CONTENT_TYPE, h.MESSAGE_TYPE, h.MESSAGE_VERSION, h.MSG_ID])
def test_each_required_header_is_checked(missing: str) -> None:
    encoded = encode(ReviewV1("r"))
    headers = {name: value for name, value in encoded.headers.items() if name != missing}
    with pytest.raises(MissingHeader) as caught:
        decode(headers, encoded.body, REGISTRY)
    assert caught.value.header == missing
    with pytest.raises(MissingHeader):
        decode({**encoded.headers, missing: ""}, encoded.body, REGISTRY)


def test_no_headers_at_all() -> None:
    with pytest.raises(MissingHeader, match=h.CONTENT_TYPE):
        peek(None)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-pickle", "application/cbor-seq"])
def test_an_unsupported_content_type(content_type: str) -> None:
    with pytest.raises(UnsupportedContentType) as caught:
        decode(_headers(content_type=content_type), b"", REGISTRY)
    assert caught.value.received == content_type
    assert caught.value.supported == (CBOR, JSON)


@pytest.mark.parametrize("version", ["0", "-1", "abc", "1.0", "+1", "01", "1" * 30])
def test_a_version_that_is_not_a_positive_integer(version: str) -> None:
    with pytest.raises(UnsupportedVersion, match="is not a positive integer"):
        peek(_headers(version=version))


def test_an_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(UnknownMessageType) as caught:
        decode(_headers(message_type="Deploy"), b"\xa0", REGISTRY)
    assert caught.value.known == ("Loose", "Review", "Sample")
    assert "Loose, Review, Sample" in str(caught.value)


# --- body errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "body", "match"),
    [
        (CBOR, b"", "empty"),
        (CBOR, b"\xa1\x64repo", "truncated"),
        (CBOR, bytes.fromhex("a1647265706f6161") + b"\x00", "trailing data"),
        (CBOR, b"\xff\xfe\xfd", "indefinite length or a break"),
        (CBOR, bytes.fromhex("1c"), "reserved additional information"),
        (CBOR, bytes.fromhex("83010203"), "must be a map of fields, not a list"),
        (CBOR, bytes.fromhex("a10102"), "map key at byte 1 is not a text string"),
        (CBOR, bytes.fromhex("a1647265706f62c328"), "does not decode"),  # invalid UTF-8
        (CBOR, bytes.fromhex("a2647265706f6161647265706f6162"), "does not decode"),  # duplicate key
        (CBOR, bytes.fromhex("bf647265706f6161ff"), "indefinite length"),
        (CBOR, bytes.fromhex("a1647265706f7f6161ff"), "indefinite length"),
        (CBOR, bytes.fromhex("a1647265706ff7"), "'undefined'"),
        (CBOR, bytes.fromhex("a1647265706ff0"), "simple value 16"),
        (CBOR, bytes.fromhex("a1647265706ff820"), "simple value 32"),
        (CBOR, bytes.fromhex("c06131"), "does not decode"),  # tag 0 with a bad date
        (CBOR, bytes.fromhex("c00a"), "wraps the wrong kind of item"),
        (CBOR, b"\x81" * 70 + b"\x01", "nests deeper than 64"),
        (JSON, b"", "does not decode"),
        (JSON, b"{not json", "does not decode"),
        (JSON, b'{"repo": "r"} trailing', "does not decode"),
        (JSON, b'{"repo": "\xff"}', "not valid UTF-8"),
        (JSON, b'["repo"]', "must be a map of fields, not a list"),
        (JSON, b"null", "must be a map of fields, not null"),
        (JSON, b'{"repo": NaN}', "contains NaN"),
        (JSON, b'{"repo": -Infinity}', "contains -Infinity"),
        (JSON, b'{"repo": 1e400}', "out of range"),
        (JSON, b'{"repo": "a", "repo": "b"}', "repeats the key 'repo'"),
        (JSON, b"[" * 100_000, "does not decode"),
    ],
)
def test_malformed_bodies(content_type: str, body: bytes, match: str) -> None:
    with pytest.raises(MalformedBody, match=match):
        decode(_headers(content_type=content_type), body, REGISTRY)


@pytest.mark.parametrize("content_type", [CBOR, JSON])
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, r"ReviewV1: missing required field 'repo'"),
        ({"repo": "r", "branch": "main"}, r"ReviewV1: unknown field\(s\) 'branch'; ReviewV1 has repo"),
        ({"repo": 7}, r"ReviewV1.repo: expected str, got int"),
        ({"repo": None}, r"ReviewV1.repo: expected str, got NoneType"),
    ],
)
def test_fields_that_do_not_fit_the_type(content_type: str, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(MalformedBody, match=match):
        decode(_headers(content_type=content_type), dumps(fields, content_type), REGISTRY)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"number": True}, r"Sample.number: expected int, got bool"),
        ({"ratio": "1.5"}, r"Sample.ratio: expected float, got str"),
        ({"tags": "abc"}, r"Sample.tags: expected tuple\[str, ...\], got str"),
        ({"tags": ["a", 1]}, r"Sample.tags\[1\]: expected str, got int"),
        ({"counts": {"a": "1"}}, r"Sample.counts\['a'\]: expected int, got str"),
        ({"inners": [{"label": "x", "colour": "red"}]}, r"Sample.inners\[0\]: unknown field\(s\) 'colour'"),
        ({"inners": [{}]}, r"Sample.inners\[0\]: missing required field 'label'"),
        ({"pair": [1, "a", 2]}, r"Sample.pair: expected 2 items, got 3"),
        ({"maybe": "x"}, r"Sample.maybe: expected int \| None, got str"),
        ({"blob": "AP8="}, r"Sample.blob: expected bytes, got str"),  # base64 is for JSON only
    ],
)
def test_nested_field_errors_name_the_path(fields: dict[str, Any], match: str) -> None:
    good = to_fields(
        Sample("t", 1, 1.0, True, b"", datetime.now(UTC), None, (), {}, [], (1, "a")), content_type=CBOR
    )
    with pytest.raises(MalformedBody, match=match):
        from_fields(Sample, {**good, **fields})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"blob": "not base64!"}, r"Sample.blob: bytes field is not valid base64 text"),
        ({"when": "yesterday"}, r"Sample.when: datetime field is not ISO 8601 text"),
        ({"when": "2025-01-01T00:00:00"}, r"Sample.when: datetime '2025-01-01T00:00:00' has no timezone"),
    ],
)
def test_json_text_forms_are_checked(fields: dict[str, Any], match: str) -> None:
    sample = Sample("t", 1, 1.0, True, b"", datetime.now(UTC), None, (), {}, [], (1, "a"))
    good = to_fields(sample, content_type=JSON)
    with pytest.raises(MalformedBody, match=match):
        from_fields(Sample, {**good, **fields}, content_type=JSON)


def test_post_init_errors_are_malformed_bodies() -> None:
    @dataclass(frozen=True)
    class Positive:
        n: int

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError("n must be positive")

    with pytest.raises(MalformedBody, match="Positive: Positive rejected its fields: n must be positive"):
        from_fields(Positive, {"n": 0})


# --- forbidden CBOR tags -----------------------------------------------------------------------

FORBIDDEN_TAGS = [
    (28, "82d81c8101d81d00", "shareable value"),  # [shareable([1]), shared-ref(0)]
    (28, "d81c81d81d00", "shareable value"),  # a list that contains itself
    (29, "d81d00", "shared reference"),
    (256, "d901008263616263d81900", "string reference namespace"),
    (25, "d81900", "string reference"),
    (4, "c48221196ab3", "decimal fraction"),
    (5, "c5822003", "bigfloat"),
    (30, "d81e820102", "rational number"),
    (35, "d8236568656c6c6f", "regular expression"),
    (36, "d8246b436f6e74656e742d547970653a20746578742f706c61696e0a0a6869", "MIME message"),
    (37, "d82550" + "00" * 16, "UUID"),
    (52, "d83444c00a0a01", "IPv4 address"),
    (100, "d86419300a", "epoch date"),
    (258, "d9010283010203", "set"),
    (260, "d9010444c00a0a01", "network address"),
    (261, "d90105a144c0a800001818", "network prefix"),
    (1004, "d903ec6a323032302d30312d3031", "date string"),
    (43000, "d9a7f88201f93c00", "complex number"),
    (55799, "d9d9f7a0", "self-described CBOR"),
    (24, "d81842a0ff", "embedded CBOR"),
    (999, "d903e701", None),
    (2**64 - 1, "dbffffffffffffffff01", None),
]


@pytest.mark.parametrize(("tag", "item", "name"), FORBIDDEN_TAGS)
def test_forbidden_cbor_tags_are_rejected_before_decoding(tag: int, item: str, name: str | None) -> None:
    message = f"CBOR tag {tag} ({name}) is not allowed" if name else f"CBOR tag {tag} is not allowed"
    with pytest.raises(MalformedBody) as at_top:
        loads(bytes.fromhex(item), CBOR)
    assert message in str(at_top.value) and "allowed tags: 0, 1, 2, 3" in str(at_top.value)
    # Deep inside a message body: {"value": [{"x": <item>}]}
    body = bytes.fromhex("a16576616c756581a16178") + bytes.fromhex(item)
    with pytest.raises(MalformedBody, match=f"CBOR tag {tag}"):
        decode(_headers(message_type="Loose"), body, REGISTRY)


def test_allowed_cbor_tags_decode_to_plain_values() -> None:
    assert loads(bytes.fromhex("c074323031332d30332d32315432303a30343a30305a"), CBOR) == datetime(
        2013, 3, 21, 20, 4, tzinfo=UTC
    )
    assert loads(bytes.fromhex("c11a514b67b0"), CBOR) == datetime(2013, 3, 21, 20, 4, tzinfo=UTC)
    assert loads(bytes.fromhex("c249010000000000000000"), CBOR) == 2**64
    assert loads(bytes.fromhex("c349010000000000000000"), CBOR) == -(2**64) - 1
    assert dumps(2**64, CBOR) == bytes.fromhex("c249010000000000000000")


def test_simple_cbor_items_decode() -> None:
    assert loads(bytes.fromhex("83f4f5f6"), CBOR) == [False, True, None]
    assert loads(bytes.fromhex("83f93c00fa3fc00000fb3ff8000000000000"), CBOR) == [1.0, 1.5, 1.5]


@settings(max_examples=500)
@given(
    data=st.binary(max_size=64) | PLAIN[CBOR].map(lambda value: dumps(value, CBOR)), cut=st.integers(0, 64)
)
def test_any_bytes_decode_to_plain_values_or_malformed_body(data: bytes, cut: int) -> None:
    for candidate in (data, data[:cut], data[cut:]):
        try:
            value = loads(candidate, CBOR)
        except MalformedBody:
            continue
        wire.check_plain(value, CBOR)  # nothing but plain values was built


def _full_scan(data: bytes) -> int | MalformedBody:
    try:
        return codec._scan_item(data, 0, 0)
    except MalformedBody as e:
        return e


@settings(max_examples=500)
@given(
    data=st.binary(max_size=64) | PLAIN[CBOR].map(lambda value: dumps(value, CBOR)), cut=st.integers(0, 64)
)
def test_the_fast_scan_of_plain_items_agrees_with_the_full_one(data: bytes, cut: int) -> None:
    # The fast walk may pass an item to the full one (None) but never decide otherwise than it.
    for candidate in (data, data[:cut], data[cut:]):
        fast = codec._scan_plain(candidate)
        if fast is not None:
            assert fast == _full_scan(candidate)


def test_the_fast_scan_takes_plain_bodies_and_leaves_the_rest_to_the_full_one() -> None:
    body = dumps({"order": {"id": "o-1", "lines": [{"sku": f"s{i}", "qty": i, "price": 9.99} for i in range(20)],
                            "ok": True, "none": None, "big": 2**40, "neg": -3}}, CBOR)
    assert codec._scan_plain(body) == len(body)
    when = dumps({"at": datetime(2025, 1, 2, tzinfo=UTC)}, CBOR)  # tag 0 or 1: the full scan checks it
    assert codec._scan_plain(when) is None and codec._scan_item(when, 0, 0) == len(when)
    deep = b"\x81" * (codec.MAX_DEPTH + 1) + b"\x00"  # arrays in arrays, one level more than allowed
    assert codec._scan_plain(deep) is None and isinstance(_full_scan(deep), MalformedBody)
    assert codec._scan_plain(deep[1:]) == len(deep) - 1 == _full_scan(deep[1:])
    for bad in (b"\xa1\x01\x02", b"\x9f\x00\xff", b"\xf7", b"\x62a"):  # int key, indefinite, undefined, short
        assert codec._scan_plain(bad) is None and isinstance(_full_scan(bad), MalformedBody)


@settings(max_examples=300)
@given(data=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_bytes_decode_as_json_to_plain_values_or_malformed_body(data: bytes) -> None:
    try:
        value = loads(data, JSON)
    except MalformedBody:
        return
    wire.check_plain(value, JSON)


# --- encoding checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "content_type", "match"),
    [
        ({1, 2}, CBOR, r"body: set is not a plain value"),
        ({"a": [object()]}, CBOR, r"body\['a'\]\[0\]: object is not a plain value"),
        ({1: "a"}, CBOR, r"body: map key 1 is not a string"),
        ({"a": ({"b": 1.5}, {"c": [float("inf")]})}, JSON,
         r"body\['a'\]\[1\]\['c'\]\[0\]: inf cannot be encoded as JSON"),
        ([[[{"d": datetime(2025, 1, 1)}]]], CBOR, r"body\[0\]\[0\]\[0\]\['d'\]: datetime .* has no timezone"),
        (datetime(2025, 1, 1), CBOR, "has no timezone"),
        (b"x", JSON, "bytes cannot be encoded as JSON"),
        (datetime.now(UTC), JSON, "datetime cannot be encoded as JSON"),
        (float("nan"), JSON, "nan cannot be encoded as JSON"),
        ("\ud800", JSON, "cannot encode the body"),
        ("\ud800", CBOR, "cannot encode the body"),
    ],
)
def test_dumps_refuses_what_it_could_not_read_back(value: Any, content_type: str, match: str) -> None:
    with pytest.raises(MalformedBody, match=match):
        dumps(value, content_type)


@pytest.mark.parametrize("content_type", [CBOR, JSON])
def test_subclasses_of_plain_types_are_plain(content_type: str) -> None:
    """The check passes the plain types by identity first; their subclasses (an ``IntEnum``, a
    ``str`` subclass, an ``OrderedDict``) take the longer way and are just as plain."""

    class Level(enum.IntEnum):
        HIGH = 2

    class Name(str):
        pass

    value = collections.OrderedDict(level=Level.HIGH, name=Name("x"), items=[Level.HIGH, (Name("y"), 1.5)])
    wire.check_plain(value, content_type)
    assert loads(dumps(value, content_type), content_type) == {"level": 2, "name": "x", "items": [2, ["y", 1.5]]}


def test_to_fields_checks_values_against_annotations() -> None:
    with pytest.raises(MalformedBody, match=r"ReviewV1.repo: expected str, got int"):
        encode(ReviewV1(repo=5))  # type: ignore[arg-type]
    with pytest.raises(MalformedBody, match=r"Loose.value: bytes cannot be encoded as JSON"):
        encode(Loose(b"raw"), content_type=JSON)
    with pytest.raises(MalformedBody, match=r"Loose.value\['when'\]: datetime .* has no timezone"):
        encode(Loose({"when": datetime(2025, 1, 1)}))


def test_codec_rejects_unknown_content_types() -> None:
    with pytest.raises(UnsupportedContentType):
        dumps({}, "application/xml")
    with pytest.raises(UnsupportedContentType):
        loads(b"{}", "application/xml")
    with pytest.raises(UnsupportedContentType):
        encode(ReviewV1("r"), content_type="application/x-pickle")


def test_loads_map_returns_the_field_dict() -> None:
    assert loads_map(b'{"a": [1, 2.5, null]}', JSON) == {"a": [1, 2.5, None]}


def test_encode_checks_headers() -> None:
    with pytest.raises(ConfigError, match="extra_headers may not set x-message-type"):
        encode(ReviewV1("r"), extra_headers={"x-message-type": "Other"})
    with pytest.raises(ConfigError, match="header X-Note has the value"):
        encode(ReviewV1("r"), extra_headers={"X-Note": "two\r\nlines"})
    with pytest.raises(ConfigError, match="is not a valid header name"):
        encode(ReviewV1("r"), extra_headers={"X Note": "x"})
    with pytest.raises(ConfigError, match="may not be empty"):
        encode(ReviewV1("r"), request_id="")
    with pytest.raises(ConfigError, match="needs a Message subclass"):
        encode(Inner("x"))  # type: ignore[arg-type]


# --- payload size ------------------------------------------------------------------------------


def test_payload_too_large_is_raised_by_encode() -> None:
    msg = Loose("x" * 1000)
    fits = encode(msg, request_id="01J00000000000000000000000")
    expected = len(b"NATS/1.0\r\n") + sum(len(f"{k}: {v}\r\n") for k, v in fits.headers.items()) + 2
    assert fits.size == expected + len(fits.body)
    assert encode(msg, request_id="01J00000000000000000000000", max_payload=fits.size) == fits
    with pytest.raises(PayloadTooLarge) as caught:
        encode(msg, request_id="01J00000000000000000000000", max_payload=fits.size - 1)
    assert (caught.value.size, caught.value.limit) == (fits.size, fits.size - 1)


def test_header_block_size_counts_utf8_bytes() -> None:
    assert wire.header_block_size({}) == 0
    assert wire.header_block_size({"A": "é"}) == len(b"NATS/1.0\r\n") + len("A: é\r\n".encode()) + 2


# --- header_safe -------------------------------------------------------------------------------


def test_header_safe_makes_one_trimmed_line() -> None:
    assert header_safe("  boom:\r\n  line two\n\tthree\x00four  ") == "boom:   line two three four"
    assert header_safe("plain") == "plain"
    assert header_safe("lone \ud800 surrogate") == "lone ? surrogate"


def test_header_safe_truncates_to_a_byte_limit_at_a_character_boundary() -> None:
    assert header_safe("x" * 600) == "x" * 509 + "..."
    assert len(header_safe("x" * 600).encode()) == 512
    cut = header_safe("é" * 20, limit=10)  # 2 bytes each
    assert cut == "ééé..." and len(cut.encode()) <= 10
    assert header_safe("abcdef", limit=6) == "abcdef"
    with pytest.raises(ConfigError):
        header_safe("x", limit=2)


@given(st.text(), st.integers(min_value=3, max_value=600))
def test_header_safe_is_always_a_valid_header_value(text: str, limit: int) -> None:
    value = header_safe(text, limit)
    assert len(value.encode()) <= limit
    assert value == value.strip() and not any(ord(c) < 32 or ord(c) == 127 for c in value)
    encode(ReviewV1("r"), extra_headers={h.ERROR_MESSAGE: value})  # accepted as a header


def test_header_names() -> None:
    assert (h.CONTENT_TYPE, h.MESSAGE_TYPE, h.MESSAGE_VERSION, h.MSG_ID) == (
        "X-CONTENT-TYPE",
        "X-MESSAGE-TYPE",
        "X-MESSAGE-VERSION",
        "Nats-Msg-Id",
    )
    assert (h.STATUS_OK, h.STATUS_ERROR, h.STATUS_DEAD_LETTERED, h.STATUS_SUPERSEDED) == (
        "ok",
        "error",
        "dead-lettered",
        "superseded",
    )
    assert (CBOR, JSON) == ("application/cbor", "application/json")


# --- public surface ----------------------------------------------------------------------------


def test_public_surface_is_sorted_and_complete() -> None:
    assert wire.__all__ == sorted(wire.__all__, key=lambda name: (not name.isupper(), name))
    public = {name for name in vars(wire) if not name.startswith("_")}
    submodules = {"codec", "envelope", "fields", "message", "annotations"}
    assert public - submodules == set(wire.__all__)
    assert all(issubclass(error, WireError) for error in (MalformedBody, MissingHeader, PayloadTooLarge))


def test_sample_defaults_are_plain() -> None:
    # field(default_factory=...) style defaults are optional fields too
    @dataclass(frozen=True)
    class WithFactory:
        items: list[int] = field(default_factory=list)

    assert from_fields(WithFactory, {}) == WithFactory()
    assert to_fields(WithFactory([1])) == {"items": [1]}
