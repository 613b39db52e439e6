"""A handler that blocks the event loop past the lease cannot run beside the next holder: the loop
watchdog ends its process first.

Two ``keyqueue worker`` processes serve a task whose ``async def`` calls ``time.sleep`` for longer
than the lease. Before, each blocked attempt outlived its lease: the other worker acquired the key
and ran the same request beside it, again and again (11 runs for ``max_attempts=1``) until a crash
loop dead-lettered it. Now the loop watchdog ends the blocked process before its lease can end,
and the attempt it stopped counts toward ``max_attempts``: one run, then the DLQ.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from command_output import Command
from nats.aio.client import Client

from keyqueue.admin.dead_letters import dead_letters
from keyqueue.core.watchdog import EXIT_BLOCKED
from keyqueue.jetstream.api import JetStreamApi

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))

APP = '''
import json
import os
import time
from pathlib import Path

import keyqueue

app = keyqueue.App("blocking", set_as_default=False)
RUNS = Path(__file__).with_name("runs.jsonl")


@app.task(key="{key}", max_attempts=1)
async def stubborn(key: str) -> None:
    with open(RUNS, "a") as runs:
        runs.write(json.dumps({"pid": os.getpid(), "event": "start", "t": time.time()}) + "\\n")
    time.sleep(12)  # blocking code in an async def: the lease is 4 s
    with open(RUNS, "a") as runs:
        runs.write(json.dumps({"pid": os.getpid(), "event": "end", "t": time.time()}) + "\\n")
'''


async def test_a_handler_blocking_the_loop_is_stopped_before_its_lease_ends_and_counted(
        tmp_path: Path, nats_url: str, nc: Client) -> None:
    (tmp_path / "blocking_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, PYTHONUNBUFFERED="1", KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1")
    workers = [await Command.start(KEYQUEUE, "worker", "blocking_app:app", "--ack-wait", "4", "--name", f"w{i}",
                                   env=env, cwd=tmp_path) for i in range(2)]
    try:
        for worker in workers:
            await worker.wait_for(r"serving queue")
        enqueue = await Command.start(KEYQUEUE, "enqueue", "blocking_app:app", "stubborn", '{"key": "k"}',
                                      env=env, cwd=tmp_path)
        assert await enqueue.wait() == 0, enqueue.output
        api = JetStreamApi(nc)
        deadline = asyncio.get_running_loop().time() + 60
        while not (dead := await dead_letters(api, "blocking")):
            assert asyncio.get_running_loop().time() < deadline, "\n".join(w.output for w in workers)
            await asyncio.sleep(0.2)
        stopped = [w for w in workers if w.proc.returncode is not None]
        assert [w.proc.returncode for w in stopped] == [EXIT_BLOCKED], [w.output for w in workers]
        assert stopped[0].matches(r"event loop blocked for .* stopping this worker process now")
    finally:
        for worker in workers:
            if worker.proc.returncode is None:
                await worker.stop()
    [letter] = dead
    assert letter.reason == "max-attempts" and "blocked the event loop" in letter.error_message, letter
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["event"] for r in runs] == ["start"], runs  # one run, stopped; never run beside or again
