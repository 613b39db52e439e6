"""What a worker logs, as its user reads it: one line per event worth a look, tracebacks only for the unexpected.

Most tests run ``keyqueue worker`` in a subprocess against a real nats-server and read its
stderr; the rest run ``app.worker()`` in this process with caplog.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from command_output import Command
from ulid import ULID

import keyqueue
from keyqueue.core.processor import KeyProcessor
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import headers as H

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import keyqueue

app = keyqueue.App("logs", set_as_default=False)
attempts: dict[str, int] = {}


@app.task(queue="shop", key="{order}", max_attempts=5, backoff=0.01)
async def charge(order: str) -> str:
    attempts[order] = attempts.get(order, 0) + 1
    if attempts[order] <= 2:
        raise RuntimeError(f"card declined ({attempts[order]})")
    return "charged"


@app.task(queue="mail", key="{to}")
async def send(to: str) -> None:
    raise keyqueue.Reject(f"no such address: {to}")
'''


class Worker(Command):
    """``keyqueue worker logs_app:app`` run from the app's folder."""

    @classmethod
    async def start(cls, cwd: Path, url: str, *options: str,  # type: ignore[override]
                    env: dict[str, str] | None = None) -> Worker:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
        environment.update(KEYQUEUE_URL=url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONUNBUFFERED="1", **(env or {}))
        return await super().start(str(KEYQUEUE), "worker", "logs_app:app", *options, env=environment, cwd=cwd)


def load_app(path: Path, url: str) -> ModuleType:
    """The app module the worker serves, imported here too (under a name of its own) to call its tasks."""
    spec = importlib.util.spec_from_file_location(f"logs_app_{ULID()}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.app.settings = module.app.settings.with_url(url)
    return module


async def serve_a_bad_day(tmp_path: Path, url: str, *options: str, env: dict[str, str] | None = None) -> list[str]:
    """Run a worker through a task that fails twice then succeeds, a ``Reject``, and a message
    that is not keyqueue's, then SIGTERM; its stderr lines."""
    (tmp_path / "logs_app.py").write_text(APP)
    worker = await Worker.start(tmp_path, url, *options, env=env)
    try:
        await worker.wait_for("queue shop: charge")
        await worker.wait_for("queue mail: send")
        shop = load_app(tmp_path / "logs_app.py", url)
        async with shop.app:
            assert await shop.charge.options(timeout=30).call(order="o1") == "charged"
            with pytest.raises(keyqueue.DeadLettered):
                await shop.send.options(timeout=30).call(to="x")
            # Garbage ahead of a request on key g: the session reads it first.
            js = (await shop.app.connection()).jetstream()
            await js.publish(QueueNames("mail").inbox("g"), b"not a keyqueue message")
            with pytest.raises(keyqueue.DeadLettered):
                await shop.send.options(timeout=30).call(to="g")
        # The caller is answered before the line is written.
        await worker.wait_for("no such address: g")
    finally:
        code = await worker.stop()
    assert code == 0, worker.output
    return worker.lines


@pytest.fixture(autouse=True)
def no_entry_point_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD", "1")


async def test_a_bad_day_in_text_is_one_line_per_event_without_tracebacks(tmp_path: Path, nats_url: str) -> None:
    lines = await serve_a_bad_day(tmp_path, nats_url)
    shown = "\n".join(lines)
    assert "Traceback" not in shown, shown

    retried = [line for line in lines if "charge failed" in line]
    assert len(retried) == 2, shown
    for n, line in enumerate(retried, 1):
        assert " WARNING " in line
        assert re.search(rf"charge failed on attempt {n} of 5, retrying in \d+ms: RuntimeError: card declined \({n}\) "
                         r"\(queue shop, key o1, request [0-9A-Z]{26}\)$", line), line

    [rejected] = [line for line in lines if "no such address: x" in line]
    assert " WARNING " in rejected
    assert re.search(r"send rejected, moved to the dead-letter queue: Reject: no such address: x "
                     r"\(queue mail, key x, request [0-9A-Z]{26}\)$", rejected), rejected

    [garbage] = [line for line in lines if "MissingHeader" in line]
    assert " WARNING " in garbage
    assert re.search(r"request rejected, moved to the dead-letter queue: MissingHeader: .* \(queue mail, key g, "
                     r"seq \d+\)$", garbage), garbage

    assert not [line for line in lines if re.search(r"\b(acquired|released)\b", line)], shown

    [stopped] = [line for line in lines if re.search(r"worker \S+ stopped", line)]
    assert " INFO " in stopped
    assert stopped.endswith("stopped: mail: 0 succeeded, 3 dead-lettered; shop: 1 succeeded, 2 retried"), stopped


@pytest.mark.parametrize("how", ["--log-format", "KEYQUEUE_LOG_FORMAT"])
async def test_json_logs_are_one_object_per_line_with_the_events_fields(tmp_path: Path, nats_url: str,
                                                                        how: str) -> None:
    if how == "--log-format":
        lines = await serve_a_bad_day(tmp_path, nats_url, "--log-format", "json")
    else:
        lines = await serve_a_bad_day(tmp_path, nats_url, env={"KEYQUEUE_LOG_FORMAT": "json"})
    entries: list[dict[str, Any]] = [json.loads(line) for line in lines]  # every line is one object
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry

    retried = [e for e in entries if e.get("event") == "retried"]
    assert [(e["level"], e["queue"], e["key"], e["attempt"], e["message_type"], e["error"]) for e in retried] == [
        ("WARNING", "shop", "o1", 1, "charge", "RuntimeError: card declined (1)"),
        ("WARNING", "shop", "o1", 2, "charge", "RuntimeError: card declined (2)"),
    ]
    assert all(re.fullmatch("[0-9A-Z]{26}", e["request_id"]) for e in retried)
    assert all("traceback" not in e for e in entries)

    dead = [e for e in entries if e.get("event") == "dead_lettered"]
    assert [(e["level"], e["key"], e["reason"]) for e in dead] == [("WARNING", key, "rejected") for key in "xgg"]
    [garbage] = [e for e in dead if e["error"].startswith("MissingHeader")]
    assert garbage["request_id"] == "" and garbage["message"].endswith(f"(queue mail, key g, seq {garbage['seq']})")

    [stopped] = [e for e in entries if "stopped:" in e["message"]]
    assert stopped["counts"]["shop"]["succeeded"] == 1


# --- in this process, with caplog ----------------------------------------------------------------


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("logs", url=nats_url, set_as_default=False, autoload_plugins=False)
    try:
        yield app
    finally:
        await app.close()


def worker_records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("keyqueue") and text in r.getMessage()]


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_the_last_attempt_of_a_dead_letter_shows_its_traceback_a_retry_only_at_debug(
        app: keyqueue.App, caplog: pytest.LogCaptureFixture, level: int) -> None:
    @app.task(key="{order}", max_attempts=2, backoff=0.01)
    async def refund(order: str) -> None:
        raise ValueError(f"no payment for {order}")

    with caplog.at_level(level, logger="keyqueue"):
        async with app.worker():
            with pytest.raises(keyqueue.DeadLettered):
                await refund.options(timeout=30).call(order="o7")
        # Leaving the block drained the worker: every line of the session is written.
    [retried] = worker_records(caplog, "refund failed on attempt 1 of 2, retrying in")
    assert retried.levelno == logging.WARNING
    assert (retried.exc_info is not None) is (level == logging.DEBUG)

    [dead] = worker_records(caplog, "refund failed on attempt 2 of 2, moved to the dead-letter queue")
    assert dead.levelno == logging.ERROR
    assert dead.exc_info is not None and isinstance(dead.exc_info[1], ValueError)
    assert dead.getMessage().endswith("ValueError: no payment for o7 (queue logs, key o7, request "
                                      f"{dead.__dict__['kq_request_id']})")

    story = [(logging.getLevelName(r.levelno), r.__dict__["kq_event"]) for r in worker_records(caplog, "key o7")]
    if level == logging.INFO:
        assert story == [("WARNING", "retried"), ("ERROR", "dead_lettered")]
    else:
        assert story == [("DEBUG", "acquired"), ("DEBUG", "started"), ("WARNING", "retried"), ("DEBUG", "started"),
                         ("ERROR", "dead_lettered"), ("DEBUG", "released")]


