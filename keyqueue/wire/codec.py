"""Body codecs: CBOR (the default) and JSON, both limited to plain values.

A body is made of *plain values*: maps with text keys, arrays, text, integers of any size,
floats, booleans and null; CBOR adds byte strings and timezone-aware datetimes. ``dumps``
refuses anything else, so whatever keyqueue writes it can read back, in either encoding.

Decoding is safe on untrusted input. cbor2 6.x (a Rust extension) decodes many semantic tags
itself before any ``tag_hook`` runs: shared references (28/29, which can build cyclic
structures), string references (25/256), rationals (30), regular expressions (35, compiled),
MIME messages (36, parsed), UUIDs (37), sets (258), IP addresses (260/261), dates (100/1004),
complex numbers (43000) and more. A tag hook therefore cannot enforce an allow-list, and
overriding ``semantic_decoders`` tag by tag is a deny-list that a later cbor2 release can
outgrow. So ``loads`` first walks the encoded item structure itself, building no values, and
rejects every tag outside ``ALLOWED_CBOR_TAGS``, indefinite lengths, ``undefined`` and other
simple values, non-text map keys, nesting deeper than ``MAX_DEPTH`` and trailing bytes; only
then does cbor2 build the values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Final, NoReturn

import cbor2

from keyqueue.errors import MalformedBody, UnsupportedContentType, WireError
from keyqueue.wire.headers import CBOR, JSON

__all__ = [
    "ALLOWED_CBOR_TAGS",
    "CONTENT_TYPES",
    "MAX_DEPTH",
    "check_plain",
    "dumps",
    "loads",
    "loads_map",
]

CONTENT_TYPES: Final = (CBOR, JSON)
"""The content types keyqueue encodes and decodes, the default first."""

MAX_DEPTH: Final = 64
"""How deeply maps and arrays may nest in a body."""

ALLOWED_CBOR_TAGS: Final[Mapping[int, str]] = {
    0: "date/time string",
    1: "epoch date/time",
    2: "unsigned bignum",
    3: "negative bignum",
}
"""The only CBOR tags a body may contain: each decodes to a plain value (datetime or int)."""

# Major types the content of each allowed tag must have: text for 0, a number for 1, bytes for 2/3.
_TAG_CONTENT: Final[Mapping[int, frozenset[int]]] = {
    0: frozenset({3}),
    1: frozenset({0, 1, 7}),
    2: frozenset({2}),
    3: frozenset({2}),
}

# Names of tags cbor2 would otherwise decode, so a rejection says what was attempted.
_TAG_NAMES: Final[Mapping[int, str]] = {
    4: "decimal fraction",
    5: "bigfloat",
    21: "base64url hint",
    22: "base64 hint",
    23: "base16 hint",
    24: "embedded CBOR",
    25: "string reference",
    28: "shareable value",
    29: "shared reference",
    30: "rational number",
    32: "URI",
    35: "regular expression",
    36: "MIME message",
    37: "UUID",
    52: "IPv4 address",
    54: "IPv6 address",
    100: "epoch date",
    256: "string reference namespace",
    258: "set",
    260: "network address",
    261: "network prefix",
    1004: "date string",
    43000: "complex number",
    55799: "self-described CBOR",
}

_MAJOR_TEXT: Final = 3
_FLOAT_INFOS: Final = frozenset({25, 26, 27})
_FALSE_TRUE_NULL: Final = frozenset({20, 21, 22})


def dumps(value: Any, content_type: str, path: str = "body") -> bytes:
    """Encode a plain value (see ``check_plain``) as ``content_type``.

    Raises ``UnsupportedContentType`` for a content type other than ``CONTENT_TYPES`` and
    ``MalformedBody`` (naming the offending path, from ``path``) for a value that is not plain.
    """
    _require_supported(content_type)
    check_plain(value, content_type, path)
    try:
        if content_type == CBOR:
            return cbor2.dumps(value)
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
    except (ValueError, TypeError, cbor2.CBOREncodeError) as exc:
        raise MalformedBody(f"cannot encode the body as {content_type}: {exc}") from exc


def loads(data: bytes, content_type: str) -> Any:
    """Decode one plain value from ``data``; any failure is a ``MalformedBody``.

    Raises ``UnsupportedContentType`` for a content type other than ``CONTENT_TYPES``.
    """
    _require_supported(content_type)
    if content_type == CBOR:
        return _loads_cbor(bytes(data))
    return _loads_json(bytes(data))


def loads_map(data: bytes, content_type: str) -> dict[str, Any]:
    """Like ``loads``, for a body that must be a map at the top level (every message body)."""
    value = loads(data, content_type)
    if not isinstance(value, dict):
        raise MalformedBody(f"{content_type} body must be a map of fields, not {_kind(value)}")
    return value


def check_plain(value: Any, content_type: str, path: str = "body") -> None:
    """Raise ``MalformedBody`` naming ``path`` unless ``value`` is plain for ``content_type``.

    Plain: ``dict`` with ``str`` keys, ``list``, ``tuple`` (encoded as an array), ``str``,
    ``int``, ``float``, ``bool`` and ``None``, nested at most ``MAX_DEPTH`` deep. CBOR also
    takes ``bytes`` and timezone-aware ``datetime``; JSON takes neither, and no NaN or infinity.
    """
    as_json = content_type == JSON
    try:
        _check_plain(value, _JSON_LEAVES if as_json else _CBOR_LEAVES, as_json, 0)
    except _NotPlain as exc:
        raise MalformedBody(f"{path}{''.join(reversed(exc.steps))}: {exc.reason}") from None


_CBOR_LEAVES: Final[frozenset[type]] = frozenset({str, int, bool, float, type(None)})
"""Types plain as they are, checked by identity first (a subclass, an ``IntEnum``, goes the long way)."""

_JSON_LEAVES: Final[frozenset[type]] = frozenset({str, int, bool, type(None)})
"""As :data:`_CBOR_LEAVES`, less ``float`` (JSON takes no NaN or infinity)."""


class _NotPlain(Exception):
    """What is not plain (``reason``), and where: the steps from the value down to it, innermost
    first, gathered only as the check unwinds, so a plain value builds no path at all."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.steps: list[str] = []


