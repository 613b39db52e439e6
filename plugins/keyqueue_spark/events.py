"""The Spark side of keyqueue's lifecycle events: a Spark schema for them and rows from their bodies.

The contract itself (stream, names, fields and their types) is :mod:`keyqueue.events`; the
schema is built from its :data:`~keyqueue.events.EVENT_FIELDS`, so it follows any field added
there. This module imports pyspark only inside :func:`event_schema`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from keyqueue.events import EVENT_FIELDS

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["coerce_event", "event_schema"]


def coerce_event(fields: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of ``EVENT_FIELDS`` from a decoded body, in order, with numbers widened."""
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
    """The Spark schema of ``EVENT_FIELDS``: one nullable column per field, typed by its field type."""
    from pyspark.sql.types import DataType, DoubleType, LongType, StringType, StructField, StructType

    types: dict[str, DataType] = {"string": StringType(), "double": DoubleType(), "long": LongType()}
    return StructType([StructField(field.name, types[field.type], True) for field in EVENT_FIELDS])
