"""A TCP proxy between one worker and nats-server that injects network faults on command.

A worker connects to ``FaultProxy.url`` instead of the server; the proxy forwards every
connection (nats-py reconnects, so there may be several over time) to the upstream server. The
test or soak process changes the proxy's behaviour at any moment:

=====================  ===========================================================================
``blackhole()``        hold every byte, both directions, in memory; nothing is forwarded
``heal()``             deliver everything held, in order, then forward normally again
``reset()``            abort every current connection (RST on both sides); new ones are accepted
``set_latency(s)``     delay every chunk by ``s`` seconds, both directions, order kept (0: off)
``set_bandwidth(bps)`` forward at most ``bps`` bytes per second per direction of each connection
``refuse(True)``       close new connections at once (``refuse(False)`` accepts them again)
=====================  ===========================================================================

The blackhole is the fault that matters most: it models a partition after which late bytes
arrive, so a worker's ack written during the partition reaches the server seconds later, after
its lease may have passed to another worker. Held bytes are dropped only if their connection is
reset or the proxy closed.

``ProxyGroup`` applies each fault to several proxies at once: a worker connected to every node of
a cluster through a proxy per node is cut off, slowed or reset as one.

``FaultScript`` draws a deterministic sequence of such faults from a seeded ``random.Random``
and injects them into a list of proxies (or groups), recording each one for the soak's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, Self
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_FAULTS",
    "FaultKind",
    "FaultProxy",
    "FaultScript",
    "FaultSpec",
    "Faultable",
    "InjectedFault",
    "PlannedFault",
    "ProxyGroup",
    "ProxyStats",
]

HOST: Final = "127.0.0.1"
"""The proxy listens on loopback only."""

READ_SIZE: Final = 64 * 1024
"""Largest chunk read from a socket at once."""

THROTTLE_SLICE: Final = 0.05
"""Under a bandwidth limit, chunks are forwarded in slices of this many seconds' worth of bytes."""

_RST: Final = struct.pack("ii", 1, 0)
"""SO_LINGER on, timeout 0: closing the socket sends RST instead of FIN."""


@dataclass
class ProxyStats:
    """What one proxy has done since it started."""

    bytes_up: int = 0
    """Bytes forwarded from clients to the server."""
    bytes_down: int = 0
    """Bytes forwarded from the server to clients."""
    accepted: int = 0
    """Client connections accepted and forwarded."""
    refused: int = 0
    """Client connections closed at once (``refuse`` or an unreachable upstream)."""
    faults: Counter[str] = field(default_factory=Counter)
    """Faults injected, by kind: blackhole, reset, latency, bandwidth, refuse."""


