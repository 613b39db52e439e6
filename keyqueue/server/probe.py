"""When embedded servers are ready: checks that ask a booting server what a client will ask.

``EmbeddedServer`` is ready when its own ``/healthz`` says so and JetStream answers a client;
``EmbeddedCluster`` is ready when it takes a stream replicated to every member. Each check
connects afresh, without reconnects, and returns False for what a server that is still booting
causes (a refused connection, a timeout, a NATS error); anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Final

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig

__all__ = ["accepts_replicated_stream", "healthy", "jetstream_answers"]

_FAILURES: Final = (OSError, TimeoutError, nats.errors.Error)
"""What a probe may hit while a server boots."""

_STREAM: Final = "KEYQUEUE_CLUSTER_PROBE"
"""The stream ``accepts_replicated_stream`` creates and deletes again."""


async def healthy(monitoring_url: str) -> bool:
    """Whether the server's ``/healthz`` answers 200.

    It reports on that server alone (in a cluster: contact with the meta leader, its streams and
    consumers caught up), where a JetStream request may be answered by another member.
    """
    url = f"{monitoring_url}/healthz"

    def get() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:  # URLError and HTTPError (503 while not ready) are OSErrors
            return False

    return await asyncio.to_thread(get)


async def jetstream_answers(url: str) -> bool:
    """Whether a fresh connection to ``url`` gets an answer to ``$JS.API.INFO``."""

    async def account_info(nc: Client) -> None:
        await nc.jetstream(timeout=1).account_info()

    return await _succeeds(url, account_info)


async def accepts_replicated_stream(urls: list[str], replicas: int) -> bool:
    """Whether a stream with ``replicas`` replicas can be created (it is deleted again)."""

    async def add_and_delete(nc: Client) -> None:
        js = nc.jetstream(timeout=2)
        config = StreamConfig(name=_STREAM, subjects=["_keyqueue.cluster_probe"], num_replicas=replicas,
                              storage=StorageType.MEMORY)
        await js.add_stream(config)
        await js.delete_stream(_STREAM)

    return await _succeeds(urls, add_and_delete)


async def _succeeds(servers: str | list[str], check: Callable[[Client], Awaitable[None]]) -> bool:
    """Whether ``check`` runs without a booting server's failure on a fresh connection to ``servers``."""

    async def quiet(*_: object) -> None:
        """Swallow nats-py's callbacks: failed probes are expected while the server boots."""

    try:
        nc = await nats.connect(
            servers,
            connect_timeout=1,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            # nats-py sleeps reconnect_time_wait (2 s by default) even after a failed first
            # connect, which would make every restart take 2 s.
            reconnect_time_wait=0,
            error_cb=quiet,
            disconnected_cb=quiet,
            closed_cb=quiet,
        )
    except _FAILURES:
        return False
    try:
        await check(nc)
        return True
    except _FAILURES:
        return False
    finally:
        with contextlib.suppress(*_FAILURES):
            await nc.close()
