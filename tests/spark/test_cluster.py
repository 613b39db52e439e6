"""The Spark plugin on a real standalone cluster: a master and two workers on loopback, executors in JVMs of their own.

The cluster (one per module: its JVMs take ~20 s to start) comes from the installed pyspark
(:mod:`tests.spark.cluster`). Each test has one driver of the cluster (a driver takes 10-30 s
to start here with its executors: two keep the module near two minutes), used as a user would:

* ``keyqueue backfill --master spark://127.0.0.1:PORT --conf ...``, a driver of its own;
* pyspark's Spark Connect server (``sbin/start-connect-server.sh``) on the cluster, and, with no
  JVM of their own, a client script of the data source (batch and streaming reads and writes)
  and ``keyqueue report --master sc://127.0.0.1:PORT``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyqueue.server.embedded import EmbeddedServer
from tests.spark.cluster import StandaloneCluster, loopback_env
from tests.spark.connect_job import KEYS, PARTITIONS, ROWS, WRITE_QUEUE
from tests.spark.fixtures import history, publish_history
from tests.spark.helpers import run, stream_messages
from tests.spark.stream_job import SOURCE_QUEUE, TARGET_QUEUE

REPO = Path(__file__).resolve().parents[2]
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))
DRIVER_TIMEOUT = 300
REPORT_QUEUE = "rebaser"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    started = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1)
    try:
        yield started
    finally:
        started.stop()


def driver_env() -> dict[str, str]:
    return {**loopback_env(), "PYTHONPATH": str(REPO)}


def conf_args(cluster: StandaloneCluster) -> list[str]:
    return [f"{name}={value}" for name, value in {**cluster.driver_conf(), "spark.driver.memory": "768m"}.items()]


def apps_run(cluster: StandaloneCluster) -> list[set[str]]:
    return [{d.parent.name for d in dirs} for dirs in cluster.executor_dirs()]


@pytest.mark.timeout(600)  # a driver and its executors start in 20-60 s here, more on a loaded machine
def test_keyqueue_backfill_runs_on_a_standalone_cluster(
        cluster: StandaloneCluster, server: EmbeddedServer, tmp_path: Path) -> None:
    rows = [(f"acct-{i % 7}", i) for i in range(500)]
    data = tmp_path / "payments.csv"
    data.write_text("account,amount\n" + "".join(f"{a},{n}\n" for a, n in rows))
    conf = [arg for pair in conf_args(cluster) for arg in ("--conf", pair)]
    before = apps_run(cluster)

    backfill = subprocess.run([KEYQUEUE, "backfill", str(data), "--queue", "shop", "--task", "post", "--key",
                               "account", "--columns", "account,amount", "--url", server.url,
                               "--master", cluster.url, *conf], cwd=tmp_path, env=driver_env(),
                              capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
    assert backfill.returncode == 0, backfill.stderr[-4000:]
    assert f"starting Spark ({cluster.url}) ..." in backfill.stderr
    assert "500 rows: 500 enqueued in " in backfill.stdout
    stored = [body for _, _, _, body in run(stream_messages(server.url, "KQ_shop_INBOX"))]
    assert sorted((b["account"], b["amount"]) for b in stored) == sorted(rows)
    for account in {a for a, _ in rows}:  # each key's rows in input order
        assert [b["amount"] for b in stored if b["account"] == account] == [n for a, n in rows if a == account]

    # The command ran its tasks on the cluster's executors: one more application on each worker.
    assert [len(after - seen) for after, seen in zip(apps_run(cluster), before, strict=True)] == [1, 1]


@pytest.mark.timeout(600)
def test_the_data_source_and_report_through_spark_connect_on_the_cluster(
        cluster: StandaloneCluster, server: EmbeddedServer, tmp_path: Path) -> None:
    events = history(SOURCE_QUEUE, requests=150)
    run(publish_history(server.url, SOURCE_QUEUE, events))
    run(publish_history(server.url, REPORT_QUEUE, history(REPORT_QUEUE, requests=200)))
    before = apps_run(cluster)

    with cluster.connect_server() as remote:
        job = subprocess.run([sys.executable, "-m", "tests.spark.connect_job", remote, server.url, str(tmp_path)],
                             cwd=REPO, env=driver_env(), capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
        assert job.returncode == 0, job.stderr[-4000:]
        report = subprocess.run([KEYQUEUE, "report", REPORT_QUEUE, "--url", server.url, "--master", remote,
                                 "--out", str(tmp_path / "report")], cwd=tmp_path, env=driver_env(),
                                capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
    result: dict[str, Any] = json.loads(job.stdout.strip().splitlines()[-1])

    # The Connect server is a driver of the cluster: its tasks ran in executor JVMs, one on each worker.
    assert [len(after - seen) for after, seen in zip(apps_run(cluster), before, strict=True)] == [1, 1]

    every = list(range(1, len(events) + 1))
    assert result["read"] == every  # batch: each message once, over 4 sequence ranges

    write = result["write"]
    assert (write["rows"], write["accepted"], write["duplicates"], write["errors"], write["partitions"]) == (
        ROWS, ROWS, 0, 0, PARTITIONS)
    stored = run(stream_messages(server.url, f"KQ_{WRITE_QUEUE}_INBOX"))
    assert sorted(body["n"] for _, _, _, body in stored) == list(range(ROWS))
    for _, subject, _, body in stored:
        assert subject == f"kq.{WRITE_QUEUE}.in.doc-{body['n'] % KEYS}"

    keyed = {seq: e for seq, e in enumerate(events, start=1) if e.get("key") is not None}
    audits = run(stream_messages(server.url, f"KQ_{TARGET_QUEUE}_INBOX"))
    # A streaming read into a streaming write: each keyed event once, each key's in order.
    assert sorted(body["seq"] for _, _, _, body in audits) == sorted(keyed)
    assert result["stream_write"]["errors"] == 0
    by_key: dict[str, list[int]] = defaultdict(list)
    for _, subject, _, body in audits:
        by_key[subject].append(body["seq"])
    assert all(seqs == sorted(seqs) for seqs in by_key.values())

    assert report.returncode == 0, report.stderr[-4000:]
    assert f"connecting to Spark Connect ({remote}) ..." in report.stderr
    assert "tasks: Rebase, Reindex; DVU: 30 runs, 3.00 triggers per run" in report.stdout
    assert (tmp_path / "report" / "report.html").is_file()