class FaultProxy:
    """An asyncio TCP proxy to ``upstream_host:upstream_port`` with fault injection.

    Use as ``async with FaultProxy(host, port) as proxy: ...`` or ``await start()`` /
    ``await close()``. Fault methods are synchronous and take effect at once.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stats = ProxyStats()
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.refusing = False
        self._port = port
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._settings_changed = asyncio.Event()
        self._progress = asyncio.Event()

    @classmethod
    def for_url(cls, url: str, *, port: int = 0) -> FaultProxy:
        """A proxy to the server at ``nats://host:port``."""
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        return cls(parts.hostname or HOST, parts.port or 4222, port=port)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the port given, or a free one)."""
        self._server = await asyncio.start_server(self._accept, HOST, self._port)
        self._port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, abort every connection (held bytes are dropped) and wait for them."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The port the proxy listens on (known once started)."""
        return self._port

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``: give this to the worker instead of the server's URL."""
        return f"nats://{HOST}:{self._port}"

    @property
    def connections(self) -> int:
        """Client connections open right now."""
        return len(self._connections)

    @property
    def held_bytes(self) -> int:
        """Bytes read from one side and not yet written to the other (held or delayed)."""
        return self.held_up + self.held_down

    @property
    def held_up(self) -> int:
        """Bytes from clients not yet written to the server."""
        return sum(conn.pipes[0].held for conn in self._connections)

    @property
    def held_down(self) -> int:
        """Bytes from the server not yet written to clients."""
        return sum(conn.pipes[1].held for conn in self._connections)

    @property
    def blackholed(self) -> bool:
        return not self._flowing.is_set()

    # --- faults ----------------------------------------------------------------------------------

    def blackhole(self) -> None:
        """Hold every byte in both directions until ``heal()``; connections stay open."""
        self.stats.faults["blackhole"] += 1
        self._flowing.clear()
        self._changed()

    def heal(self) -> None:
        """Deliver everything held, in order, then forward normally."""
        self._flowing.set()
        self._changed()

    def reset(self) -> None:
        """Abort every current connection, both sides, with RST; held bytes are dropped."""
        self.stats.faults["reset"] += 1
        for conn in list(self._connections):
            conn.abort()

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk by ``seconds`` in both directions, keeping order; 0 turns it off."""
        if seconds < 0:
            raise ValueError(f"latency must be >= 0, got {seconds}")
        if seconds > 0:
            self.stats.faults["latency"] += 1
        self.latency = seconds
        self._changed()

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        """Forward at most this many bytes per second per direction of each connection; None: no limit."""
        if bytes_per_second is not None:
            if bytes_per_second <= 0:
                raise ValueError(f"bandwidth must be > 0 bytes per second, got {bytes_per_second}")
            self.stats.faults["bandwidth"] += 1
        self.bandwidth = bytes_per_second
        self._changed()

    def refuse(self, refusing: bool = True) -> None:
        """Close new connections at once while ``refusing``; current connections are untouched."""
        if refusing:
            self.stats.faults["refuse"] += 1
        self.refusing = refusing

    async def wait_until(self, predicate: Callable[[FaultProxy], bool], timeout: float = 10.0) -> None:
        """Return once ``predicate(self)`` holds, re-checked whenever bytes or connections move.

        Raises ``TimeoutError`` after ``timeout`` seconds. ``wait_until(lambda p: p.held_bytes > 0)``
        waits for a client's write to reach a blackholed proxy.
        """
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._progress.wait()

    # --- internals -------------------------------------------------------------------------------

    def _changed(self) -> None:
        # Pipes sleeping out a latency or a throttle re-check when the settings change.
        self._settings_changed.set()
        self._settings_changed = asyncio.Event()
        self._moved()

    def _moved(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            if self.refusing:
                self.stats.refused += 1
                _abort(writer)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                self.stats.refused += 1
                _abort(writer)
                return
            self.stats.accepted += 1
            conn = _Connection(self, (reader, writer), (up_reader, up_writer))
            self._connections.add(conn)
            self._moved()
            try:
                await conn.run()
            finally:
                self._connections.discard(conn)
                self._moved()
        finally:
            self._handlers.discard(task)


class Faultable(Protocol):
    """What a fault script acts on: a :class:`FaultProxy` or a :class:`ProxyGroup`."""

    def blackhole(self) -> None: ...

    def heal(self) -> None: ...

    def reset(self) -> None: ...

    def set_latency(self, seconds: float) -> None: ...

    def set_bandwidth(self, bytes_per_second: float | None) -> None: ...

    def refuse(self, refusing: bool = True) -> None: ...


class ProxyGroup:
    """Several proxies faulted as one: every method applies to each member, in order."""

    def __init__(self, proxies: Sequence[FaultProxy]) -> None:
        if not proxies:
            raise ValueError("a proxy group needs at least one proxy")
        self.proxies = tuple(proxies)

    @property
    def urls(self) -> list[str]:
        """The members' URLs: a client given all of them reaches the upstream servers only through the group."""
        return [proxy.url for proxy in self.proxies]

    def blackhole(self) -> None:
        for proxy in self.proxies:
            proxy.blackhole()

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def reset(self) -> None:
        for proxy in self.proxies:
            proxy.reset()

    def set_latency(self, seconds: float) -> None:
        for proxy in self.proxies:
            proxy.set_latency(seconds)

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        for proxy in self.proxies:
            proxy.set_bandwidth(bytes_per_second)

    def refuse(self, refusing: bool = True) -> None:
        for proxy in self.proxies:
            proxy.refuse(refusing)


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: chunks are queued as read and written when allowed."""

    def __init__(self, proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 upstream: bool) -> None:
        self.proxy, self.reader, self.writer, self.upstream = proxy, reader, writer, upstream
        self.chunks: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.held = 0
        self.next_free = 0.0  # when the bandwidth limit lets the next byte go

    async def read(self) -> None:
        """Queue every chunk with its arrival time, then None at end of stream."""
        loop = asyncio.get_running_loop()
        while chunk := await self.reader.read(READ_SIZE):
            self.held += len(chunk)
            self.chunks.put_nowait((loop.time(), chunk))
            self.proxy._moved()
        self.chunks.put_nowait(None)

    async def write(self) -> None:
        """Forward queued chunks in order, each when the blackhole, latency and throttle allow."""
        while (item := await self.chunks.get()) is not None:
            arrived, chunk = item
            for piece in self._slices(chunk):
                await self._wait_turn(arrived, len(piece))
                self.writer.write(piece)
                self.held -= len(piece)
                if self.upstream:
                    self.proxy.stats.bytes_up += len(piece)
                else:
                    self.proxy.stats.bytes_down += len(piece)
                self.proxy._moved()
                await self.writer.drain()

    def _slices(self, chunk: bytes) -> Iterator[bytes]:
        bandwidth = self.proxy.bandwidth
        size = len(chunk) if bandwidth is None else max(1, int(bandwidth * THROTTLE_SLICE))
        for i in range(0, len(chunk), size):
            yield chunk[i:i + size]

    async def _wait_turn(self, arrived: float, size: int) -> None:
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        while True:
            await proxy._flowing.wait()
            due = arrived + proxy.latency
            if proxy.bandwidth is not None:
                due = max(due, self.next_free)
            now = loop.time()
            if due <= now:
                break
            changed = proxy._settings_changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), due - now)
        if proxy.bandwidth is not None:
            self.next_free = max(now, self.next_free) + size / proxy.bandwidth


class _Connection:
    """A client connection and its upstream connection, joined by two pipes."""

    def __init__(self, proxy: FaultProxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 server: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.writers = (client[1], server[1])
        self.pipes = (_Pipe(proxy, client[0], server[1], upstream=True),
                      _Pipe(proxy, server[0], client[1], upstream=False))
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        """Forward until one side's end of stream has been delivered, or either side fails."""
        self.tasks = [asyncio.create_task(step()) for pipe in self.pipes for step in (pipe.read, pipe.write)]
        writes = {self.tasks[1], self.tasks[3]}
        pending: set[asyncio.Task[None]] = set(self.tasks)
        failed = False
        try:
            while pending and not failed:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = any(t.cancelled() or t.exception() is not None for t in done)
                # A read ending cleanly only queues the end of stream; it is delivered (after
                # everything held before it) when the write side reaches it.
                if done & writes:
                    break
            if failed:
                self.abort()
            else:
                for writer in self.writers:
                    writer.close()
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def abort(self) -> None:
        """Reset both sides now, dropping whatever is held (a blackholed pipe stops waiting)."""
        for writer in self.writers:
            _abort(writer)
        for task in self.tasks:
            task.cancel()


