"""keyqueue in a real Django project (examples/django), both forms: Django's Tasks framework on
keyqueue's backend, and keyqueue's own API with its settings in Django's and ``delay_on_commit``.

The project runs as users deploy it: ``gunicorn --preload --workers 2`` serving sync views and async
views, ``keyqueue worker`` (which sets Django up and imports the shop app's tasks module, whose tasks
use the models), a real nats-server, and sqlite shared by all of them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from command_output import Command
from web_client import get

BIN = Path(sys.executable).parent
PROJECT = Path(__file__).resolve().parents[2] / "examples" / "django"


async def _blocking(sock: str, url: str, method: str = "GET") -> Any:
    return await asyncio.to_thread(get, sock, url, method)


async def test_a_django_project_under_gunicorn_preload_with_sync_and_async_views(tmp_path: Path,
                                                                                  nats_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYQUEUE_", "DJANGO_"))}
    # No KEYQUEUE_URL: the project's settings.py names the server (KEYQUEUE_URL from SHOP_NATS_URL),
    # read when the app first connects. Were it not read, the app would start an embedded server here.
    env.update(SHOP_NATS_URL=nats_url, SHOP_DATABASE=str(tmp_path / "shop.sqlite3"),
               DJANGO_SETTINGS_MODULE="mysite.settings", KEYQUEUE_DATA_DIR=str(tmp_path / "kq-data"),
               KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(PROJECT))
    migrate = await Command.start(sys.executable, "manage.py", "migrate", env=env, cwd=PROJECT)
    assert await migrate.wait() == 0, migrate.output
    sock = str(tmp_path / "web.sock")
    worker = await Command.start(str(BIN / "keyqueue"), "worker", "mysite.kq:app", "--concurrency", "8",
                                 env=env, cwd=PROJECT)
    server = await Command.start(str(BIN / "gunicorn"), "--preload", "--workers", "2", "--bind", f"unix:{sock}",
                                 "mysite.wsgi", env=env, cwd=PROJECT)
    try:
        await worker.wait_for("Django set up")
        await worker.wait_for("serving queue shop-audit")
        await server.wait_for(r"Booting worker with pid", count=2)
        first = (await _blocking(sock, "/orders", "POST"))["id"]
        second = (await _blocking(sock, "/orders", "POST"))["id"]

        # Django's Tasks: charges of one order, from sync and async views in turn, each accepted before
        # the next is sent. The task reads, waits, then writes the total: only runs that never overlap,
        # in the order accepted, leave every charge seeing the total of those before it.
        amounts = list(range(1, 9))
        charges = []
        for n, amount in enumerate(amounts):
            prefix = "/async" if n % 2 else ""
            enqueued = await _blocking(sock, f"{prefix}/orders/{first}/charge?amount={amount}")
            assert enqueued["status"] == "READY"
            charges.append(enqueued["id"])
        last = await _blocking(sock, f"/requests/{charges[-1]}?wait=1")
        assert last["status"] == "done"
        totals = [sum(amounts[:n]) for n in range(len(amounts))]
        assert await _blocking(sock, f"/orders/{first}") == {"charged": sum(amounts), "charges": totals, "packed": ""}
        for n, (result_id, amount) in enumerate(zip(charges, amounts, strict=True)):
            prefix = "/async" if n % 2 else ""
            result = await _blocking(sock, f"{prefix}/results/{result_id}")  # get_result / aget_result
            assert result["status"] == "SUCCESSFUL", result
            assert result["return_value"] == {"order": first, "before": totals[n], "after": totals[n] + amount}
            assert (result["args"], result["kwargs"], result["attempts"]) == ([], {"order_id": first,
                                                                                  "amount": amount}, 1)

        # A failing task: FAILED, with the exception's class; run_after and takes_context on an async task.
        refund = await _blocking(sock, f"/orders/{second}/refund?amount=3")
        assert (await _blocking(sock, f"/requests/{refund['id']}?wait=1"))["status"] == "failed"
        failed = await _blocking(sock, f"/results/{refund['id']}")
        assert (failed["status"], failed["errors"]) == ("FAILED", ["builtins.ValueError"])
        audit = await _blocking(sock, f"/async/orders/{second}/audit?note=checked&delay=1")
        assert (await _blocking(sock, f"/requests/{audit['id']}?wait=1"))["status"] == "done"
        audited = await _blocking(sock, f"/async/results/{audit['id']}")
        assert audited["return_value"] == {"order": second, "note": "checked", "attempt": 1, "id": audit["id"]}
        assert dt.datetime.fromisoformat(audited["started_at"]) >= dt.datetime.fromisoformat(audit["run_after"])
        refused = await _blocking(sock, "/refused")
        assert refused["error"] in ("InvalidTask", "InvalidTaskError") and "no priority" in refused["message"]

        # keyqueue's own API: delay_on_commit enqueues when the view's transaction commits, never
        # before (the view sees "unknown" inside it) and never after a rollback: the committed one,
        # for the same key, is done, so a rolled-back one that had been stored would have run first.
        rolled_back = await _blocking(sock, f"/orders/{second}/pack?note=lost&rollback=1")
        committed = await _blocking(sock, f"/orders/{second}/pack?note=kept")
        assert rolled_back["before_commit"] == committed["before_commit"] == "unknown"
        packed = await _blocking(sock, f"/requests/{committed['request_id']}?wait=1")
        assert packed == {"status": "done", "result": "packed: kept"}
        assert (await _blocking(sock, f"/requests/{rolled_back['request_id']}"))["status"] == "unknown"
        assert (await _blocking(sock, f"/orders/{second}"))["packed"] == "packed: kept"
    finally:
        assert await server.stop() == 0, server.output
        assert await worker.stop() == 0, worker.output
    assert not (tmp_path / "kq-data").exists(), "an embedded server was started: Django's KEYQUEUE_URL was not read"


OWN_SETTINGS = '''
import django

INSTALLED_APPS = ["reports"] + (["django_tasks"] if django.VERSION < (6, 0) else [])
USE_TZ = True
TASKS = {"default": {"BACKEND": "keyqueue.django.backend.KeyqueueBackend", "OPTIONS": {"NAME": "reports"}}}
'''

OWN_TASKS = '''
try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def double(n: int) -> int:
    return 2 * n
'''

PRODUCER = '''
import json

import django

django.setup()

from keyqueue.django import app
from reports.tasks import double

results = [double.enqueue(n=n) for n in range(3)]
for result in results:
    app.result_sync(result.id, timeout=30)
print(json.dumps([[r.status, r.return_value, double.get_result(r.id).return_value] for r in
                  (double.get_result(result.id) for result in results)]))
'''


async def test_the_backends_own_app_served_by_keyqueue_worker_keyqueue_django(tmp_path: Path, nats_url: str) -> None:
    """No keyqueue app of the project's own: ``keyqueue worker keyqueue.django`` serves the default
    backend's, and tasks without ``key=`` run each request as its own key."""
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "__init__.py").write_text("")
    (tmp_path / "reports" / "tasks.py").write_text(OWN_TASKS)
    (tmp_path / "own_settings.py").write_text(OWN_SETTINGS)
    (tmp_path / "produce.py").write_text(PRODUCER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYQUEUE_", "DJANGO_"))}
    env.update(KEYQUEUE_URL=nats_url, DJANGO_SETTINGS_MODULE="own_settings", KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=str(tmp_path))
    worker = await Command.start(str(BIN / "keyqueue"), "worker", "keyqueue.django", env=env, cwd=tmp_path)
    try:
        await worker.wait_for("serving queue reports")
        producer = await Command.start(sys.executable, "produce.py", env=env, cwd=tmp_path)
        assert await producer.wait(60) == 0, producer.output
        assert json.loads(producer.lines[-1]) == [["SUCCESSFUL", 2 * n, 2 * n] for n in range(3)]
    finally:
        assert await worker.stop() == 0, worker.output
