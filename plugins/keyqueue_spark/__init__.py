"""keyqueue on Spark: the ``keyqueue`` data source (reader and sink), ``keyqueue report`` and
``keyqueue backfill``. Install with the ``spark`` extra; see docs/spark.md.

Only :mod:`plugins.keyqueue_spark._keyqueue` imports keyqueue itself; :mod:`.events` imports
neither keyqueue nor pyspark, so its schema constant is cheap to import anywhere.
"""

from __future__ import annotations

from plugins.keyqueue_spark.events import EVENT_FIELDS, EVENT_NAMES, event_schema
from plugins.keyqueue_spark.session import register, spark_session

__all__ = ["EVENT_FIELDS", "EVENT_NAMES", "event_schema", "register", "spark_session"]
