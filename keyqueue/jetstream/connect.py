"""Opening a NATS connection for keyqueue, and what its connections promise.

* **Nothing is sent late.** nats-py keeps what is published while it reconnects
  (``pending_size``, 2 MB by default) and sends it once reconnected; so are the bytes still in
  its buffer when the connection drops. For keyqueue a late ack, nak, delete or token from a
  former holder of a key is dangerous, so its connections use ``pending_size=0``: nats-py then
  refuses a publish while disconnected (``OutboundBufferLimitError``, raised by keyqueue as
  :class:`~keyqueue.errors.Disconnected`), and the disconnect handler discards whatever was
  still buffered. While connected, ``pending_size`` only sets when a publish waits for the
  socket to drain: with 0 it never waits, and keyqueue's publishers bound what they keep in
  flight themselves (``enqueue_many``'s window, one keepalive per lease).
* **A dead connection is noticed in seconds**: PINGs every 5 s, stale after 3 unanswered.
* **What nats-py reports is logged** (:class:`NatsErrorLog`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import nats.errors
from nats.aio.client import Client

from keyqueue.errors import ConnectionFailed, Disconnected

log = logging.getLogger("keyqueue.connection")

PING_INTERVAL: Final = 5.0
"""Seconds between client PINGs (nats-py's default is 120 s). A half-open connection (a peer or a
middlebox gone without a FIN) is noticed after about ``PING_INTERVAL * MAX_OUTSTANDING_PINGS``,
not after minutes in which every request of a worker times out."""

MAX_OUTSTANDING_PINGS: Final = 3
"""Unanswered PINGs after which nats-py declares the connection stale and reconnects."""

ERROR_LOG_INTERVAL: Final = 60.0
"""Seconds during which further errors of one type from nats-py are counted instead of logged."""

CONNECTION_DOWN: Final = (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionClosedError,
                          nats.errors.ConnectionDrainingError)
"""What nats-py raises for a publish or subscription it did not send: disconnected, closed, draining."""

_RECONNECT_NOISE: Final = (OSError, TimeoutError, nats.errors.StaleConnectionError, nats.errors.NoServersError)
"""Errors of a dropped connection and of failed reconnect attempts: expected while a server restarts."""

_REPORTED_TIMEOUTS: Final = (nats.errors.FlushTimeoutError, nats.errors.DrainTimeoutError)


def disconnected(what: str) -> Disconnected:
    """The error for ``what`` not sent because the connection is down."""
    return Disconnected(f"the connection to NATS is down (reconnecting): {what} was not sent, and will not "
                        "be sent after the reconnect; retry once connected")


def not_sent(error: BaseException, what: str) -> ConnectionFailed:
    """The keyqueue error for a ``CONNECTION_DOWN`` error from nats-py while sending ``what``."""
    if isinstance(error, nats.errors.OutboundBufferLimitError):
        return disconnected(what)
    if isinstance(error, nats.errors.ConnectionDrainingError):
        return ConnectionFailed(f"the connection to NATS is draining: {what} was not sent")
    return ConnectionFailed(f"the connection to NATS is closed: {what} was not sent")


class NatsErrorLog:
    """Logs what nats-py reports through ``error_cb`` (:meth:`report`), each type at most once per ``interval``.

    A dropped connection and failed reconnect attempts are expected while a server restarts and
    go to debug. Anything else (an exception raised in a subscription callback, a slow consumer
    dropping messages, a permissions error from the server, ...) is a warning; further errors of
    the same type within ``interval`` seconds are only counted, and the count is logged with the
    next one.
    """

    def __init__(self, name: str, *, interval: float = ERROR_LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval = interval
        self.clock = clock
        self._logged_at: dict[type[BaseException], float] = {}
        self._suppressed: dict[type[BaseException], int] = {}

    async def report(self, error: Exception) -> None:
        """The ``error_cb`` (nats-py requires a coroutine function, so pass this bound method)."""
        if isinstance(error, _RECONNECT_NOISE) and not isinstance(error, _REPORTED_TIMEOUTS):
            log.debug("NATS connection %s: %s: %s", self.name, type(error).__name__, error)
            return
        kind = type(error)
        now = self.clock()
        logged_at = self._logged_at.get(kind)
        if logged_at is not None and now - logged_at < self.interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._logged_at[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        more = f" ({suppressed} more of this type since the last one were not logged)" if suppressed else ""
        # nats-py's own errors explain themselves; anything else was raised by a callback: show where.
        log.warning("NATS connection %s: %s: %s%s", self.name, kind.__name__, error, more,
                    exc_info=None if isinstance(error, nats.errors.Error) else error)


def discard_unsent(nc: Client) -> int:
    """Drop what nats-py still holds to send, so none of it goes out after a reconnect; returns bytes dropped."""
    # nats-py writes this buffer once it has reconnected, and has no API to empty it.
    dropped = nc._pending_data_size
    nc._pending = []
    nc._pending_data_size = 0
    return dropped


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
    options["pending_size"] = 0  # nothing buffered while disconnected (see the module docstring)
    options.setdefault("ping_interval", PING_INTERVAL)
    options.setdefault("max_outstanding_pings", MAX_OUTSTANDING_PINGS)
    where = ",".join(options.get("servers") or []) or "the configured server"
    nc = Client()

    async def quiet(e: Exception) -> None:
        return None  # the probe's failure is raised as ConnectionFailed

    async def on_reconnect() -> None:
        log.info("NATS connection %s: reconnected to %s", options["name"],
                 nc.connected_url.netloc if nc.connected_url else where)
        if reconnected is not None:
            await reconnected()

    async def on_disconnect() -> None:
        # nats-py calls this before its first reconnect attempt (and on close, after flushing).
        dropped = discard_unsent(nc)
        if not nc.is_closed:
            log.warning("NATS connection %s: lost, reconnecting; publishes fail with Disconnected until it is "
                        "back%s", options["name"],
                        f"; {dropped} bytes not yet sent were dropped" if dropped else "")
        if disconnected is not None:
            await disconnected()

    try:
        # nats-py applies max_reconnect_attempts=-1 to the first connect too, so an unreachable
        # server would hang here forever: probe once without reconnects, then connect for real.
        probe = Client()
        await probe.connect(**{**options, "allow_reconnect": False, "max_reconnect_attempts": 1,
                               "reconnect_time_wait": 0}, error_cb=quiet)
        await probe.close()
        await nc.connect(error_cb=NatsErrorLog(options["name"]).report, reconnected_cb=on_reconnect,
                         disconnected_cb=on_disconnect, **options)
        return nc
    except (OSError, nats.errors.NoServersError, nats.errors.TimeoutError) as e:
        raise ConnectionFailed(
            f"cannot reach NATS at {where} ({type(e).__name__}: {e}); start one with "
            "`keyqueue dev-server` or set KEYQUEUE_URL"
        ) from e
