"""Spark tests share ONE local SparkSession (a JVM start costs ~10 s here); each test gets its own nats-server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyqueue.server.embedded import EmbeddedServer

FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Client-compiler only: the small jobs of the tests start about 40% sooner."""


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2] SparkSession with the keyqueue source registered, shared by every Spark test."""
    if shutil.which("java") is None:
        pytest.fail("the Spark tests need Java 17+: run `make java-check` (installs openjdk-17-jre-headless)")
    from keyqueue_spark.session import spark_session

    session = spark_session("local[2]", "keyqueue-tests", conf={
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "2",
        "spark.driver.extraJavaOptions": FAST_JVM,
    })
    yield session
    session.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A nats-server for one test, started without an event loop (Spark tests are synchronous)."""
    nats = EmbeddedServer(store_dir=tmp_path / "nats-store", log_file=tmp_path / "nats-server.log")
    nats.start_sync()
    try:
        yield nats
    finally:
        nats.close_sync()