def _check_plain(value: Any, leaves: frozenset[type], as_json: bool, depth: int) -> None:
    if type(value) in leaves:
        return
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        in_map, items = True, value.items()
    elif isinstance(value, list | tuple):
        in_map, items = False, enumerate(value)
    else:
        _check_scalar(value, as_json)
        return
    if depth >= MAX_DEPTH:
        raise _NotPlain(f"nests deeper than {MAX_DEPTH} levels")
    for step, item in items:  # a map's key, or an array's index (whose repr is the number)
        if in_map and not isinstance(step, str):
            raise _NotPlain(f"map key {step!r} is not a string")
        if type(item) not in leaves:
            try:
                _check_plain(item, leaves, as_json, depth + 1)
            except _NotPlain as exc:
                exc.steps.append(f"[{step!r}]")
                raise


def _check_scalar(value: Any, as_json: bool) -> None:
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if as_json and not math.isfinite(value):
            raise _NotPlain(f"{value!r} cannot be encoded as JSON")
        return
    if isinstance(value, bytes | datetime):
        if as_json:
            raise _NotPlain(
                f"{type(value).__name__} cannot be encoded as JSON; declare the field as "
                f"{type(value).__name__} (to_fields converts typed fields) or use CBOR"
            )
        if isinstance(value, datetime) and value.utcoffset() is None:
            raise _NotPlain(f"datetime {value.isoformat()} has no timezone")
        return
    raise _NotPlain(f"{type(value).__name__} is not a plain value")


def _require_supported(content_type: str) -> None:
    if content_type not in CONTENT_TYPES:
        raise UnsupportedContentType(content_type, CONTENT_TYPES)


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


# --- CBOR --------------------------------------------------------------------------------------


def _loads_cbor(data: bytes) -> Any:
    if not data:
        raise MalformedBody("CBOR body is empty")
    end = _scan_plain(data)
    if end is None:  # something other than plain items: the full scan says what, or checks its tags
        end = _scan_item(data, 0, 0)
    if end != len(data):
        raise MalformedBody(f"CBOR body has {len(data) - end} bytes of trailing data after its value")
    try:
        return cbor2.loads(
            data,
            tag_hook=_reject_tag,
            str_errors="strict",
            max_depth=MAX_DEPTH + 2,
            allow_indefinite=False,
            allow_duplicate_keys=False,
        )
    except Exception as exc:
        # cbor2 raises CBORDecodeError, but a datetime or text it cannot build may surface as
        # ValueError or OverflowError: every one of them means the body is malformed.
        if isinstance(exc.__cause__, WireError):
            raise exc.__cause__ from None
        raise MalformedBody(f"CBOR body does not decode: {exc}") from exc


def _reject_tag(tag: cbor2.CBORTag, immutable: bool) -> NoReturn:
    # A second gate: _scan_item has already rejected every tag that could get here.
    raise _forbidden_tag(tag.tag)


def _forbidden_tag(tag: int) -> MalformedBody:
    name = _TAG_NAMES.get(tag)
    shown = f"CBOR tag {tag} ({name})" if name else f"CBOR tag {tag}"
    allowed = ", ".join(str(number) for number in ALLOWED_CBOR_TAGS)
    return MalformedBody(f"{shown} is not allowed in a keyqueue body; allowed tags: {allowed}")


def _truncated(pos: int) -> MalformedBody:
    return MalformedBody(f"CBOR body is truncated (an item at byte {pos} runs past the end)")


