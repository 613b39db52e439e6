"""The streaming sink: each row stored once across a driver killed mid-batch, rows refused for a while,
and a restart past the window."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import nats
import pytest

from keyqueue import QueueConfig
from keyqueue.ext import JetStreamApi, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_spark.stream_sink import last_committed
from keyqueue_spark.streams import connect_to
from tests.spark.fixtures import history, publish_history
from tests.spark.helpers import message_count, run, stream_messages
from tests.spark.stream_job import SOURCE_QUEUE, TARGET_QUEUE, start

REPO = Path(__file__).resolve().parents[2]


def keyed_events(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The events the query writes (those with a key), by their stream sequence."""
    return {seq: e for seq, e in enumerate(events, start=1) if e.get("key") is not None}


def stored_audits(url: str) -> list[tuple[str, dict[str, Any]]]:
    return [(subject, body) for _, subject, _, body in run(stream_messages(url, f"KQ_{TARGET_QUEUE}_INBOX"))]


def assert_each_event_once_in_order(url: str, expected: dict[int, dict[str, Any]]) -> None:
    stored = stored_audits(url)
    assert sorted(body["seq"] for _, body in stored) == sorted(expected)  # nothing lost, nothing twice
    by_key: dict[str, list[int]] = defaultdict(list)
    for subject, body in stored:
        assert subject == f"kq.{TARGET_QUEUE}.in.{expected[body['seq']]['key']}"
        assert body["event"] == expected[body["seq"]]["event"]
        by_key[subject].append(body["seq"])
    # One partition per micro-batch here, and micro-batches in order: each key's rows in stream order.
    assert all(seqs == sorted(seqs) for seqs in by_key.values())


async def kill_when_stored(command: list[str], log: Path, url: str, count: int, timeout: float) -> None:
    """Start the driver; kill it (its JVM and Python workers too) once ``count`` requests reached the target inbox."""
    nc = await nats.connect(url)
    seen = 0
    enough = asyncio.Event()

    async def stored(_: Any) -> None:
        nonlocal seen
        seen += 1
        if seen >= count:
            enough.set()

    try:
        await nc.subscribe(f"kq.{TARGET_QUEUE}.in.>", cb=stored)
        await nc.flush()
        with log.open("wb") as stderr:
            driver = await asyncio.create_subprocess_exec(
                *command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                stderr=stderr, start_new_session=True)
            try:
                await asyncio.wait_for(enough.wait(), timeout)
            finally:
                os.killpg(driver.pid, signal.SIGKILL)
                await driver.wait()
    finally:
        await nc.close()


@pytest.mark.timeout(600)  # a driver of its own: a JVM start
def test_a_query_killed_mid_batch_restarts_from_its_checkpoint_with_each_row_stored_once(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    events = history(SOURCE_QUEUE, requests=120)
    run(publish_history(server.url, SOURCE_QUEUE, events))
    expected = keyed_events(events)
    checkpoint = str(tmp_path / "checkpoint")

    # A driver of its own, held at 40 pending requests (nobody serves the target queue): it stores
    # part of its first micro-batch and waits; it is killed there, before the micro-batch commits.
    command = [sys.executable, "-m", "tests.spark.stream_job", server.url, checkpoint, "--max-pending", "40"]
    run(kill_when_stored(command, tmp_path / "driver.log", server.url, 20, timeout=240))
    partial = run(message_count(server.url, f"KQ_{TARGET_QUEUE}_INBOX"))
    assert 20 <= partial <= 40 < len(expected)  # stored part of the micro-batch, held at max-pending

    # Restarted from the checkpoint (here, in the tests' own driver): the micro-batch runs again
    # with the same request ids; the server drops those already stored.
    query = start(spark, server.url, checkpoint)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert_each_event_once_in_order(server.url, expected)


def test_a_committed_micro_batch_run_again_past_the_duplicate_window_writes_nothing(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    events = history(SOURCE_QUEUE, requests=60)
    run(publish_history(server.url, SOURCE_QUEUE, events))
    expected = keyed_events(events)
    checkpoint, summary = tmp_path / "checkpoint", tmp_path / "summary.json"

    query = start(spark, server.url, str(checkpoint), duplicate_window=1, summary=str(summary))
    try:
        query.processAllAvailable()
        query_id = str(query.id)
    finally:
        query.stop()
    assert_each_event_once_in_order(server.url, expected)
    committed = run(committed_batch(server.url, query_id))
    assert committed is not None and json.loads(summary.read_text())["batch_id"] == committed

    # Spark runs the last micro-batch again when its checkpoint lacks the commit (a driver that died
    # between the sink's commit and Spark's). Past the 1 s duplicate window the server would store
    # every row again; the sink's own record of the commit keeps it from writing them.
    for name in (str(committed), f".{committed}.crc"):
        (checkpoint / "commits" / name).unlink()
    time.sleep(1.5)  # the duplicate window passing is the point; nothing announces it
    query = start(spark, server.url, str(checkpoint), duplicate_window=1, summary=str(summary))
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    again = json.loads(summary.read_text())
    assert again["batch_id"] == committed
    assert again["skipped"] == again["rows"] > 0 and again["accepted"] == 0
    assert_each_event_once_in_order(server.url, expected)


async def committed_batch(url: str, query_id: str) -> int | None:
    nc = await connect_to(url)
    try:
        return await last_committed(nc, query_id)
    finally:
        await nc.close()


BACKLOG_CAP = 4
"""The target queue's per-key backlog cap in the refusal test: the hot key's rows pass it at once."""


async def target_queue(url: str, *, max_backlog_per_key: int, create: bool) -> None:
    """Create the target queue with a per-key backlog cap, or change the cap of the one there is."""
    nc = await connect_to(url)
    try:
        topology = Topology(JetStreamApi(nc), QueueConfig(TARGET_QUEUE, max_backlog_per_key=max_backlog_per_key))
        if create:
            await topology.ensure()
        else:
            await topology.configure(max_backlog_per_key=max_backlog_per_key)
    finally:
        await nc.close()


def test_rows_refused_by_a_full_backlog_fail_the_micro_batch_and_are_stored_once_after_a_restart(
        spark: Any, server: EmbeddedServer, tmp_path: Path) -> None:
    events = history(SOURCE_QUEUE, requests=40)
    run(publish_history(server.url, SOURCE_QUEUE, events))
    expected = keyed_events(events)
    checkpoint = str(tmp_path / "checkpoint")
    # Nobody serves the target queue: past BACKLOG_CAP rows of a key the server refuses the rest (BacklogFull).
    run(target_queue(server.url, max_backlog_per_key=BACKLOG_CAP, create=True))
    assert sum(e["key"] == "key-3" for e in expected.values()) > BACKLOG_CAP  # the hot key

    query = start(spark, server.url, checkpoint)
    try:
        with pytest.raises(Exception, match="BacklogFull"):
            query.processAllAvailable()
    finally:
        query.stop()
    stored = run(message_count(server.url, f"KQ_{TARGET_QUEUE}_INBOX"))
    assert 0 < stored < len(expected)  # the refused rows are not stored

    # Room again (as when workers drain the key); the query restarts from its checkpoint and runs the
    # failed micro-batch again: the refused rows are stored, those stored before are not stored twice.
    run(target_queue(server.url, max_backlog_per_key=0, create=False))
    query = start(spark, server.url, checkpoint)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert_each_event_once_in_order(server.url, expected)
