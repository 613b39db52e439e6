"""The sync face under a real pre-forking server (docs/web.md): gunicorn ``--preload`` imports the
app in its master, which enqueues before it forks its workers; each worker then enqueues, calls and
asks for statuses from its own requests. Without ``KEYQUEUE_URL`` a gunicorn process gets no
embedded server (it would die with the web worker that started it): the error says what to do."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from command_output import Command
from web_client import get, request

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


NO_URL = '''
import keyqueue

app = keyqueue.App("web")


@app.task(key="{order}")
def charge(order: str) -> None: ...


def application(environ, start_response):
    try:
        charge.delay(order="o1")
        status, body = "200 OK", b"stored"
    except keyqueue.ConfigError as exc:
        status, body = "500 Internal Server Error", str(exc).encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
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


async def test_without_keyqueue_url_a_gunicorn_worker_starts_no_embedded_server_and_says_what_to_do(
        tmp_path: Path) -> None:
    (tmp_path / "no_url.py").write_text(NO_URL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", KEYQUEUE_DATA_DIR=str(tmp_path / "data"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(tmp_path)])))
    sock = str(tmp_path / "web.sock")
    server = await Command.start(str(BIN / "gunicorn"), "--workers", "1", "--bind", f"unix:{sock}",
                                 "no_url:application", env=env, cwd=tmp_path)
    try:
        await server.wait_for(r"Booting worker with pid")
        status, body = await asyncio.to_thread(request, sock, "/")
        assert status == 500, body
        message = str(body)
        assert message.startswith("no KEYQUEUE_URL configured, and this process is part of gunicorn: ")
        assert "keyqueue dev-server --store-dir" in message and "KEYQUEUE_URL=nats://127.0.0.1:4222" in message
        assert not (tmp_path / "data" / "web" / "server.json").exists(), "no server was started"
    finally:
        assert await server.stop() == 0
