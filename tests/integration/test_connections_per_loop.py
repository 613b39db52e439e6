"""An app used from many short event loops keeps no connection per loop once the loop is gone.

``asyncio.run(task.enqueue(...))`` in a script, or a framework that runs each request on a new
loop, gives the app a new loop every time. Before, each loop's connection stayed open for the
life of the process (the map's value kept its weak key, the loop, alive): 160 calls, 162
connections on the server. The server's own count (its ``/connz`` monitoring endpoint) is the
judge here.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
import urllib.request

import pytest

import keyqueue
from keyqueue.server.embedded import EmbeddedServer

CALLS = 40


def server_connections(server: EmbeddedServer) -> int:
    with urllib.request.urlopen(server.monitoring_url + "/connz", timeout=5) as reply:
        return int(json.load(reply)["num_connections"])


def settled_connections(server: EmbeddedServer, at_most: int) -> int:
    """The server's connection count once it is ``at_most`` or lower, or after 10 s (a socket
    closed by the client is seen by the server a moment later; a dropped one closes when the
    garbage collector gets to it)."""
    deadline = time.monotonic() + 10
    while (count := server_connections(server)) > at_most and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return count


def make_app(url: str) -> tuple[keyqueue.App, keyqueue.Task]:  # type: ignore[type-arg]
    app = keyqueue.App("loops", url=url, set_as_default=False, autoload_plugins=False)

    @app.task(key="{account}")
    async def note(account: str) -> None:
        return None

    return app, note


def test_each_asyncio_run_closes_its_connection_when_its_loop_ends(nats_server: EmbeddedServer) -> None:
    app, note = make_app(nats_server.url)
    for _ in range(CALLS):
        asyncio.run(note.enqueue(account="a"))
    assert settled_connections(nats_server, 0) == 0, f"{CALLS} asyncio.run calls left connections open"
    asyncio.run(note.enqueue(account="a"))  # the app still works on a new loop
    assert len(app._connections._by_loop) == 0


def test_a_loop_closed_without_its_shutdown_does_not_keep_its_socket(nats_server: EmbeddedServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # nats-py's tasks, left pending on a loop closed under them, complain as they are collected (the
    # loop's owner skipped the shutdown; collecting them is the point). pytest would keep those
    # complaints, and their tracebacks would keep the connections: drop them.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    app, note = make_app(nats_server.url)
    for _ in range(CALLS):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(note.enqueue(account="a"))
        loop.close()  # no shutdown_asyncgens: nothing ran when the loop ended
    loop = asyncio.new_event_loop()
    try:
        # The next use, on any loop, drops the closed loops' connections; collecting them closes their sockets.
        loop.run_until_complete(note.enqueue(account="a"))
        assert len(app._connections._by_loop) == 1
        assert settled_connections(nats_server, 1) == 1, f"{CALLS} closed loops kept their sockets"
        loop.run_until_complete(app.close())
    finally:
        loop.close()
