"""keyqueue on Spark: the ``keyqueue`` data source (reader and sink), ``keyqueue report`` and
``keyqueue backfill``. The ``keyqueue-spark`` distribution (this folder's pyproject.toml); see
docs/spark.md.

Importing the package does not import pyspark: the data source, the sink and the commands import
it when used.
"""

from __future__ import annotations

from .events import event_schema
from .session import register, spark_session

__all__ = ["event_schema", "register", "spark_session"]
