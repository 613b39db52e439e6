"""``keyqueue backfill`` and ``keyqueue report`` as a user runs them, against a real nats-server.

The commands run through ``keyqueue``'s own command line (click's CliRunner, sharing the tests'
Spark session), and once as a subprocess that starts its own Spark, to see what a user sees on
stderr. The task modules are written to a temporary directory, as a user's ``shop.py``.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from click.testing import CliRunner, Result

import keyqueue
from keyqueue.cli import main
from keyqueue.errors import StreamNotFound
from keyqueue.ext import JetStreamApi, QueueNames, connect
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.server.embedded import EmbeddedServer
from tests.spark.fixtures import history, plain_history, publish_history
from tests.spark.helpers import message_count, run, stream_messages

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

SHOP = """
import keyqueue

app = keyqueue.App("shop", autoload_plugins=False, set_as_default=False)
posted = []
after_post = []  # callbacks the tests wait with


@app.task(key="{account}")
async def post(account: str, amount: int) -> None:
    posted.append((account, amount))
    for callback in after_post:
        callback()
"""

PAYMENTS = [("acct-1", 5), ("acct-2", 7), ("acct-1", 9), ("acct-3", 1), ("acct-2", 3),
            ("acct-1", 2), ("acct-3", 8), ("acct-2", 4), ("acct-1", 6), ("acct-3", 10)]


@pytest.fixture
def shop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    """A user's project: ``<name>.py`` (the SHOP app) in the current directory; yields ``<name>:app``."""
    name = f"shop_{request.node.name.removeprefix('test_')[:40]}"
    (tmp_path / f"{name}.py").write_text(SHOP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KEYQUEUE_URL", raising=False)
    try:
        yield f"{name}:app"
    finally:
        sys.modules.pop(name, None)


def keyqueue_cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def inbox_count(url: str, queue: str) -> int:
    """Requests stored in the queue's inbox (a key given back keeps a release marker for a second: not one)."""

    async def count() -> int:
        nc = await connect(url)
        try:
            return await requests_waiting(JetStreamApi(nc), QueueNames(queue))
        except StreamNotFound:
            return 0
        finally:
            await nc.close()
    return int(run(count()))


def payments_csv(path: Path, rows: list[tuple[str, int]] = PAYMENTS) -> str:
    path.write_text("account,amount\n" + "".join(f"{a},{n}\n" for a, n in rows))
    return str(path)


async def drain(module: Any, count: int) -> None:
    """Serve the SHOP module's app until its task ran ``count`` times."""
    enough = asyncio.Event()
    module.after_post.append(lambda: enough.set() if len(module.posted) >= count else None)
    try:
        async with app_worker(module.app):
            await asyncio.wait_for(enough.wait(), 30)
    finally:
        await module.app.close()


def app_worker(app: keyqueue.App) -> keyqueue.Worker:
    return app.worker(linger=0.01, drain_timeout=1)


# --- backfill --------------------------------------------------------------------------------------


def test_backfill_passes_the_key_column_the_task_takes_and_says_what_a_rerun_did(
        spark: Any, server: EmbeddedServer, shop: str, tmp_path: Path) -> None:
    data = payments_csv(tmp_path / "payments.csv")

    first = keyqueue_cli("backfill", data, "--app", shop, "--task", "post", "--key", "account", "--url", server.url)
    assert first.exit_code == 0, first.output
    assert "10 rows: 10 enqueued in " in first.stdout

    # A worker of the app runs every row: the key column reached the task as its `account`.
    module = sys.modules[shop.partition(":")[0]]
    run(drain(module, len(PAYMENTS)))
    assert sorted(module.posted) == sorted(PAYMENTS)
    for account in {a for a, _ in PAYMENTS}:  # each key's rows in input order
        assert [n for a, n in module.posted if a == account] == [n for a, n in PAYMENTS if a == account]
    assert run(message_count(server.url, "KQ_shop_DLQ")) == 0

    again = keyqueue_cli("backfill", data, "--app", shop, "--task", "post", "--key", "account", "--url", server.url)
    assert again.exit_code == 0, again.output
    assert ("10 rows: 0 enqueued, 10 duplicates (already enqueued under job id 'backfill:post:payments.csv': "
            "pass another --job-id to enqueue them again) in ") in again.stdout
    assert inbox_count(server.url, "shop") == 0  # the worker took the 10; the rerun stored nothing


def test_backfill_refuses_a_row_that_does_not_fit_the_task_before_storing_any(
        spark: Any, server: EmbeddedServer, shop: str, tmp_path: Path) -> None:
    lines = tmp_path / "payments.jsonl"
    lines.write_text('{"account": "acct-1", "amount": 5}\n{"account": "acct-2", "amount": 7}\n{"account": "acct-3"}\n')
    missing = keyqueue_cli("backfill", str(lines), "--app", shop, "--task", "post", "--key", "account",
                           "--url", server.url)
    assert missing.exit_code == 1
    assert missing.stderr == ("Error: row 3 of payments.jsonl (account 'acct-3') does not fit task post: post(): "
                              "argument 'amount' must be int, not NoneType; nothing was enqueued\n")

    extra = tmp_path / "notes.csv"
    extra.write_text("account,amount,note\nacct-1,5,first\n")
    unexpected = keyqueue_cli("backfill", str(extra), "--app", shop, "--task", "post", "--key", "account",
                              "--url", server.url)
    assert unexpected.exit_code == 1
    assert "row 1 of notes.csv (account 'acct-1') does not fit task post: post(): got an unexpected keyword " \
           "argument 'note'; nothing was enqueued" in unexpected.stderr
    assert inbox_count(server.url, "shop") == 0


def test_backfill_and_report_find_the_server_as_every_keyqueue_command_does(
        spark: Any, shop: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payments_csv(tmp_path / "payments.csv")
    for command in (["report", "shop"], ["backfill", data, "--queue", "shop", "--task", "post", "--key", "account"]):
        result = keyqueue_cli(*command)
        assert result.exit_code == 1
        assert result.stderr == ("Error: no NATS server: pass --url or set KEYQUEUE_URL "
                                 "(`keyqueue dev-server` runs one)\n"), command
        assert "starting Spark" not in result.output

    # With --app and no URL: the app's embedded server (here one a worker of the app would have started).
    monkeypatch.setenv("KEYQUEUE_DATA_DIR", str(tmp_path / "data"))
    running = keyqueue.App("shop", autoload_plugins=False, set_as_default=False)
    url = run(running.url())
    try:
        result = keyqueue_cli("backfill", data, "--app", shop, "--task", "post", "--key", "account")
        assert result.exit_code == 0, result.output
        assert "10 rows: 10 enqueued" in result.stdout
        bodies = [body for _, _, _, body in run(stream_messages(url, "KQ_shop_INBOX"))]
        assert sorted((b["account"], b["amount"]) for b in bodies) == sorted(PAYMENTS)
    finally:
        run(running.close())


class BacklogWatch:
    """A worker of the shop queue, in a thread of its own, and the highest backlog seen meanwhile.

    The worker holds its first request until the backlog reaches ``hold_until`` (so the backfill
    must wait for it); once it runs, it also enqueues ``others`` requests of its own (traffic that
    is not the backfill's). ``highest`` is the most requests the inbox held at any sampling.
    """

    def __init__(self, url: str, expected: int, hold_until: int, others: int) -> None:
        self.url, self.expected, self.hold_until, self.others = url, expected, hold_until, others
        self.posted: list[tuple[str, int]] = []
        self.highest = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="backlog-watch")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:
            self.error = e

    async def _serve(self) -> None:
        app = keyqueue.App("shop", url=self.url, autoload_plugins=False, set_as_default=False)
        full, done = asyncio.Event(), asyncio.Event()

        @app.task(key="{account}")
        async def post(account: str, amount: int) -> None:
            await full.wait()
            self.posted.append((account, amount))
            if len(self.posted) == 1:
                await post.enqueue_many([{"account": "other", "amount": n} for n in range(self.others)])
            if len(self.posted) == self.expected + self.others:
                done.set()

        async def sample() -> None:
            nc = await connect(self.url, name="backlog-watch")
            try:
                while not done.is_set():
                    try:
                        backlog = (await JetStreamApi(nc).stream_info("KQ_shop_INBOX"))["state"]["messages"]
                    except StreamNotFound:
                        backlog = 0
                    self.highest = max(self.highest, backlog)
                    if backlog >= self.hold_until:
                        full.set()
                    await asyncio.sleep(0.005)  # sampling the backlog: nothing announces its changes
            finally:
                await nc.close()

        try:
            async with app.worker(linger=0.01, drain_timeout=1):
                await asyncio.wait_for(asyncio.gather(sample(), done.wait()), 120)
        finally:
            await app.close()

    def __enter__(self) -> BacklogWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()


def test_backfill_with_max_pending_waits_for_workers_and_counts_only_its_own_rows(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    rows = [(f"acct-{i % 3}", i) for i in range(240)]
    data = payments_csv(tmp_path / "many.csv", rows)
    # With 2 tasks writing at once and --max-pending 40, each sends 10 rows when the backlog is at
    # most 20: the worker holds its first request until the backlog is past that.
    with BacklogWatch(server.url, len(rows), hold_until=21, others=5) as watch:
        result = keyqueue_cli("backfill", data, "--queue", "shop", "--task", "post", "--key", "account",
                              "--columns", "account,amount", "--max-pending", "40", "--url", server.url)
    assert watch.error is None, watch.error
    assert result.exit_code == 0, result.output
    assert "240 rows: 240 enqueued, waited " in result.stdout and "s for workers (--max-pending)" in result.stdout
    # It waited, and its own requests never took the backlog past the bound (the worker's 5, enqueued
    # while the backlog may be at the bound, come on top: others' requests are waited for, not held back).
    assert 21 <= watch.highest <= 40 + 5
    # The progress line counts the backfill's rows, not the 5 the worker enqueued meanwhile.
    assert result.stderr.splitlines()[-1].startswith("rows 240/240 (100%): 240 stored, ")
    assert "stored 245" not in result.stderr
    assert sorted(watch.posted) == sorted(rows + [("other", n) for n in range(5)])
    for account in ("acct-0", "acct-1", "acct-2"):  # each key's rows in input order
        assert [n for a, n in watch.posted if a == account] == [n for a, n in rows if a == account]


def test_backfill_says_what_it_cannot_do_before_starting_spark(tmp_path: Path) -> None:
    data = payments_csv(tmp_path / "payments.csv")
    common = ["backfill", data, "--queue", "shop", "--task", "post", "--key", "account", "--url", "nats://127.0.0.1:1"]
    remote = keyqueue_cli(*common, "--master", "sc://127.0.0.1:15002")
    assert remote.exit_code == 2
    assert "backfill needs a Spark driver of its own" in remote.stderr and "Spark Connect (sc://)" in remote.stderr
    bad_conf = keyqueue_cli(*common, "--conf", "spark.executor.memory")
    assert bad_conf.exit_code == 2
    assert "'spark.executor.memory' is not KEY=VALUE (e.g. spark.executor.memory=2g)" in bad_conf.stderr
    too_low = keyqueue_cli(*common, "--max-pending", "0")
    assert too_low.exit_code == 2 and "--max-pending" in too_low.stderr
    assert "starting Spark" not in remote.output + bad_conf.output + too_low.output


def test_help_shows_examples() -> None:
    backfill = keyqueue_cli("backfill", "--help")
    assert backfill.exit_code == 0
    assert ("  Examples:\n    $ keyqueue backfill payments.csv --app shop:app --task post --key account\n"
            in backfill.output)
    report = keyqueue_cli("report", "--help")
    assert report.exit_code == 0
    assert "  Examples:\n    $ export KEYQUEUE_URL=nats://127.0.0.1:4222\n    $ keyqueue report shop " in report.output


# --- report ----------------------------------------------------------------------------------------


def test_report_lists_only_tasks_breaks_lines_at_gaps_and_skips_dvu_without_dvu_events(
        spark: Any, server: EmbeddedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.axes

    run(publish_history(server.url, "shop", plain_history("shop")))
    drawn: list[pd.Series] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(pd.Series(args[1]))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    monkeypatch.setenv("KEYQUEUE_URL", server.url)  # no --url: KEYQUEUE_URL, as every keyqueue command
    out = tmp_path / "report"
    result = keyqueue_cli("report", "shop", "--out", str(out))
    assert result.exit_code == 0, result.output

    assert result.stdout.startswith("202 events, 4 keys, tasks: post\n")  # no empty task, no DVU part
    assert "DVU" not in result.output
    assert "[7/7] Parquet copy of the aggregates: done" in result.stderr
    assert pd.read_parquet(out / "aggregates" / "tasks.parquet")["task"].tolist() == ["post"]
    assert set(pd.read_parquet(out / "aggregates" / "keys.parquet")["task"]) == {"post"}
    assert not (out / "aggregates" / "dvu.parquet").exists()
    assert "DVU" not in (out / "report.html").read_text()

    # The throughput lines (enqueued, succeeded, dead-lettered) stop at the 180 s without events.
    assert len(drawn) == 3
    for rates in drawn:
        assert rates.isna().sum() == 1
        gap = int(rates.isna().to_numpy().nonzero()[0][0])
        assert not math.isnan(rates.iloc[gap - 1]) and not math.isnan(rates.iloc[gap + 1])


def test_report_run_by_a_user_prints_no_warnings(server: EmbeddedServer, tmp_path: Path) -> None:
    run(publish_history(server.url, "shop", history("shop", requests=100)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYQUEUE_", "PYSPARK_", "SPARK_"))}
    env["KEYQUEUE_URL"] = server.url
    done = subprocess.run([KEYQUEUE, "report", "shop", "--master", "local[2]", "--out", str(tmp_path / "r")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "tasks: Rebase, Reindex; DVU: 30 runs, 3.00 triggers per run" in done.stdout
    noise = [line for line in done.stderr.splitlines()
             if not line.startswith(("starting Spark (local[2]) ...", "["))
             # The JVM's own notice for the module Spark 4 adds; no option turns it off.
             and line != "WARNING: Using incubator modules: jdk.incubator.vector"]
    assert noise == []
    assert "[9/9] Parquet copy of the aggregates: done" in done.stderr  # the last of the steps

