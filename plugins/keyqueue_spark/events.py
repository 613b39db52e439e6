"""The lifecycle events stream contract (issue 8), as typed constants.

Stream ``KQ_<queue>_EVENTS`` (limits retention), subjects ``kq.<queue>.events.<event>``. Each
message has ``X-CONTENT-TYPE: application/cbor``, ``X-MESSAGE-TYPE: KeyqueueEvent``,
``X-MESSAGE-VERSION: 1`` and a CBOR map body with the fields of :data:`EVENT_FIELDS`.

This module imports neither pyspark nor keyqueue, so the events plugin may import
:data:`EVENT_FIELDS` without the ``spark`` extra; :func:`event_schema` builds the Spark schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

EventName = Literal["enqueued", "acquired", "started", "succeeded", "retried", "dead_lettered",
                    "superseded", "released", "dvu_started", "dvu_finished"]

EVENT_NAMES: Final[tuple[EventName, ...]] = (
    "enqueued", "acquired", "started", "succeeded", "retried", "dead_lettered",
    "superseded", "released", "dvu_started", "dvu_finished",
)
"""Every value the ``event`` field takes."""

FieldType = Literal["string", "double", "long"]

EVENT_FIELDS: Final[tuple[tuple[str, FieldType, str], ...]] = (
    ("event", "string", "one of EVENT_NAMES"),
    ("ts", "double", "when it happened, Unix seconds"),
    ("queue", "string", "the queue"),
    ("key", "string", "the key, or null for queue-wide events"),
    ("request_id", "string", "the request's Nats-Msg-Id, or null"),
    ("task", "string", "the task (X-MESSAGE-TYPE of the request), or null"),
    ("worker", "string", "the worker's name, or null"),
    ("attempt", "long", "1 for the first run of a request, 2 for its first retry, ...; or null"),
    ("wait", "double", "on started: seconds from enqueue to handler start; else null"),
    ("run", "double", "on succeeded/dead_lettered: handler seconds; on dvu_finished: DVU seconds; else null"),
    ("reason", "string", "DLQ reason, retry error or superseded/merged reason; or null"),
    ("triggers", "long", "on dvu_finished: how many requests/triggers the DVU run covered; else null"),
    ("run_id", "string", "DVU run id, or null"),
)
"""The body fields of a ``KeyqueueEvent`` v1: (name, type, meaning). Every field is nullable."""

EVENT_FIELD_NAMES: Final = tuple(name for name, _, _ in EVENT_FIELDS)

EVENT_MESSAGE_TYPE: Final = "KeyqueueEvent"
"""``X-MESSAGE-TYPE`` of lifecycle events."""

EVENT_VERSION: Final = 1
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
