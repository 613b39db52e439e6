"""The sync face under a real pre-forking server, as docs/web.md deploys it: gunicorn
``--preload`` imports the app in its master, which enqueues before it forks its workers; each worker
then enqueues, calls and asks for statuses from its own requests."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from command_output import Command
from web_client import get

BIN = Path(sys.executable).parent

WEB = '''
import json

import keyqueue

app = keyqueue.App("web", result_ttl=600)


@app.task(key="{order}")
def charge(order: str, amount: int) -> dict:
    return {"order": order, "charged": amount}


# At import, in gunicorn's master (--preload): the portal's thread and connection exist before the fork.
charge.options(request_id="warm-up").delay(order="warm-up", amount=0)


def application(environ, start_response):
    order = environ["PATH_INFO"].strip("/")
    receipt = charge.delay(order=order, amount=1)
    result = charge.call_sync(order=order, amount=2, timeout=20)
    body = json.dumps({"result": result, "first": receipt.result_sync(timeout=20),
                       "status": app.status_sync(receipt.request_id)}).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]
'''


async def test_gunicorn_preload_workers_enqueue_call_and_read_results(tmp_path: Path, nats_url: str) -> None:
    (tmp_path / "web_app.py").write_text(WEB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(tmp_path))
    sock = str(tmp_path / "web.sock")
    worker = await Command.start(str(BIN / "keyqueue"), "worker", "web_app:app", env=env, cwd=tmp_path)
    server = await Command.start(str(BIN / "gunicorn"), "--preload", "--workers", "2", "--bind", f"unix:{sock}",
                                 "--log-level", "info", "web_app:application", env=env, cwd=tmp_path)
    try:
        await worker.wait_for("serving queue web")
        await server.wait_for(r"Booting worker with pid", count=2)
        answers = await asyncio.gather(*(asyncio.to_thread(get, sock, f"/o{n}") for n in range(6)))
        for n, answer in enumerate(answers):
            assert answer == {"result": {"order": f"o{n}", "charged": 2}, "first": {"order": f"o{n}", "charged": 1},
                              "status": "done"}
        pids = {int(m[1]) for m in server.matches(r"Booting worker with pid: (\d+)")}
        assert len(pids) == 2
    finally:
        assert await server.stop() == 0
        await worker.stop()