# --- fault scripts -----------------------------------------------------------------------------

FaultKind = Literal["blackhole", "reset", "latency", "bandwidth", "outage"]
"""What a script can do to a proxy; ``outage`` is a reset plus refusing new connections."""


@dataclass(frozen=True)
class FaultSpec:
    """One class of fault a ``FaultScript`` may inject.

    ``weight`` is its relative chance of being picked; ``duration`` the range (seconds, drawn
    uniformly) it lasts before being reverted (ignored by ``reset``); ``level`` the range of the
    latency in seconds (``latency``) or of the bytes per second (``bandwidth``).
    """

    kind: FaultKind
    weight: float = 1.0
    duration: tuple[float, float] = (0.0, 0.0)
    level: tuple[float, float] = (0.0, 0.0)


DEFAULT_FAULTS: Final = (
    FaultSpec("blackhole", 3.0, duration=(2.0, 5.0)),
    FaultSpec("reset", 2.0),
    FaultSpec("latency", 2.0, duration=(2.0, 6.0), level=(0.2, 1.0)),
    FaultSpec("bandwidth", 1.0, duration=(2.0, 6.0), level=(2_000.0, 20_000.0)),
)
"""A partition-heavy mix: blackholes 2-5 s, resets, latency bursts 0.2-1 s, slow links."""


@dataclass(frozen=True)
class PlannedFault:
    """One step of a script: wait ``delay`` seconds, then inject ``kind`` into proxy ``proxy``."""

    kind: FaultKind
    proxy: int
    delay: float
    duration: float
    level: float


@dataclass(frozen=True)
class InjectedFault:
    """A fault as injected: ``start`` is wall-clock time (``time.time()``), ``duration`` as planned."""

    kind: FaultKind
    proxy: int
    start: float
    duration: float
    level: float


