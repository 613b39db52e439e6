"""The lifecycle events stream contract (issue 8), as typed constants.

Stream ``KQ_<queue>_EVENTS`` (limits retention), subjects ``kq.<queue>.events.<event>``. Each
message has ``X-CONTENT-TYPE: application/cbor``, ``X-MESSAGE-TYPE: KeyqueueEvent``,
``X-MESSAGE-VERSION: 1`` and a CBOR map body with the fields of :data:`EVENT_FIELDS`.

The constants come from ``keyqueue.builtins.events`` (the plugin that publishes the events owns the
contract); this module does not import pyspark, and :func:`event_schema` builds the Spark schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from plugins.keyqueue_spark import _keyqueue as _kq

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

EventName = Literal["enqueued", "acquired", "started", "succeeded", "retried", "dead_lettered",
                    "superseded", "released", "dvu_started", "dvu_finished"]

# The contract is keyqueue's (``keyqueue.builtins.events``, which publishes it); this module gives it the
# types the Spark side works with.
EVENT_NAMES: Final = cast("tuple[EventName, ...]", _kq.EVENT_NAMES)
"""Every value the ``event`` field takes."""

FieldType = Literal["string", "double", "long"]

EVENT_FIELDS: Final = cast("tuple[tuple[str, FieldType, str], ...]", _kq.EVENT_FIELDS)
"""The body fields of a ``KeyqueueEvent`` v1: (name, type, meaning). Every field is nullable."""

EVENT_FIELD_NAMES: Final = _kq.EVENT_FIELD_NAMES

EVENT_MESSAGE_TYPE: Final = _kq.EVENT_MESSAGE_TYPE
"""``X-MESSAGE-TYPE`` of lifecycle events."""

EVENT_VERSION: Final = _kq.EVENT_VERSION
"""``X-MESSAGE-VERSION`` of the events described here."""


def event(name: EventName, ts: float, queue: str, **fields: Any) -> dict[str, Any]:
    """An event body with every field of the contract (unset ones null); raises on unknown fields."""
    unknown = set(fields) - set(EVENT_FIELD_NAMES)
    if unknown:
        raise ValueError(f"not event fields: {', '.join(sorted(unknown))}")
    if name not in EVENT_NAMES:
        raise ValueError(f"{name!r} is not one of {', '.join(EVENT_NAMES)}")
    body: dict[str, Any] = dict.fromkeys(EVENT_FIELD_NAMES)
    body.update(fields, event=name, ts=float(ts), queue=queue)
    return body


def coerce_event(fields: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of :data:`EVENT_FIELDS` from a decoded body, in order, with numbers widened."""
    values: list[Any] = []
    for name, kind, _ in EVENT_FIELDS:
        value = fields.get(name)
        if value is not None:
            if kind == "double" and isinstance(value, int | float) and not isinstance(value, bool):
                value = float(value)
            elif kind == "long" and isinstance(value, int) and not isinstance(value, bool):
                value = int(value)
            elif kind == "string" and not isinstance(value, str):
                value = str(value)
            elif kind != "string":
                value = None  # a wrong type in one field must not fail the whole read
        values.append(value)
    return tuple(values)


def event_schema() -> StructType:
    """The Spark schema of :data:`EVENT_FIELDS`."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    types = {"string": StringType(), "double": DoubleType(), "long": LongType()}
    return StructType([StructField(name, types[kind], True) for name, kind, _ in EVENT_FIELDS])
