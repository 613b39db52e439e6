"""``keyqueue inspect`` as a user runs it while a worker holds a key, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import keyqueue
from keyqueue.jetstream.subjects import QueueNames

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))


async def run(url: str, *args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    proc = await asyncio.create_subprocess_exec(KEYQUEUE, *args, env={**env, "KEYQUEUE_URL": url},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def holding(nats_url: str) -> AsyncIterator[None]:
    """Worker ``w-test`` holding key o1 of queue shop (its task waits until the test ends); o2 waits behind it."""
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)
    started, release = asyncio.Event(), asyncio.Event()

    @app.task(key="{k}")
    async def hold(k: str) -> None:
        started.set()
        await release.wait()

    try:
        async with app.worker(name="w-test", concurrency=1):
            await hold.enqueue(k="o1")
            await hold.enqueue(k="o1")
            await asyncio.wait_for(started.wait(), 15)
            yield
            release.set()
    finally:
        await app.close()


async def test_inspect_shows_who_holds_a_key_since_when_and_the_workers(holding: None, nats_url: str) -> None:
    code, out, err = await run(nats_url, "inspect", "shop")
    assert code == 0, err
    assert re.search(r"^workers holding keys: w-test \(1 key\); \d+ pull request\(s\) waiting for tokens "
                     r"\(from idle workers\)$", out, re.MULTILINE), out
    assert re.search(r"^KEY\s+BACKLOG\s+TOKEN\s+HOLDER\s+SINCE$", out, re.MULTILINE), out
    assert re.search(r"^o1\s+2\s+held\s+w-test\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+s ago\)$", out, re.MULTILINE), out
    assert re.search(r"^Workers:\nWORKER\s+HOST\s+PID\s+SLOTS USED\s+STARTED\s+HEARTBEAT\s+STATE\n"
                     r"w-test\s+\S+\s+\d+\s+[01]/1\s+\d+s ago\s+\d+s ago\s+live$", out, re.MULTILINE), out


async def test_inspect_json_has_stable_keys_and_numbers(holding: None, nats_url: str) -> None:
    code, out, err = await run(nats_url, "inspect", "shop", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert sorted(report) == ["consumer", "dlq", "keys", "keys_held", "keys_truncated", "keys_with_backlog",
                              "pending_tokens", "queue", "registry", "requests", "unkeyed", "unkeyed_running",
                              "workers"]
    [registered] = report["registry"]
    # "used" is as of the worker's last heartbeat (one is written at its start, then every 5 s).
    assert (registered["name"], registered["live"], registered["slots"]) == ("w-test", True, 1)
    assert registered["used"] in (0, 1) and registered["gone"] is None
    assert (report["queue"], report["requests"], report["keys_held"], report["dlq"]) == ("shop", 2, 1, 0)
    assert report["workers"] == [{"worker": "w-test", "keys_held": 1}]
    assert isinstance(report["consumer"]["waiting_pulls"], int) and report["keys_truncated"] is False
    [o1] = [k for k in report["keys"] if k["key"] == "o1"]
    holder = o1.pop("holder")
    assert o1 == {"key": "o1", "backlog": 2, "token": "held"}
    assert holder["worker"] == "w-test" and isinstance(holder["fence"], int)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", holder["since"])
    assert holder["renewed"] >= holder["since"]

    code, out, err = await run(nats_url, "inspect", "--json")
    assert code == 0, err
    assert json.loads(out) == {"queues": [{"queue": "shop", "requests": 2, "keys_with_backlog": 1, "keys_held": 1,
                                           "pending_tokens": 0, "unkeyed": 0, "unkeyed_running": 0, "dlq": 0}]}


async def test_inspect_counts_unkeyed_requests_waiting_in_the_work_stream(nats_url: str) -> None:
    app = keyqueue.App("tasks", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task()
    async def send_mail(to: str) -> None:
        pass

    try:
        await send_mail.enqueue(to="a@example.com")
        await send_mail.enqueue(to="b@example.com")
    finally:
        await app.close()
    code, out, err = await run(nats_url, "inspect", "tasks", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["requests"], report["unkeyed"], report["unkeyed_running"]) == (0, 2, 0)
    code, out, err = await run(nats_url, "inspect", "tasks")
    assert code == 0, err
    assert "; 2 unkeyed request(s), 0 running" in out, out
    code, out, err = await run(nats_url, "inspect")
    assert code == 0, err
    assert re.search(r"^QUEUE\s+REQUESTS\s+KEYS\s+HELD\s+PENDING TOKENS\s+UNKEYED\s+DLQ\n"
                     r"tasks\s+0\s+0\s+0\s+0\s+2\s+0$", out, re.MULTILINE), out


async def test_a_lease_record_without_its_acquisition_time_shows_the_last_renewal_and_says_so(nats_url: str) -> None:
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{k}")
    async def hold(k: str) -> None:
        pass

    try:
        await hold.enqueue(k="o1")
        nc = await app.connection()
        js = nc.jetstream()
        names = QueueNames("shop")
        # A worker took the key's token and wrote a lease record that does not say since when it holds
        # the key (only the server's timestamp says when it was last written).
        tokens = await js.pull_subscribe_bind(names.consumer, names.token_stream)
        [token] = await tokens.fetch(1, timeout=10)
        record = {"worker": "old-worker", "token": token.metadata.sequence.stream, "nonce": "n", "fence": 0, "ttl": 30}
        await js.publish(names.lease("o1"), json.dumps(record).encode())

        code, out, err = await run(nats_url, "inspect", "shop")
        assert code == 0, err
        assert re.search(r"^o1\s+1\s+held\s+old-worker\s+renewed \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+s ago\)$", out,
                         re.MULTILINE), out
        assert ("(renewed: the lease record does not say when the key was acquired, only when it was last "
                "renewed)") in out.splitlines()
        assert out.splitlines()[-1] == ("Workers: none (no worker of this queue wrote a heartbeat in the last "
                                        "10 minutes)")
        code, out, err = await run(nats_url, "inspect", "shop", "--json")
        [o1] = json.loads(out)["keys"]
        assert o1["holder"]["worker"] == "old-worker" and o1["holder"]["since"] is None
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", o1["holder"]["renewed"])
    finally:
        await app.close()


async def test_inspect_a_key_says_who_holds_it_what_runs_and_why_the_next_waits(holding: None, nats_url: str) -> None:
    code, out, err = await run(nats_url, "inspect", "shop", "o1", "--json")
    assert code == 0, err
    key = json.loads(out)
    assert (key["state"], key["backlog"], key["token"]) == ("running", 2, "held")
    assert key["holder"]["worker"] == "w-test" and key["holder"]["live"] is True
    assert isinstance(key["holder"]["pid"], int) and isinstance(key["holder"]["fence"], int)
    assert key["holder"]["lease_ends"] > key["holder"]["renewed"]
    head = key["head"]
    assert (head["task"], head["arguments"], head["attempts"]) == ("hold", {"k": "o1"}, 1)
    assert head["running_since"] is not None and head["next_retry"] is None
    [blocker] = key["blockers"]
    assert blocker["kind"] == "running" and "held by w-test (pid" in blocker["text"]
    [run_now] = key["runs"]
    assert (run_now["outcome"], run_now["worker"], run_now["fence"]) == ("running", "w-test", key["holder"]["fence"])

    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{k}")
    async def hold(k: str) -> None:
        pass

    try:
        await hold.enqueue(k="o2")  # the worker's one slot is taken by o1
    finally:
        await app.close()
    code, out, err = await run(nats_url, "inspect", "shop", "o2")
    assert code == 0, err
    assert out.splitlines()[0] == "key o2 of queue shop: waiting"
    assert "    - waiting-for-slot: waiting for a free worker slot: position 1 of 1 waiting keys; 1 live worker(s) " \
           "with 1 slot(s) in all" in out.splitlines()
    assert "  position: 1 of 1 waiting key(s)" in out.splitlines()
    assert re.search(r"^    arguments: \{\"k\": \"o2\"\}$", out, re.MULTILINE), out


async def test_inspect_a_key_refuses_a_bad_key_or_queue_in_one_line(holding: None, nats_url: str) -> None:
    code, out, err = await run(nats_url, "inspect", "shop", "o.*")
    assert code == 1 and err.startswith("Error: key 'o.*' contains '*'"), err
    code, out, err = await run(nats_url, "inspect", "nosuch", "o1")
    assert code == 1 and err == ("Error: queue 'nosuch' does not exist on this server; queues: shop (check the name, "
                                 "and --url or KEYQUEUE_URL)\n"), err
    code, out, err = await run(nats_url, "inspect", "shop", "idle-key")
    assert code == 0 and out.splitlines()[0] == "key idle-key of queue shop: idle", out
