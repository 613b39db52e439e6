"""A real FastAPI app (examples/fastapi) under uvicorn, set up as docs/web.md shows: the keyqueue app
connects in the lifespan's start-up (failing the start-up when the server cannot be reached) and
closes at shutdown; async endpoints use the async forms, a plain ``def`` endpoint the sync form."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from command_output import Command
from web_client import get

from keyqueue.server.embedded import EmbeddedServer, free_tcp_port

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi"
WEB_NAME = "fastapi-web"
"""The NATS client name the web processes connect with (``KEYQUEUE_NAME``), to count their connections."""


def web_connections(server: EmbeddedServer) -> int:
    """How many connections of the web processes the server has now (its ``/connz``)."""
    with urllib.request.urlopen(server.monitoring_url + "/connz?limit=1000", timeout=5) as reply:
        return sum(1 for c in json.load(reply).get("connections") or [] if c.get("name") == WEB_NAME)


def settled_web_connections(server: EmbeddedServer, expected: int) -> int:
    """``web_connections`` once it is ``expected``, or after 10 s (the server sees a socket the client
    closed a moment after the client has closed it)."""
    deadline = time.monotonic() + 10
    while (count := web_connections(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def environment(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(EXAMPLE))
    return env


async def test_fastapi_lifespan_connects_at_start_up_and_closes_at_shutdown(tmp_path: Path,
                                                                           nats_server: EmbeddedServer) -> None:
    env = environment(nats_server.url)
    sock = str(tmp_path / "api.sock")
    worker = await Command.start(str(BIN / "keyqueue"), "worker", "shop_api:tasks", env=env, cwd=EXAMPLE)
    web = await Command.start(str(BIN / "uvicorn"), "shop_api:api", "--workers", "2", "--uds", sock,
                              env={**env, "KEYQUEUE_NAME": WEB_NAME}, cwd=EXAMPLE)
    try:
        await worker.wait_for("serving queue fastapi-shop")
        await web.wait_for("Application startup complete", count=2)
        # Connected at start-up: each web process holds its connection before any request came.
        assert web_connections(nats_server) == 2
        paid = await asyncio.to_thread(get, sock, "/orders/o1/pay?amount=7", "POST")
        answer = await asyncio.to_thread(get, sock, f"/requests/{paid['request_id']}?wait=true")
        assert answer == {"status": "done", "result": {"order_id": "o1", "charged": 7}}
        charged = await asyncio.gather(*(asyncio.to_thread(get, sock, f"/orders/o{n}/charge?amount={n}")
                                         for n in range(2, 6)))
        assert charged == [{"order_id": f"o{n}", "charged": n} for n in range(2, 6)]
    finally:
        assert await web.stop() == 0, web.output
        assert await worker.stop() == 0, worker.output
    assert web.matches("Application shutdown complete")
    assert settled_web_connections(nats_server, 0) == 0, "a web process left its connection open at shutdown"


async def test_fastapi_start_up_fails_when_the_server_cannot_be_reached(tmp_path: Path) -> None:
    unreachable = f"nats://127.0.0.1:{free_tcp_port()}"
    web = await Command.start(str(BIN / "uvicorn"), "shop_api:api", "--uds", str(tmp_path / "api.sock"),
                              env=environment(unreachable), cwd=EXAMPLE)
    code = await web.wait(timeout=60)
    assert code != 0, web.output
    assert web.matches("Application startup failed")
    assert web.matches(f"cannot (reach|connect to) NATS at {unreachable}"), web.output