async def test_an_outage_cutting_off_sessions_is_one_line_and_a_bug_shows_its_traceback(
        app: keyqueue.App, caplog: pytest.LogCaptureFixture) -> None:
    built: set[str] = set()
    all_built = asyncio.Event()
    keys = {"a", "b", "c", "bug"}

    async def processor(key: str) -> KeyProcessor:
        built.add(key)
        if built == keys:
            all_built.set()
        if key == "bug":
            raise RuntimeError("processor bug")
        raise keyqueue.ConnectionFailed("no responders for $JS.API.STREAM.MSG.GET.KQ_feeds_INBOX")

    app.register_processor("feeds", processor)
    with caplog.at_level(logging.INFO, logger="keyqueue"):
        async with app.worker() as worker:
            publisher = Publisher(await app.connection(), QueueNames("feeds"))
            for key in sorted(keys):
                rid = str(ULID())
                await publisher.enqueue(OutgoingRequest(key, {H.MSG_ID: rid}, b"{}", rid))
            await asyncio.wait_for(all_built.wait(), 30)
        counts = worker.queue_workers["feeds"].counts

    assert counts["session_failed"] >= 4
    failed = worker_records(caplog, "session failed")
    [outage] = [r for r in failed if "ConnectionFailed" in r.getMessage()]
    assert outage.levelno == logging.WARNING and outage.exc_info is None
    assert outage.getMessage().startswith("queue feeds key ")
    [bug] = [r for r in failed if "RuntimeError" in r.getMessage()]
    assert bug.levelno == logging.ERROR and bug.exc_info is not None
    assert bug.getMessage().startswith("queue feeds key bug: session failed: RuntimeError: processor bug")
