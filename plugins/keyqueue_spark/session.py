"""A SparkSession for keyqueue's jobs, with the ``keyqueue`` data source registered."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

QUIET_LOGGING: Final = Path(__file__).with_name("log4j2-quiet.properties")
"""The driver's log4j2 configuration with ``quiet=True``: errors only (no WARN lines at start)."""


def register(spark: SparkSession) -> None:
    """Make ``format("keyqueue")`` available on ``spark`` (idempotent)."""
    from .source import KeyqueueDataSource

    spark.dataSource.register(KeyqueueDataSource)


def spark_session(master: str = "local[*]", app_name: str = "keyqueue", *,
                  conf: Mapping[str, str] | None = None, quiet: bool = True) -> SparkSession:
    """A session on ``master`` (``local[*]`` by default) with the keyqueue source registered.

    Python workers run this interpreter (so they import keyqueue and nats-py) unless ``conf``
    names another (``spark.pyspark.python``) or, on a cluster, ``$PYSPARK_PYTHON`` does: a Python
    with ``keyqueue-spark`` installed on every executor's host. (Spark's own default, ``python3``,
    rarely has it.)
    ``quiet``: the driver logs errors only, from its start (:data:`QUIET_LOGGING`, when this call
    starts the JVM) and afterwards (``setLogLevel("ERROR")``, also on a session already running).
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {
        "spark.sql.shuffle.partitions": "8" if master.startswith("local") else "200",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
    }
    settings.update(conf or {})
    # The driver's own Python workers (a data source's planning and commits) run this Python; the
    # executors' run spark.pyspark.python, else $PYSPARK_PYTHON, else this one too. PySpark sends
    # its Python functions with the executable $PYSPARK_PYTHON names when the context starts
    # (spark.pyspark.python alone is not enough when Python starts the JVM), so it is set here.
    local = master.startswith("local")
    executors = (settings.get("spark.pyspark.python") or (None if local else os.environ.get("PYSPARK_PYTHON"))
                 or sys.executable)
    settings.setdefault("spark.pyspark.driver.python", sys.executable)
    settings["spark.pyspark.python"] = executors
    os.environ["PYSPARK_PYTHON"] = executors
    if quiet:
        # Set before the JVM starts: Spark logs its start-up WARN lines before setLogLevel can run.
        option = f"-Dlog4j2.configurationFile={QUIET_LOGGING.as_uri()}"
        given = settings.get("spark.driver.extraJavaOptions")
        settings["spark.driver.extraJavaOptions"] = f"{given} {option}" if given else option
    for name, value in settings.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
