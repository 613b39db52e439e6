"""Frozen dataclasses to and from plain field dicts, checked against their annotations.

Supported field annotations: ``str``, ``int``, ``float`` (an ``int`` on the wire is accepted),
``bool``, ``bytes``, ``datetime`` (timezone-aware), ``None``, unions such as ``X | None`` (arms
tried in order), ``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]``, bare
``list`` / ``tuple`` / ``dict``, ``Any`` (any plain value, see ``codec.check_plain``) and nested
frozen dataclasses. Fields with ``init=False`` are not transferred.

CBOR carries ``bytes`` and ``datetime`` natively. JSON has neither, so for ``content_type=JSON``
a ``bytes`` field travels as standard base64 text and a ``datetime`` field as ISO 8601 text;
the annotation says how to read them back. Inside an ``Any`` field there is no annotation to
say so, and ``bytes`` or ``datetime`` there cannot be encoded as JSON (``MalformedBody``).

Decoding is strict: a missing required field, an unknown field or a value of the wrong type is
a ``MalformedBody`` naming the field's path (``Review.files[2].path``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import types
import typing
from collections.abc import Hashable, Mapping
from datetime import datetime
from typing import Any, NamedTuple, TypeVar, get_args, get_origin

from keyqueue.errors import ConfigError, MalformedBody, WireError
from keyqueue.wire.codec import check_plain
from keyqueue.wire.headers import CBOR, JSON

__all__ = ["check_annotations", "from_fields", "to_fields"]

T = TypeVar("T")

_SCALARS: typing.Final = (str, int, float, bool, bytes, datetime, type(None))


class _Field(NamedTuple):
    name: str
    hint: Any
    required: bool


def to_fields(obj: Any, *, content_type: str = CBOR) -> dict[str, Any]:
    """The fields of the dataclass instance ``obj`` as a plain dict, ready for ``codec.dumps``.

    Values are checked against the annotations (a frozen dataclass does not check them when it
    is built), so a wrong value fails here, before anything is published, as ``MalformedBody``.
    """
    cls = type(obj)
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_fields needs a dataclass instance, got {cls.__name__}")
    return _dump_dataclass(obj, cls.__name__, content_type == JSON)


def from_fields(cls: type[T], fields: Mapping[str, Any], *, content_type: str = CBOR) -> T:
    """Build ``cls`` from a plain field dict (as ``codec.loads_map`` returns it).

    Raises ``MalformedBody`` for a missing required field, an unknown field, a value of the
    wrong type, or an exception from the class's own ``__init__`` / ``__post_init__``.
    """
    return _load_dataclass(cls, fields, cls.__name__, content_type == JSON)


def check_annotations(cls: type) -> None:
    """Raise ``ConfigError`` unless ``cls`` is a frozen dataclass whose fields are all supported."""
    _check_hint(cls, cls.__name__, set())


# --- annotations -------------------------------------------------------------------------------


def _fields_of(cls: type[object]) -> tuple[_Field, ...]:
    """The ``__init__`` fields of the dataclass ``cls`` with resolved annotations (cached)."""
    # A class is hashable, but mypy does not match type objects against Hashable.
    return _resolve_fields(typing.cast(Hashable, cls))


@functools.cache
def _resolve_fields(cls: Any) -> tuple[_Field, ...]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:
        raise ConfigError(f"cannot resolve the field annotations of {cls.__qualname__}: {exc}") from exc
    return tuple(
        _Field(
            field.name,
            hints[field.name],
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING,
        )
        for field in dataclasses.fields(cls)
        if field.init
    )


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (typing.Union, types.UnionType)


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _show(hint: Any) -> str:
    if isinstance(hint, type) and not get_args(hint):
        return "None" if hint is type(None) else hint.__name__
    return str(hint).replace("typing.", "")


def _check_hint(hint: Any, path: str, seen: set[type]) -> None:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or hint in _SCALARS or hint in (list, tuple, dict):
        return
    if _is_union(hint):
        for arm in args:
            _check_hint(arm, path, seen)
    elif origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        _check_hint(args[0], f"{path}[]", seen)
    elif origin is tuple:
        for index, arm in enumerate(args):
            _check_hint(arm, f"{path}[{index}]", seen)
    elif origin is dict:
        if args[0] is not str:
            raise ConfigError(f"{path}: {_show(hint)} is not supported; map keys must be str")
        _check_hint(args[1], f"{path}[]", seen)
    elif _is_dataclass_type(hint):
        if hint in seen:  # a recursive type, already being checked
            return
        if not hint.__dataclass_params__.frozen:
            raise ConfigError(f"{path}: {hint.__qualname__} must be a frozen dataclass")
        seen.add(hint)
        for field in _fields_of(hint):
            _check_hint(field.hint, f"{path}.{field.name}", seen)
    else:
        raise ConfigError(f"{path}: the annotation {_show(hint)} is not supported in a message")


# --- to the wire -------------------------------------------------------------------------------


def _mismatch(path: str, hint: Any, value: Any) -> MalformedBody:
    return MalformedBody(f"{path}: expected {_show(hint)}, got {type(value).__name__}")


def _dump_dataclass(obj: Any, path: str, as_json: bool) -> dict[str, Any]:
    return {
        field.name: _dump(getattr(obj, field.name), field.hint, f"{path}.{field.name}", as_json)
        for field in _fields_of(type(obj))
    }


def _dump(value: Any, hint: Any, path: str, as_json: bool) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        check_plain(value, JSON if as_json else CBOR, path)
        return value
    if _is_union(hint):
        for arm in args:
            try:
                return _dump(value, arm, path, as_json)
            except MalformedBody:
                continue
        raise _mismatch(path, hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return _widen(value, path)
    if hint in _SCALARS:
        if type(value) is not hint and not (hint is datetime and isinstance(value, datetime)):
            raise _mismatch(path, hint, value)
        if isinstance(value, datetime):
            if value.utcoffset() is None:
                raise MalformedBody(f"{path}: datetime {value.isoformat()} has no timezone")
            return value.isoformat() if as_json else value
        if isinstance(value, bytes) and as_json:
            return base64.b64encode(value).decode("ascii")
        check_plain(value, JSON if as_json else CBOR, path)  # a float must be finite in JSON
        return value
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise _mismatch(path, hint, value)
        return [_dump(item, hint_, f"{path}[{i}]", as_json) for i, (item, hint_) in _items(value, hint, path)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(path, hint, value)
        value_hint = args[1] if args else Any
        return {
            _key(key, path): _dump(item, value_hint, f"{path}[{key!r}]", as_json)
            for key, item in value.items()
        }
    if _is_dataclass_type(hint):
        if not isinstance(value, hint):
            raise _mismatch(path, hint, value)
        return _dump_dataclass(value, path, as_json)
    raise ConfigError(f"{path}: the annotation {_show(hint)} is not supported in a message")


def _items(value: list[Any] | tuple[Any, ...], hint: Any, path: str) -> list[tuple[int, tuple[Any, Any]]]:
    """Pair each element of a list/tuple value with the annotation that applies to it."""
    args = get_args(hint)
    if get_origin(hint) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise MalformedBody(f"{path}: expected {len(args)} items, got {len(value)}")
        return list(enumerate(zip(value, args, strict=True)))
    item_hint = args[0] if args else Any
    return [(index, (item, item_hint)) for index, item in enumerate(value)]


def _widen(value: int, path: str) -> float:
    """An ``int`` where a ``float`` is declared: the float, if there is one that large."""
    try:
        return float(value)
    except OverflowError:
        raise MalformedBody(f"{path}: the integer is too large for a float") from None


def _key(key: Any, path: str) -> str:
    if not isinstance(key, str):
        raise MalformedBody(f"{path}: map key {key!r} is not a string")
    return key


# --- from the wire -----------------------------------------------------------------------------


def _load_dataclass(cls: type[T], fields: Any, path: str, as_json: bool) -> T:
    if not isinstance(fields, Mapping):
        raise MalformedBody(f"{path}: expected a map of fields, got {type(fields).__name__}")
    known = _fields_of(cls)
    names = {field.name for field in known}
    unknown = sorted(str(key) for key in fields if key not in names)
    if unknown:
        raise MalformedBody(
            f"{path}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"{cls.__name__} has {', '.join(sorted(names)) or 'no fields'}"
        )
    kwargs: dict[str, Any] = {}
    for field in known:
        if field.name in fields:
            kwargs[field.name] = _load(fields[field.name], field.hint, f"{path}.{field.name}", as_json)
        elif field.required:
            raise MalformedBody(f"{path}: missing required field {field.name!r}")
    try:
        return cls(**kwargs)
    except WireError:
        raise
    except Exception as exc:  # __post_init__ validation, for instance
        raise MalformedBody(f"{path}: {cls.__name__} rejected its fields: {exc}") from exc


def _load(value: Any, hint: Any, path: str, as_json: bool) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if _is_union(hint):
        for arm in args:
            try:
                return _load(value, arm, path, as_json)
            except MalformedBody:
                continue
        raise _mismatch(path, hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return _widen(value, path)
    if hint is bytes and as_json:
        return _from_base64(value, path)
    if hint is datetime and as_json:
        return _from_iso(value, path)
    if hint in _SCALARS:
        if type(value) is not hint:
            raise _mismatch(path, hint, value)
        return value
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list):
            raise _mismatch(path, hint, value)
        items = [
            _load(item, hint_, f"{path}[{i}]", as_json) for i, (item, hint_) in _items(value, hint, path)
        ]
        return tuple(items) if hint is tuple or origin is tuple else items
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(path, hint, value)
        value_hint = args[1] if args else Any
        return {
            _key(key, path): _load(item, value_hint, f"{path}[{key!r}]", as_json)
            for key, item in value.items()
        }
    if _is_dataclass_type(hint):
        return _load_dataclass(hint, value, path, as_json)
    raise ConfigError(f"{path}: the annotation {_show(hint)} is not supported in a message")


def _from_base64(value: Any, path: str) -> bytes:
    if not isinstance(value, str):
        raise _mismatch(path, "bytes (base64 text in JSON)", value)
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise MalformedBody(f"{path}: bytes field is not valid base64 text: {exc}") from None


def _from_iso(value: Any, path: str) -> datetime:
    if not isinstance(value, str):
        raise _mismatch(path, "datetime (ISO 8601 text in JSON)", value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise MalformedBody(f"{path}: datetime field is not ISO 8601 text: {exc}") from None
    if parsed.utcoffset() is None:
        raise MalformedBody(f"{path}: datetime {value!r} has no timezone")
    return parsed
