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
* **Headers are parsed faster** (:class:`KeyqueueClient`): a worker receives every request with
  its headers, and nats-py 2.16 (the newest) checks each header name character by character.
* **Who needs to know, knows when it drops and comes back** (:class:`Link`): a request whose reply
  was still awaited when the connection dropped fails at once (its reply will never come), and a
  key's holder, a producer or a mover waits for the reconnect (within its own bound) instead of
  failing: a short outage costs a short pause, not a lease.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client

from keyqueue.errors import ConnectionFailed, Disconnected, KeyqueueTimeout, ReplyLost
from keyqueue.jetstream.inbound import LeanParser, parse_header_lines, read_headers, readable_subject
from keyqueue.jetstream.subjects import check_publish_line

log = logging.getLogger("keyqueue.connection")

T = TypeVar("T")

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

_SELF_EXPLAINING: Final = (nats.errors.Error, ConnectionFailed, KeyqueueTimeout)
"""Errors logged in one line, without a traceback: nats-py's own, and keyqueue's connection errors."""


class Link:
    """Whether a connection is up, for code that must wait for it to come back or must know it dropped.

    ``connect`` keeps one per connection (:func:`link_of`) and tells it of every drop
    (:meth:`down`) and reconnect (:meth:`up`). A drop calls every :meth:`on_down` listener at once
    (a request mux fails the requests whose replies it still awaited: they will never come).
    """

    __slots__ = ("_closed_event", "_connected", "_drop_waiters", "_listeners", "_up", "cause", "closed",
                 "closed_by_owner", "drops")

    def __init__(self, connected: Callable[[], bool] | None = None) -> None:
        self._connected = connected
        """The client's own word (nats-py's ``is_connected``): it knows of a drop before it tells this
        link, from its reconnect task, which runs only once the loop gets to it."""
        self._up: asyncio.Event | None = None
        self._closed_event: asyncio.Event | None = None
        self._listeners: list[Callable[[], None]] = []
        self._drop_waiters: set[asyncio.Future[None]] = set()
        self.drops = 0
        """How many times the connection dropped (a request sent before a drop has no reply coming)."""
        self.closed = False
        """Closed for good: nats-py never reopens it."""
        self.closed_by_owner = False
        """Closed (or drained) by the code that owns it, not by the server or by giving up reconnecting."""
        self.cause: BaseException | None = None
        """What nats-py last reported when the connection closed (``last_error``): why the server
        refused it (``-ERR``: a protocol error, revoked credentials), or the last reconnect failure."""

    def _event(self) -> asyncio.Event:
        if self._up is None:
            self._up = asyncio.Event()
            self._up.set()
        return self._up

    @property
    def told_up(self) -> bool:
        """Whether the last word this link had was "up" (a drop not reported yet leaves it so)."""
        return not self.closed and self._event().is_set()

    @property
    def is_up(self) -> bool:
        return self.told_up and (self._connected is None or self._connected())

    def on_down(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (no arguments, on the loop) at every drop; returns its removal."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def down(self, *, closed: bool = False, cause: BaseException | None = None) -> None:
        self.drops += 1
        if closed and not self.closed:
            self.closed, self.cause = True, cause
            self._closed().set()
        self._event().clear()
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                log.exception("a connection-drop listener failed")
        for waiter in self._drop_waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.closed:
            self._event().set()  # wake whoever waits: it is not coming back

    def up(self) -> None:
        if not self.closed:
            self._event().set()

    def _closed(self) -> asyncio.Event:
        if self._closed_event is None:
            self._closed_event = asyncio.Event()
            if self.closed:
                self._closed_event.set()
        return self._closed_event

    async def until_closed(self) -> None:
        """Return once the connection is closed for good (:attr:`cause` says why, :attr:`closed_by_owner` by whom)."""
        await self._closed().wait()

    async def until_dropped(self, work: Awaitable[T], what: str) -> T:
        """Await ``work`` (a request whose reply is awaited); raise :class:`~keyqueue.errors.ReplyLost`
        at once if the connection drops first (``work`` is then cancelled: its reply will not come)."""
        task: asyncio.Future[T] = asyncio.ensure_future(work)
        dropped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drop_waiters.add(dropped)
        either: set[asyncio.Future[Any]] = {task, dropped}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            self._drop_waiters.discard(dropped)
        if task.done():
            return task.result()
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise ReplyLost(f"the connection to NATS dropped before the reply to {what} came")

    async def wait_up(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the connection; whether it is up.

        A closed connection never comes back: this waits the ``timeout`` out all the same, so a
        loop that retries after a failed step yields and waits instead of spinning on the loop
        (each step fails at once on a closed connection); whoever must stop sooner looks at
        :attr:`closed`."""
        if self.is_up:
            return True
        if timeout <= 0:
            return False
        if self.closed:
            await asyncio.sleep(timeout)
            return False
        try:
            async with asyncio.timeout(timeout):
                while not self.is_up and not self.closed:
                    if self.told_up:
                        # The client saw the drop and has not told this link yet: its reconnect task
                        # does, once the loop runs it. Yield to it. (Returning at once here made a retry
                        # loop spin without ever yielding: the reconnect could not run, and a producer's
                        # publish held its event loop for the whole outage wait, 15 s.)
                        await asyncio.sleep(_POLL)
                    else:
                        await self._event().wait()
        except TimeoutError:
            return False
        return self.is_up

    wait_connected = wait_up
    """The name :func:`keyqueue.core.outage.ride_out` waits by: a ``Link`` is an outage ``Link``."""


_POLL: Final = 0.05
"""Seconds between looks at a plain nats-py client's state (one not opened by :func:`connect`)."""


def link_of(nc: Client) -> Link | None:
    """The :class:`Link` of a connection opened by :func:`connect`; None for a plain nats-py client."""
    return getattr(nc, "link", None)


async def wait_connected(nc: Client, timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for ``nc`` to be connected; whether it is (never for a closed one,
    which waits the ``timeout`` out: see :meth:`Link.wait_up`)."""
    link = link_of(nc)
    if link is not None:
        return await link.wait_up(timeout)
    deadline = time.monotonic() + timeout
    while not nc.is_connected:
        if time.monotonic() >= deadline:
            return False
        # A closed client never reconnects: the bound is waited out all the same (see Link.wait_up).
        await asyncio.sleep(max(0.0, deadline - time.monotonic()) if nc.is_closed else
                            min(_POLL, max(0.0, deadline - time.monotonic())))
    return True


class KeyqueueClient(Client):
    """nats-py's client, reading message headers with :func:`parse_header_lines` (the same result, faster),
    with a :class:`Link` that says when it drops and comes back, and that refuses a publish whose
    protocol line the server would not take (:func:`~keyqueue.jetstream.subjects.check_publish_line`).

    It overrides nats-py's private ``_parse_header_lines``, which ``_process_headers`` calls for
    every message with headers; a test fails if nats-py stops calling it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ps = LeanParser(self)  # keyqueue's own subscriptions' messages handed on at once
        self.link = Link(lambda: self.is_connected)
        self._reconnect_errors = LogThrottle(ERROR_LOG_INTERVAL)
        self.target: str | ConnectOptions | None = None
        """What :func:`connect` was given: another connection to the same servers, with the same
        credentials, can be opened with it (the loop watchdog does, from its own thread)."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        return parse_header_lines(raw)

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        # nats-py's own raises on a status line that is not UTF-8, in its read loop (the
        # connection drops); this reads it with replacements (keyqueue/jetstream/inbound.py).
        return read_headers(headers) if headers else None

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        # A subject that is not UTF-8 would make nats-py raise in its read loop; read it with
        # escapes instead (the lean parser does so too; this covers the messages nats-py's own
        # parser reads, after a PING or an INFO in the same read).
        if not (subject.isascii() and reply.isascii()):
            subject, reply = readable_subject(subject), readable_subject(reply)
        await super()._process_msg(sid, subject, reply, data, headers)

    async def _attempt_reconnect(self) -> None:
        """nats-py's reconnect, tried again when it ends in an exception nats-py does not expect.

        nats-py's reconnect loop catches ``OSError``, its own errors and timeouts; any other exception
        ends its task without a word (the client keeps a reference to the task, so asyncio never
        reports it), and the client then stays "reconnecting" for good, ignoring every later error:
        a worker that is alive and will never work again. This logs the exception and reconnects
        again after ``reconnect_time_wait``, as nats-py does after an error it knows.
        """
        while True:
            try:
                await super()._attempt_reconnect()
                return
            except Exception as exc:  # (a cancellation is no Exception: it ends the task as it should)
                if self.is_closed:
                    raise
                held_back = self._reconnect_errors.admit(type(exc))
                if held_back is not None:
                    log.error("NATS connection %s: reconnecting failed unexpectedly (%s: %s)%s; trying again",
                              self.options.get("name"), type(exc).__name__, exc, LogThrottle.suffix(held_back),
                              exc_info=exc)
                await asyncio.sleep(max(0.05, float(self.options.get("reconnect_time_wait") or 0.25)))

    async def close(self) -> None:
        self.link.closed_by_owner = True
        await super().close()

    async def drain(self) -> None:
        self.link.closed_by_owner = True
        await super().drain()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        check_publish_line(subject, reply)  # a line too long for the server would close the connection
        await super().publish(subject, payload, reply, headers)


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


class LogThrottle:
    """Lets one occurrence of each kind of event through per ``interval`` seconds and counts the rest.

    ::

        held_back = throttle.admit(type(error))
        if held_back is not None:
            log.warning("...: %s%s", error, LogThrottle.suffix(held_back))
    """

    def __init__(self, interval: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._admitted_at: dict[object, float] = {}
        self._held_back: dict[object, int] = {}

    def admit(self, kind: object) -> int | None:
        """None if ``kind`` (any hashable) was let through less than ``interval`` seconds ago (this one is counted);
        else how many of ``kind`` were held back since the last one let through."""
        now = self.clock()
        admitted_at = self._admitted_at.get(kind)
        if admitted_at is not None and now - admitted_at < self.interval:
            self._held_back[kind] = self._held_back.get(kind, 0) + 1
            return None
        self._admitted_at[kind] = now
        return self._held_back.pop(kind, 0)

    @staticmethod
    def suffix(held_back: int) -> str:
        """What a log line admitted by :meth:`admit` appends: the count of those held back, if any."""
        return f" ({held_back} more of this type since the last one were not logged)" if held_back else ""


class NatsErrorLog:
    """Logs what nats-py reports through ``error_cb`` (:meth:`report`), each type at most once per ``interval``.

    A dropped connection and failed reconnect attempts are expected while a server restarts:
    they go to debug (the connection's own "lost" and "reconnected" lines say what happened).
    Anything else (a slow consumer dropping messages, a permissions error from the server, an
    exception raised in a subscription callback, ...) is a warning. nats-py's own errors and
    keyqueue's connection errors (no responders, the connection down) explain themselves in one
    line; anything else was raised by a callback and shows its traceback.
    Further errors of one type within ``interval`` seconds are only counted, and the count is
    logged with the next one.
    """

    def __init__(self, name: str, *, interval: float = ERROR_LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.throttle = LogThrottle(interval, clock=clock)

    async def report(self, error: Exception) -> None:
        """The ``error_cb`` (nats-py requires a coroutine function, so pass this bound method)."""
        kind = type(error)
        held_back = self.throttle.admit(kind)
        if held_back is None:
            return
        more = LogThrottle.suffix(held_back)
        if isinstance(error, _RECONNECT_NOISE) and not isinstance(error, _REPORTED_TIMEOUTS):
            log.debug("NATS connection %s: %s: %s%s", self.name, kind.__name__, error, more)
            return
        log.warning("NATS connection %s: %s: %s%s", self.name, kind.__name__, error, more,
                    exc_info=None if _explains_itself(error) else error)


def _explains_itself(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is nats-py's or a keyqueue connection error:
    expected while a server restarts, and named well enough that its traceback adds nothing."""
    return isinstance(error, _SELF_EXPLAINING) or isinstance(error.__cause__, _SELF_EXPLAINING)


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
    nc = KeyqueueClient()
    nc.target = target

    async def quiet(e: Exception) -> None:
        return None  # the probe's failure is raised as ConnectionFailed

    async def on_reconnect() -> None:
        nc.link.up()
        log.info("NATS connection %s: reconnected to %s", options["name"],
                 nc.connected_url.netloc if nc.connected_url else where)
        if reconnected is not None:
            await reconnected()

    async def on_disconnect() -> None:
        # nats-py calls this before its first reconnect attempt (and on close, after flushing).
        dropped = discard_unsent(nc)
        again = not nc.link.told_up and not nc.is_closed  # a reconnect tried again (KeyqueueClient): said already
        nc.link.down(closed=nc.is_closed, cause=nc.last_error)
        if not nc.is_closed and not again:
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
        if "tls" in options and isinstance(e, ssl.SSLError | ConnectionResetError | BrokenPipeError):
            # A TLS server that requires a client certificate alerts, or drops, a client that has none.
            raise ConnectionFailed(
                f"cannot connect to NATS at {where} ({type(e).__name__}: {e}): the TLS handshake failed; check "
                "KEYQUEUE_TLS_CA (the CA that signed the server's certificate) and, if the server requires a "
                "client certificate, KEYQUEUE_TLS_CERT and KEYQUEUE_TLS_KEY"
            ) from e
        raise ConnectionFailed(
            f"cannot reach NATS at {where} ({type(e).__name__}: {e}); start one with "
            "`keyqueue dev-server` or set KEYQUEUE_URL"
        ) from e