def _scan_head(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """Read the head of the item at ``pos``: (major type, additional info, argument, next pos)."""
    if pos >= len(data):
        raise _truncated(pos)
    major, info = data[pos] >> 5, data[pos] & 0x1F
    if info < 24:
        return major, info, info, pos + 1
    if info == 31:
        raise MalformedBody(
            f"CBOR body uses an indefinite length or a break at byte {pos}; keyqueue needs definite lengths"
        )
    if info > 27:
        raise MalformedBody(f"CBOR body has reserved additional information {info} at byte {pos}")
    end = pos + 1 + (1 << (info - 24))
    if end > len(data):
        raise _truncated(pos)
    return major, info, int.from_bytes(data[pos + 1 : end], "big"), end


def _scan_plain(data: bytes) -> int | None:
    """The end of the item at the start of ``data`` if it is made of plain items only (integers,
    strings, floats, booleans, null, arrays and maps with text keys, within ``MAX_DEPTH``); None at
    anything else (a tag, an error): :func:`_scan_item` then scans it again and says what.

    The same walk as :func:`_scan_item`, one loop with the containers on a stack: a body of a
    thousand bytes has a hundred items or more, and the recursive walk cost several times cbor2's
    own decoding of them (docs/benchmarks.md)."""
    size = len(data)
    pos = 0
    todo = 1  # items left in the innermost open container (first: the body's one item)
    in_map = False  # whether that container is a map (then, while ``todo`` is even, a key is next)
    stack: list[tuple[int, bool]] = []
    while True:
        if not todo:
            if not stack:
                return pos
            todo, in_map = stack.pop()
            continue
        if pos >= size:
            return None
        head = data[pos]
        major, info = head >> 5, head & 0x1F
        if in_map and not todo & 1 and major != _MAJOR_TEXT:
            return None
        todo -= 1
        if info < 24:
            arg, pos = info, pos + 1
        elif info < 28:
            end = pos + 1 + (1 << (info - 24))
            if end > size:
                return None
            arg, pos = int.from_bytes(data[pos + 1 : end], "big"), end
        else:
            return None
        if major <= 1:
            continue
        if major <= 3:
            if arg > size - pos:
                return None
            pos += arg
        elif major <= 5:
            if len(stack) >= MAX_DEPTH or arg > size - pos:
                return None
            stack.append((todo, in_map))
            todo, in_map = (arg * 2, True) if major == 5 else (arg, False)
        elif major == 6 or not (info in _FALSE_TRUE_NULL or info in _FLOAT_INFOS):
            return None


def _scan_item(data: bytes, pos: int, depth: int) -> int:
    """Check the item at ``pos`` (and everything in it) without decoding it; return its end."""
    start = pos
    major, info, arg, pos = _scan_head(data, pos)
    if major <= 1:  # unsigned and negative integers
        return pos
    if major <= 3:  # byte and text strings; cbor2 checks that text is UTF-8
        if arg > len(data) - pos:
            raise _truncated(start)
        return pos + arg
    if major <= 5:  # arrays and maps
        if depth >= MAX_DEPTH:
            raise MalformedBody(f"CBOR body nests deeper than {MAX_DEPTH} levels (at byte {start})")
        if arg > len(data) - pos:  # every item takes at least one byte
            raise _truncated(start)
        for _ in range(arg):
            if major == 5:
                if pos < len(data) and data[pos] >> 5 != _MAJOR_TEXT:
                    raise MalformedBody(f"CBOR map key at byte {pos} is not a text string")
                pos = _scan_item(data, pos, depth + 1)
            pos = _scan_item(data, pos, depth + 1)
        return pos
    if major == 6:
        content = _TAG_CONTENT.get(arg)
        if content is None:
            raise _forbidden_tag(arg)
        if pos < len(data) and data[pos] >> 5 not in content:
            raise MalformedBody(f"CBOR tag {arg} at byte {start} wraps the wrong kind of item")
        return _scan_item(data, pos, depth + 1)
    if info in _FALSE_TRUE_NULL or info in _FLOAT_INFOS:
        return pos
    if info == 23:
        raise MalformedBody(f"CBOR 'undefined' at byte {start} is not allowed; use null")
    raise MalformedBody(f"CBOR simple value {arg} at byte {start} is not allowed")


# --- JSON --------------------------------------------------------------------------------------


def _loads_json(data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedBody(f"JSON body is not valid UTF-8: {exc}") from None
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except WireError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise MalformedBody(f"JSON body does not decode: {exc}") from None


def _reject_constant(name: str) -> NoReturn:
    raise MalformedBody(f"JSON body contains {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedBody(f"JSON number {text[:40]} is out of range for a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise MalformedBody(f"JSON body repeats the key {key!r} in one object")
        result[key] = value
    return result
