"""A SparkSession for keyqueue's jobs, with the ``keyqueue`` data source registered."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Make ``format("keyqueue")`` available on ``spark`` (idempotent)."""
    from .source import KeyqueueDataSource

    spark.dataSource.register(KeyqueueDataSource)


def spark_session(master: str = "local[*]", app_name: str = "keyqueue", *,
                  conf: Mapping[str, str] | None = None, quiet: bool = True) -> SparkSession:
    """A session on ``master`` (``local[*]`` by default) with the keyqueue source registered.

    Locally, Python workers run this interpreter (so they import keyqueue and nats-py); on a
    cluster, set ``spark.pyspark.python`` to an environment with ``keyqueue-spark`` installed.
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {
        "spark.sql.shuffle.partitions": "8" if master.startswith("local") else "200",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
    }
    if master.startswith("local"):
        settings["spark.pyspark.python"] = sys.executable
        settings["spark.pyspark.driver.python"] = sys.executable
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings.update(conf or {})
    for name, value in settings.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
