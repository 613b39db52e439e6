"""Opening a NATS connection for keyqueue."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats
import nats.errors
from nats.aio.client import Client

from keyqueue.errors import ConnectionFailed


class ConnectOptions(Protocol):
    """Anything that can give ``nats.connect`` keyword arguments (``keyqueue.settings.Settings``)."""

    def nats_connect_options(self) -> dict[str, Any]: ...


async def connect(target: str | ConnectOptions, *, name: str = "keyqueue",
                  reconnected: Callable[[], Awaitable[None]] | None = None,
                  disconnected: Callable[[], Awaitable[None]] | None = None) -> Client:
    """Connect to a URL (or comma-separated URLs) or with a Settings object; raise ConnectionFailed."""
    if isinstance(target, str):
        options: dict[str, Any] = {"servers": target.split(","), "max_reconnect_attempts": -1,
                                   "reconnect_time_wait": 0.25, "connect_timeout": 5}
    else:
        options = dict(target.nats_connect_options())
    options.setdefault("name", name)
    where = ",".join(options.get("servers") or []) or "the configured server"

    async def error_cb(e: Exception) -> None:
        # nats-py reports every failed reconnect attempt here; the disconnect itself is logged
        # by the worker, so stay quiet.
        return None

    async def on_reconnect() -> None:
        if reconnected is not None:
            await reconnected()

    async def on_disconnect() -> None:
        if disconnected is not None:
            await disconnected()

    try:
        # nats-py applies max_reconnect_attempts=-1 to the first connect too, so an unreachable
        # server would hang here forever: probe once without reconnects, then connect for real.
        probe = await nats.connect(**{**options, "allow_reconnect": False, "max_reconnect_attempts": 1,
                                      "reconnect_time_wait": 0}, error_cb=error_cb)
        await probe.close()
        return await nats.connect(error_cb=error_cb, reconnected_cb=on_reconnect,
                                  disconnected_cb=on_disconnect, **options)
    except (OSError, nats.errors.NoServersError, nats.errors.TimeoutError) as e:
        raise ConnectionFailed(
            f"cannot reach NATS at {where} ({type(e).__name__}: {e}); start one with "
            "`keyqueue dev-server` or set KEYQUEUE_URL"
        ) from e
