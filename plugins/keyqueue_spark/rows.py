"""A Spark row as a request: its values as plain wire values, and its derived request id.

A request id is sha256 of (:data:`ID_SCHEME`, job id, task, version, key, the row's identity),
written as a ULID-shaped string; :class:`RowIdentity` makes the identity from an id column's
value or from the row's content (see :mod:`keyqueue_spark.sink`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Final

from pyspark.sql import Row
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DateType,
    DecimalType,
    MapType,
    StructType,
    TimestampNTZType,
    TimestampType,
)
from ulid import ULID

ID_SCHEME: Final = "keyqueue-spark/1"
"""Mixed into every derived request id; bump it only to change how ids are derived."""


def plain_converter(data_type: DataType) -> Callable[[Any], Any]:
    """Turn a Spark value of ``data_type`` into a plain wire value.

    Timestamps become timezone-aware UTC datetimes (Spark hands them over as naive local time),
    timestamps without a zone, dates and decimals become ISO/exact text, binaries bytes, structs
    and maps dicts, arrays lists.
    """
    if isinstance(data_type, TimestampType):
        return lambda v: None if v is None else v.astimezone(UTC)
    if isinstance(data_type, TimestampNTZType | DateType):
        return lambda v: None if v is None else v.isoformat()
    if isinstance(data_type, DecimalType):
        return lambda v: None if v is None else str(v)
    if isinstance(data_type, BinaryType):
        return lambda v: None if v is None else bytes(v)
    if isinstance(data_type, ArrayType):
        element = plain_converter(data_type.elementType)
        return lambda v: None if v is None else [element(e) for e in v]
    if isinstance(data_type, MapType):
        value = plain_converter(data_type.valueType)
        return lambda v: None if v is None else {k: value(x) for k, x in v.items()}
    if isinstance(data_type, StructType):
        fields = [(f.name, plain_converter(f.dataType)) for f in data_type.fields]
        return lambda v: None if v is None else {name: conv(v[name]) for name, conv in fields}
    return _loose


def _loose(value: Any) -> Any:
    # Values whose Spark type says nothing more (ints, strings, ...), and stragglers.
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, Row):
        return {k: _loose(v) for k, v in value.asDict().items()}
    return value


def derive_request_id(job_id: str, task: str, version: int, key: str, identity: bytes) -> str:
    """A ULID-shaped request id from sha256 of the job, task, version, key and the row's identity."""
    digest = hashlib.sha256()
    for part in (ID_SCHEME, job_id, task, str(version), key):
        digest.update(part.encode())
        digest.update(b"\x00")
    digest.update(identity)
    return str(ULID.from_bytes(digest.digest()[:16]))


class RowIdentity:
    """The identity part of each row's request id, as the module docstring describes."""

    def __init__(self) -> None:
        self._seen: dict[bytes, int] = {}

    def by_content(self, key: str, body: bytes) -> bytes:
        content = hashlib.sha256(key.encode() + b"\x00" + body).digest()[:16]
        occurrence = self._seen.get(content, 0)
        self._seen[content] = occurrence + 1
        return b"content\x00" + content + str(occurrence).encode()

    @staticmethod
    def by_column(value: Any) -> bytes:
        return b"column\x00" + json.dumps(value, default=str, sort_keys=True).encode()
