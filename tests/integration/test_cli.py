"""The ``keyqueue`` command line: a real worker subprocess serving the quickstart, and its errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from click.testing import CliRunner
from command_output import Command

import keyqueue
from keyqueue.cli import main
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.topology import QueueConfig, Topology

ROOT = Path(__file__).parents[2]
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))


def environment(**values: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update({k: v for k, v in values.items() if v is not None})
    return env


class Process(Command):
    """``keyqueue ARGS`` run from the repository root."""

    @classmethod
    async def start(cls, *args: str, env: dict[str, str], cwd: Path | None = ROOT) -> Process:  # type: ignore[override]
        return await super().start(str(KEYQUEUE), *args, env=env, cwd=cwd)


async def run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(KEYQUEUE, *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def quickstart_worker(nats_url: str) -> AsyncIterator[Process]:
    worker = await Process.start("worker", "examples.quickstart.app:app", "--concurrency", "4",
                                 env=environment(KEYQUEUE_URL=nats_url))
    try:
        await worker.wait_for(r"queue shop: charge, refund")
        yield worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            await worker.stop()


async def test_the_quickstart_end_to_end(quickstart_worker: Process, nats_url: str, tmp_path: Path) -> None:
    env = environment(KEYQUEUE_URL=nats_url)
    from examples.quickstart import app as quickstart

    quickstart.app.settings = quickstart.app.settings.with_url(nats_url)
    try:
        # From Python: a result, a receipt, and a remote exception re-raised with its type and message.
        assert await quickstart.charge.call(order_id="o1", amount=5) == {"order_id": "o1", "charged": 5, "attempt": 1}
        receipt = await quickstart.charge.enqueue(order_id="o1", amount=6)
        assert receipt.key == "o1" and not receipt.duplicate
        with pytest.raises(keyqueue.DeadLettered) as dead:
            await quickstart.charge.call(order_id="o2", amount=-1)
        assert (dead.value.type_name, dead.value.message) == ("ValueError", "amount must be positive, got -1")
    finally:
        await quickstart.app.close()

    # From the command line.
    code, out, _ = await run("enqueue", "examples.quickstart.app:app", "charge", '{"order_id": "o3", "amount": 7}',
                             "--wait", env=env)
    assert (code, json.loads(out)) == (0, {"order_id": "o3", "charged": 7, "attempt": 1})
    code, out, _ = await run("enqueue", "examples.quickstart.app:app", "refund", '{"order_id": "o3", "amount": 7}',
                             "--wait", env=env)
    assert (code, json.loads(out)) == (0, {"order_id": "o3", "refunded": 7})
    lines = tmp_path / "orders.jsonl"
    lines.write_text("".join(json.dumps({"order_id": f"b{i}", "amount": i + 1}) + "\n" for i in range(3)))
    code, out, err = await run("enqueue", "examples.quickstart.app:app", "charge", "--from-file", str(lines), env=env)
    assert (code, out) == (0, "enqueued 3 charge request(s)\n") and "enqueueing charge" in err

    watcher = await Process.start("watch", "shop", "o9", "--count", "1", env=env)
    await watcher.wait_for("watching shop o9")
    code, out, _ = await run("enqueue", "examples.quickstart.app:app", "charge", '{"order_id": "o9", "amount": 9}',
                             env=env)
    assert code == 0 and json.loads(out)["key"] == "o9"
    assert await watcher.wait() == 0  # --count 1: it ends by itself
    assert '{"step": "charging", "amount": 9}' in watcher.output

    code, out, _ = await run("inspect", "shop", env=env)
    assert code == 0 and "DLQ 1" in out
    code, out, _ = await run("dlq", "list", "shop", env=env)
    assert code == 0 and re.search(r"1\s+o2\s+charge\s+max-attempts\s+3\s+ValueError: amount must be positive", out)
    code, out, _ = await run("dlq", "show", "shop", "1", "--json", env=env)
    assert code == 0 and json.loads(out)["arguments"] == {"order_id": "o2", "amount": -1}
    code, out, _ = await run("dlq", "replay", "shop", "--key", "o2", env=env)
    assert (code, out) == (0, "replayed 1 request(s)\n")

    assert await quickstart_worker.stop() == 0, quickstart_worker.output
    assert any("SIGTERM: draining" in line for line in quickstart_worker.lines)


async def test_without_a_url_the_worker_runs_the_embedded_server_and_producers_find_it(tmp_path: Path) -> None:
    env = environment(KEYQUEUE_DATA_DIR=str(tmp_path))
    worker = await Process.start("worker", "examples.quickstart.app:app", env=env)
    try:
        [started] = await worker.wait_for(r"started an embedded nats-server for app 'shop' at (nats://[\d.:]+)")
        await worker.wait_for(r"queue shop: charge, refund")
        code, out, err = await run("enqueue", "examples.quickstart.app:app", "charge",
                                   '{"order_id": "e1", "amount": 2}', "--wait", env=env)
        assert (code, json.loads(out)["charged"]) == (0, 2)
        assert f"using app 'shop''s embedded nats-server at {started[1]}" in err
        code, out, err = await run("inspect", env=env)
        assert code == 0 and "shop" in out and f"embedded nats-server at {started[1]}" in err
    finally:
        assert await worker.stop() == 0
    assert not (tmp_path / "shop" / "server.json").exists()


# --- errors: one line, exit code 1, never a traceback ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["worker", "no_such_module:app"], "cannot import 'no_such_module': no module named 'no_such_module'"),
        (["worker", "a:b:c"], "'a:b:c' is not MODULE:APP"),
        (["worker", "examples.quickstart.app:nothing"], "module 'examples.quickstart.app' has no attribute 'nothing'"),
        (["worker", "examples.quickstart.app:charge"], "examples.quickstart.app:charge is a Task, not a keyqueue.App"),
        (["enqueue", "examples.quickstart.app:app", "chrage", "{}"],
         "app shop has no task 'chrage'; its tasks: charge, refund, reprice"),
        (["enqueue", "examples.quickstart.app:app", "charge", "{order"], "invalid JSON in the arguments"),
        (["enqueue", "examples.quickstart.app:app", "charge", '{"order_id": "o1"}'],
         "charge(): missing a required argument: 'amount'"),
        (["enqueue", "examples.quickstart.app:app", "charge", '["o1", 1]'],
         "the arguments must be a JSON object of keyword arguments for charge, not list"),
        (["enqueue", "examples.quickstart.app:app", "charge", '{"order_id": "o1", "amount": 1}', "--url",
          "nats://127.0.0.1:1"], "cannot reach NATS at nats://127.0.0.1:1"),
        (["inspect", "--url", "nats://127.0.0.1:1"], "cannot reach NATS at nats://127.0.0.1:1"),
        (["dlq", "list", "shop", "--url", "nats://127.0.0.1:1"], "cannot reach NATS at nats://127.0.0.1:1"),
    ],
)
def test_user_mistakes_are_one_clear_line(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, args, env={"KEYQUEUE_URL": "nats://127.0.0.1:1"})
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and message in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_a_bad_line_in_a_file_names_the_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"order_id": "o1", "amount": 1}\n\n{"order_id": \n')
    result = CliRunner().invoke(main, ["enqueue", "examples.quickstart.app:app", "charge", "--from-file", str(lines)])
    assert result.exit_code == 1 and result.output.startswith("Error: invalid JSON in line 3: ")


def test_every_command_has_an_example_in_its_help() -> None:
    runner = CliRunner()
    commands = ["worker", "enqueue", "inspect", "dlq", "dlq list", "dlq show", "dlq replay", "watch", "plugins",
                "dev-server"]
    for command in commands:
        result = runner.invoke(main, [*command.split(), "--help"])
        assert result.exit_code == 0 and "Example" in result.output, command


async def test_a_worker_waits_for_a_server_that_is_not_up_yet(tmp_path: Path) -> None:
    """Services start in any order: the worker logs each attempt and starts once the server is there."""
    from keyqueue.server.embedded import EmbeddedServer, free_tcp_port

    port = free_tcp_port()
    url = f"nats://127.0.0.1:{port}"
    worker = await Process.start("worker", "examples.quickstart.app:app", "--concurrency", "2",
                                 env=environment(KEYQUEUE_URL=url))
    try:
        await worker.wait_for(rf"cannot reach NATS at {re.escape(url)}.*attempt 1, retrying in")
        async with EmbeddedServer(port=port, store_dir=tmp_path / "store"):
            await worker.wait_for(r"queue shop: charge, refund")
            code, out, _ = await run("enqueue", "examples.quickstart.app:app", "charge",
                                     '{"order_id": "late", "amount": 3}', "--wait", env=environment(KEYQUEUE_URL=url))
            assert (code, json.loads(out)) == (0, {"order_id": "late", "charged": 3, "attempt": 1})
            assert await worker.stop() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            await worker.stop()


async def test_connect_timeout_gives_up_with_one_line() -> None:
    code, _, err = await run("worker", "examples.quickstart.app:app", "--connect-timeout", "1",
                             env=environment(KEYQUEUE_URL="nats://127.0.0.1:1"))
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: cannot reach NATS at nats://127.0.0.1:1") and "gave up after" in last
    assert "Traceback" not in err


async def test_a_signal_while_waiting_for_the_server_stops_the_worker_cleanly() -> None:
    worker = await Process.start("worker", "examples.quickstart.app:app",
                                 env=environment(KEYQUEUE_URL="nats://127.0.0.1:1"))
    await worker.wait_for(r"attempt 1, retrying in")
    assert await worker.stop() == 0, "the worker died of the signal instead of handling it"
    await worker.wait_for(r"stopped while waiting for the server")


async def test_a_signal_as_the_queues_start_drains_the_worker(nats_url: str) -> None:
    worker = await Process.start("worker", "examples.quickstart.app:app", env=environment(KEYQUEUE_URL=nats_url))
    await worker.wait_for(r"queue shop: charge, refund")  # logged while the worker is still starting
    assert await worker.stop() == 0, "the worker died of the signal instead of draining"
    await worker.wait_for(r"SIGTERM: draining")


@pytest.mark.parametrize("args", [["unpin", "nosuch"], ["inspect", "nosuch"], ["recreate-consumer", "nosuch", "--yes"]])
def test_a_queue_that_does_not_exist_is_one_line_naming_it(args: list[str], nats_url: str) -> None:
    async def create_shop() -> None:
        nc = await nats.connect(nats_url)
        try:
            await Topology(JetStreamApi(nc), QueueConfig("shop")).ensure()
        finally:
            await nc.close()

    asyncio.run(create_shop())
    result = CliRunner().invoke(main, [*args, "--url", nats_url])
    assert result.exit_code == 1, result.output
    assert result.output == ("Error: queue 'nosuch' does not exist on this server; queues: shop "
                             "(check the name, and --url or KEYQUEUE_URL)\n")


def test_plugin_commands_are_listed_at_the_top_level_only() -> None:
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0 and re.search(r"^  events\s", top.output, re.MULTILINE), top.output
    dlq = runner.invoke(main, ["dlq", "--help"])
    assert dlq.exit_code == 0 and re.search(r"^  list\s", dlq.output, re.MULTILINE), dlq.output
    assert not re.search(r"^  events\s", dlq.output, re.MULTILINE), dlq.output
    assert runner.invoke(main, ["dlq", "events", "--help"]).exit_code == 2  # no such command


# --- a new user's first hour: one-line errors and help that say what to do ---------------------------


NATS_SCHEMES = "NATS URLs use nats://, tls://, ws://, wss:// (e.g. nats://127.0.0.1:4222)"


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["inspect", "--url", "http://127.0.0.1:4222"], {},
         f"Error: url 'http://127.0.0.1:4222' has the scheme 'http'; {NATS_SCHEMES}\n"),
        (["inspect"], {"KEYQUEUE_URL": "https://127.0.0.1:4222"},
         f"Error: url 'https://127.0.0.1:4222' has the scheme 'https'; {NATS_SCHEMES} "
         "(from KEYQUEUE_* environment variables)\n"),
        (["enqueue", "examples.quickstart.app:app", "charge", '{"order_id": "o1", "amount": 1}', "--url",
          "http://127.0.0.1:4222"], {}, f"Error: url 'http://127.0.0.1:4222' has the scheme 'http'; {NATS_SCHEMES}\n"),
    ],
)
def test_a_url_that_is_not_a_nats_url_is_one_line(args: list[str], env: dict[str, str], line: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, args, env={"KEYQUEUE_URL": None, **env})
    assert (result.exit_code, result.output) == (1, line)


def test_lines_of_a_file_are_counted_from_one_in_every_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    lines = tmp_path / "orders.jsonl"
    good = '{"order_id": "o1", "amount": 1}\n'
    runner = CliRunner()
    for bad, message in [
        ('{"order_id": "o2"}', "charge(): missing a required argument: 'amount'"),
        ('{"order_id": "o2", "amount": "ten"}', "charge(): argument 'amount' must be int, not str"),
        ('{"order_id": "o 2", "amount": 1}', "contains ' '"),
        ('["o2", 1]', "must be a JSON object of keyword arguments for charge, not list"),
    ]:
        lines.write_text(f"{good}\n{bad}\n{good}")
        result = runner.invoke(main, ["enqueue", "examples.quickstart.app:app", "charge", "--from-file", str(lines)],
                               env={"KEYQUEUE_URL": "nats://127.0.0.1:1"})
        assert result.exit_code == 1, result.output
        assert re.match(r"Error: line 3\b", result.output) and message in result.output, result.output
        assert result.output.count("\n") == 1


def test_an_argument_of_the_wrong_type_is_refused_at_enqueue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, ["enqueue", "examples.quickstart.app:app", "charge",
                                       '{"order_id": "o1", "amount": "ten"}'], env={"KEYQUEUE_URL": "nats://127.0.0.1:1"})
    assert (result.exit_code, result.output) == (1, "Error: charge(): argument 'amount' must be int, not str\n")


def test_help_examples_name_a_users_module_not_the_repositorys() -> None:
    runner = CliRunner()
    for command in (["worker", "--help"], ["enqueue", "--help"]):
        result = runner.invoke(main, command)
        assert result.exit_code == 0 and "shop:app" in result.output
        assert "examples." not in result.output, command
    result = runner.invoke(main, ["worker", "a:b:c"])
    assert result.exit_code == 1 and "examples." not in result.output and "shop:app" in result.output


def test_the_dlq_delete_and_purge_commands_have_an_example_in_their_help() -> None:
    for command in ("delete", "purge"):
        result = CliRunner().invoke(main, ["dlq", command, "--help"])
        assert result.exit_code == 0 and "Example" in result.output, command


# --- one owner per setting: a queue's lease and caps live on its streams, changed in place -----------


async def token_consumer(nats_url: str, queue: str = "shop") -> dict[str, object]:
    nc = await nats.connect(nats_url)
    try:
        config: dict[str, object] = (await JetStreamApi(nc).consumer_info(f"KQ_{queue}_TOKENS", "workers"))["config"]
        return config
    finally:
        await nc.close()


async def test_the_lease_is_the_queues_set_by_a_worker_or_configure_and_kept_by_recreate(nats_url: str) -> None:
    env = environment(KEYQUEUE_URL=nats_url)
    order = '{"order_id": "o1", "amount": 1}'
    code, _, err = await run("enqueue", "examples.quickstart.app:app", "charge", order, env=env)
    assert code == 0, err  # a producer first: the queue gets the default lease, 30 s
    assert (await token_consumer(nats_url))["ack_wait"] == 30_000_000_000

    worker = await Process.start("worker", "examples.quickstart.app:app", "-q", "shop", "--ack-wait", "5", env=env)
    try:
        await worker.wait_for(r"WARNING .*queue shop: the lease changed on the server, ack_wait 30s → 5s; workers "
                              r"already running keep theirs until they restart")
        await worker.wait_for(r"queue shop: charge, refund")
        assert (await token_consumer(nats_url))["ack_wait"] == 5_000_000_000
        code, out, err = await run("enqueue", "examples.quickstart.app:app", "charge", order, "--wait", env=env)
        assert (code, json.loads(out)["charged"]) == (0, 1), err  # a producer afterwards never checks the lease
    finally:
        assert await worker.stop() == 0, worker.output
    assert not any("never retrieved" in line or "Traceback" in line for line in worker.lines)

    assert await run("configure", "shop", "--ack-wait", "7", env=env) == (0, "queue shop: ack_wait 5s → 7s\n", "")
    assert (await token_consumer(nats_url))["ack_wait"] == 7_000_000_000
    code, out, _ = await run("recreate-consumer", "shop", "--yes", env=env)
    assert (code, out) == (0, "recreated consumer workers of queue shop (priority policy none, ack_wait 7s)\n")
    assert (await token_consumer(nats_url))["ack_wait"] == 7_000_000_000
    code, out, _ = await run("configure", "shop", env=env)
    assert (code, out) == (0, "queue shop: ack_wait 7s, max_ack_pending 10000, max_backlog_per_key unlimited, "
                              "duplicate_window 120s, priority policy none\n")
    code, out, _ = await run("recreate-consumer", "shop", "--yes", "--ack-wait", "9", env=env)
    assert (code, out) == (0, "recreated consumer workers of queue shop (priority policy none, ack_wait 9s)\n")

    follower = await Process.start("worker", "examples.quickstart.app:app", "-q", "shop", env=env)
    try:
        await follower.wait_for(r"INFO .*queue shop: lease \(ack_wait\) 9s, the queue's on the server")
        code, out, err = await run("enqueue", "examples.quickstart.app:app", "charge", order, "--wait", env=env)
        assert (code, json.loads(out)["charged"]) == (0, 1), err
    finally:
        assert await follower.stop() == 0, follower.output
    assert (await token_consumer(nats_url))["ack_wait"] == 9_000_000_000


async def test_configure_changes_the_fleet_cap_and_the_backlog_cap_in_place(nats_url: str) -> None:
    env = environment(KEYQUEUE_URL=nats_url)
    order = '{"order_id": "o1", "amount": 1}'
    assert (await run("enqueue", "examples.quickstart.app:app", "charge", order, env=env))[0] == 0
    code, out, _ = await run("configure", "shop", "--max-ack-pending", "50", "--max-backlog-per-key", "2", env=env)
    assert (code, out) == (0, "queue shop: max_ack_pending 10000 → 50\nqueue shop: max_backlog_per_key unlimited → 2\n")
    assert (await token_consumer(nats_url))["max_ack_pending"] == 50
    assert (await run("enqueue", "examples.quickstart.app:app", "charge", order, env=env))[0] == 0
    code, _, err = await run("enqueue", "examples.quickstart.app:app", "charge", order, env=env)
    assert code == 1 and err.startswith("Error: key 'o1' in queue 'shop' has a full backlog"), err


async def test_a_worker_on_a_stream_keyqueue_did_not_make_is_one_line_and_exit_1(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await JetStreamApi(nc).add_stream({"name": "KQ_shop_INBOX", "subjects": ["kq.shop.in.>"],
                                           "retention": "workqueue"})
    finally:
        await nc.close()
    code, _, err = await run("worker", "examples.quickstart.app:app", env=environment(KEYQUEUE_URL=nats_url))
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "Error: stream KQ_shop_INBOX: retention is 'workqueue' on the server, 'limits' here; that is keyqueue's "
        "layout, not a setting, so keyqueue did not make this stream: with nothing using the queue, delete it "
        "(`nats stream rm KQ_shop_INBOX`, which deletes its messages) and keyqueue creates it again "
        '(docs/decisions.md, "Who owns each setting")')
    assert "never retrieved" not in err and "Traceback" not in err, err


async def test_configure_changes_the_duplicate_window_in_place(nats_url: str) -> None:
    env = environment(KEYQUEUE_URL=nats_url)
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{order_id}")
    async def charge(order_id: str) -> None: ...

    try:
        first = await charge.options(request_id="pay-o1").enqueue(order_id="o1")
        code, out, _ = await run("configure", "shop", "--duplicate-window", "1", env=env)
        assert (code, out) == (0, "queue shop: duplicate_window 120s → 1s\n")
        code, out, _ = await run("configure", "shop", env=env)
        assert "duplicate_window 1s" in out
        # The window passes (there is no event for it); the server forgets an id at its next sweep.
        for _ in range(20):
            await asyncio.sleep(1.0)
            again = await charge.options(request_id="pay-o1").enqueue(order_id="o1")
            if not again.duplicate:
                break
        assert (again.duplicate, again.seq > first.seq) == (False, True)  # a new request after the window
    finally:
        await app.close()


async def test_recreate_consumer_refuses_while_workers_are_live_and_worker_errors_are_one_line(nats_url: str) -> None:
    env = environment(KEYQUEUE_URL=nats_url)
    code, out, err = await run("worker", "examples.quickstart.app:app", "--queue", "nosuch", env=env)
    assert (code, out) == (1, "")
    assert err.strip() == ("Error: app shop has no tasks or processors for queue(s) nosuch; its queues: shop, "
                           "shop-prices")  # no "stopped" line before it: it never started
    worker = await Process.start("worker", "examples.quickstart.app:app", "-q", "shop", env=env)
    try:
        await worker.wait_for(r"queue shop: charge, refund")
        code, _, err = await run("recreate-consumer", "shop", "--yes", env=env)
        assert code == 1
        assert re.fullmatch(r"Error: queue 'shop' has 1 live worker\(s\) \(\S+\): stop them first \(the new "
                            r"consumer delivers every token again, to anyone\), or pass --force\n", err), err
    finally:
        assert await worker.stop() == 0
    code, out, _ = await run("recreate-consumer", "shop", "--yes", env=env)  # a stopped worker says so at once
    assert code == 0, out