class FaultScript:
    """A seeded sequence of faults against a list of proxies.

    ``plan`` yields the sequence; for a given seed, fault specs and number of proxies it is
    always the same. ``run`` injects it: each fault after its delay, at most one fault at a time
    per proxy (a fault planned for a busy proxy waits for the previous one to be reverted), and
    every fault reverted when the script ends. ``gap`` is the range of delays between faults.
    """

    def __init__(self, rng: random.Random, faults: Sequence[FaultSpec] = DEFAULT_FAULTS, *,
                 gap: tuple[float, float] = (0.5, 2.0)) -> None:
        if not faults or sum(f.weight for f in faults) <= 0:
            raise ValueError("a fault script needs at least one fault with a positive weight")
        self.rng = rng
        self.faults = tuple(faults)
        self.gap = gap
        self.injected: list[InjectedFault] = []
        self._ending = asyncio.Event()

    def plan(self, proxies: int) -> Iterator[PlannedFault]:
        """The script's faults, endlessly, for ``proxies`` proxies (indexes 0..proxies-1)."""
        if proxies < 1:
            raise ValueError("a fault script needs at least one proxy")
        weights = [f.weight for f in self.faults]
        while True:
            spec = self.rng.choices(self.faults, weights)[0]
            yield PlannedFault(
                kind=spec.kind,
                proxy=self.rng.randrange(proxies),
                delay=self.rng.uniform(*self.gap),
                duration=0.0 if spec.kind == "reset" else self.rng.uniform(*spec.duration),
                level=self.rng.uniform(*spec.level),
            )

    async def run(self, proxies: Sequence[Faultable], *, duration: float | None = None,
                  on_inject: Callable[[InjectedFault], None] | None = None,
                  on_revert: Callable[[InjectedFault], None] | None = None) -> list[InjectedFault]:
        """Inject the plan until ``duration`` seconds pass or ``stop()``; return what was injected.

        ``on_inject`` is called as each fault starts and ``on_revert`` once it has been reverted
        (a reset: right after it), to write both into a run log. Every fault in progress is
        reverted before this returns, also when it is cancelled.
        """
        self._ending = asyncio.Event()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(duration, self._ending.set) if duration is not None else None
        try:
            async with asyncio.TaskGroup() as tg:
                active: dict[int, asyncio.Task[None]] = {}
                for fault in self.plan(len(proxies)):
                    if await self._ended_within(fault.delay):
                        break
                    if (previous := active.get(fault.proxy)) is not None:
                        await previous
                        if self._ending.is_set():
                            break
                    active[fault.proxy] = tg.create_task(
                        self._inject(proxies[fault.proxy], fault, on_inject, on_revert))
        finally:
            if timer is not None:
                timer.cancel()
            self._ending.set()
        return list(self.injected)

    def stop(self) -> None:
        """End a running script: no new faults; faults in progress are reverted."""
        self._ending.set()

    def counts(self) -> Counter[str]:
        """Injected faults by kind."""
        return Counter(f.kind for f in self.injected)

    def summary(self) -> str:
        """One line: how many faults of each kind were injected."""
        counts = self.counts()
        shown = ", ".join(f"{kind} {counts[kind]}" for kind in sorted(counts)) or "none"
        return f"faults injected: {sum(counts.values())} ({shown})"

    async def _ended_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ending.wait(), seconds)
        return self._ending.is_set()

    async def _inject(self, proxy: Faultable, fault: PlannedFault,
                      on_inject: Callable[[InjectedFault], None] | None,
                      on_revert: Callable[[InjectedFault], None] | None) -> None:
        record = InjectedFault(fault.kind, fault.proxy, time.time(), fault.duration, fault.level)
        self.injected.append(record)
        if on_inject is not None:
            on_inject(record)
        try:
            if fault.kind == "reset":
                proxy.reset()
                return
            revert = _apply(proxy, fault)
            try:
                await self._ended_within(fault.duration)
            finally:
                revert()
        finally:
            if on_revert is not None:
                on_revert(record)


def _apply(proxy: Faultable, fault: PlannedFault) -> Callable[[], None]:
    """Inject a lasting fault; return the call that reverts it."""
    if fault.kind == "blackhole":
        proxy.blackhole()
        return proxy.heal
    if fault.kind == "latency":
        proxy.set_latency(fault.level)
        return lambda: proxy.set_latency(0.0)
    if fault.kind == "bandwidth":
        proxy.set_bandwidth(fault.level)
        return lambda: proxy.set_bandwidth(None)
    proxy.reset()
    proxy.refuse(True)
    return lambda: proxy.refuse(False)
