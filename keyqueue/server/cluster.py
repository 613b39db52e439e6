"""A JetStream cluster of embedded nats-servers on loopback (for tests and local experiments).

Routes between the servers may go through proxies (``route_proxy``): server *i* then reaches
server *j* only through proxy ``(i, j)``, so a test can cut one server off from its peers by
faulting every proxy that touches it. nats-server opens *implicit* routes to the address a peer
gossips; each server therefore gossips an address that refuses connections, which keeps every
route on a proxy, also after a cut-off heals.

Route ports (and proxy ports) must be known before any server starts, so they are picked with
``free_tcp_port()``: bound, read and released, outside the kernel's ephemeral range (so that no
outgoing connection is given one while its server is down for a restart). Another process can
take one before its server or proxy binds it; the first ``start()`` then sees "address already in
use" and lays the cluster out again on fresh ports, up to ``_START_ATTEMPTS`` (5) times.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, Self

from keyqueue.errors import ConfigError, KeyqueueTimeout
from keyqueue.server.embedded import HOST, ClusterSpec, EmbeddedServer, free_tcp_port, port_taken
from keyqueue.server.probe import accepts_replicated_stream

__all__ = ["EmbeddedCluster", "RouteProxy", "RouteProxyFactory"]

_START_ATTEMPTS: Final = 5
"""How many layouts (route and proxy ports) the first ``EmbeddedCluster.start()`` tries while
another process takes a port it picked before its server or proxy binds it."""


class RouteProxy(Protocol):
    """A TCP proxy on a route between two servers (``keyqueue.chaos.proxy.FaultProxy`` is one)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


RouteProxyFactory = Callable[[int, int, int, int], RouteProxy]
"""``(from server, to server, the target's route port, the port to listen on)`` -> a proxy that
listens on 127.0.0.1 at that port and forwards to the target's route port."""


class EmbeddedCluster:
    """``size`` embedded servers on loopback forming one JetStream cluster.

    ``start()`` returns once a stream with ``size`` replicas can be created, i.e. the meta
    leader is elected and every peer has joined. Route ports are picked when the cluster is
    created and kept, like the client ports, across restarts. Should another process take one
    of them (or a proxy's port) before the first ``start()`` binds it, that start picks every
    port afresh, with new ``servers`` and ``route_proxies``, and tries again (5 attempts in all):
    read those two once ``start()`` has returned.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        name: str = "keyqueue",
        store_root: str | Path | None = None,
        max_payload: int | None = None,
        sync_interval: str | None = None,
        route_proxy: RouteProxyFactory | None = None,
        advertise_clients: bool = True,
    ) -> None:
        """``sync_interval``: each server's ``jetstream.sync_interval`` (``EmbeddedServer``).
        ``route_proxy``: put a proxy on every route (see the module docstring).
        ``advertise_clients``: False keeps clients from learning the servers' own client ports
        (give it to clients that connect through proxies)."""
        if size < 1:
            raise ConfigError(f"a cluster needs at least one server, not {size}")
        self.size, self.name = size, name
        self._store_root = Path(store_root) if store_root is not None else None
        self._max_payload, self._sync_interval = max_payload, sync_interval
        self._route_proxy, self._advertise_clients = route_proxy, advertise_clients
        self._refusing: socket.socket | None = None
        self._advertise: str | None = None
        if route_proxy is not None:
            # Bound and never listening: a connection to it is refused, and no one else can take it.
            self._refusing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._refusing.bind((HOST, 0))
            self._advertise = f"{HOST}:{self._refusing.getsockname()[1]}"
        self.route_proxies: dict[tuple[int, int], RouteProxy] = {}
        """Per ``(from, to)`` server pair, the proxy ``from`` reaches ``to`` through (with ``route_proxy``)."""
        self.servers: list[EmbeddedServer] = []
        self._proxies_started = False
        self._ports_kept = False  # True once every server has started on its route port
        self._lay_out()

    def _lay_out(self) -> None:
        """Pick the route (and proxy) ports and make the servers and proxies that use them."""
        size = self.size
        route_ports = [free_tcp_port() for _ in range(size)]
        if self._route_proxy is not None:
            proxy_ports = {(i, j): free_tcp_port() for i in range(size) for j in range(size) if i != j}
            self.route_proxies = {pair: self._route_proxy(*pair, route_ports[pair[1]], port)
                                  for pair, port in proxy_ports.items()}
            targets = [[f"nats-route://{HOST}:{proxy_ports[i, j]}" for j in range(size) if j != i]
                       for i in range(size)]
        else:
            direct = [f"nats-route://{HOST}:{port}" for port in route_ports]
            targets = [direct[:i] + direct[i + 1:] for i in range(size)]
        self.servers = [
            EmbeddedServer(
                store_dir=self._store_root / f"n{index}" if self._store_root is not None else None,
                name=f"{self.name}-n{index}",
                cluster=ClusterSpec(self.name, route_port, targets[index], advertise=self._advertise,
                                    advertise_clients=self._advertise_clients),
                max_payload=self._max_payload,
                sync_interval=self._sync_interval,
            )
            for index, route_port in enumerate(route_ports)
        ]

    def __repr__(self) -> str:
        return f"<EmbeddedCluster {self.name} {self.servers!r}>"

    @property
    def urls(self) -> list[str]:
        """Every server's client URL, in server order."""
        return [server.url for server in self.servers]

    @property
    def url(self) -> str:
        """All client URLs comma-joined (what ``Settings.from_url`` accepts)."""
        return ",".join(self.urls)

    async def start(self, timeout: float = 30.0) -> None:
        """Start every server and wait until the cluster takes R``size`` streams.

        Raises ``ConfigError`` if the servers could not bind their ports, and ``KeyqueueTimeout``
        if the cluster did not form within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        attempt = 1
        while True:
            try:
                await self._start_members(deadline)
                break
            except (ConfigError, OSError) as exc:
                # Once the servers have run on their ports, clients and stores know them: a start
                # after stop() binds the same ones, and so can in theory still meet a port taken
                # meanwhile (it fails with the server's "address already in use").
                if self._ports_kept or not port_taken(exc):
                    raise
                if attempt == _START_ATTEMPTS:
                    raise ConfigError(
                        f"the {self.size}-server cluster could not start: on each of {_START_ATTEMPTS} attempts, "
                        "another process took a route or route-proxy port it had picked free before its "
                        f"server or proxy could bind it; the last time: {exc}") from exc
                attempt += 1
                await self._discard_layout()
                self._lay_out()
        self._ports_kept = True
        while not await accepts_replicated_stream(self.urls, self.size):
            if time.monotonic() > deadline:
                raise KeyqueueTimeout(f"the {self.size}-server cluster did not form in {timeout}s")
            await asyncio.sleep(0.1)

    async def _start_members(self, deadline: float) -> None:
        """Start the proxies (unless they run) and every server, each up and answering."""
        if not self._proxies_started:
            try:
                await _all(proxy.start() for proxy in self.route_proxies.values())
            except BaseException:
                await asyncio.gather(*(proxy.close() for proxy in self.route_proxies.values()))
                raise
            self._proxies_started = True
        # Concurrently: no server's JetStream answers before a quorum of its peers is up.
        timeout = max(deadline - time.monotonic(), 0.0)
        await _all(server.start(timeout) for server in self.servers)

    async def _discard_layout(self) -> None:
        """Stop the servers and proxies and delete the servers' temporary directories."""
        await asyncio.gather(*(server.aclose() for server in self.servers))
        await asyncio.gather(*(proxy.close() for proxy in self.route_proxies.values()))
        self._proxies_started = False

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop every server; ports and stores are kept for a later ``start()``."""
        await asyncio.gather(*(server.stop(timeout) for server in self.servers))

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` now."""
        self.servers[index].kill()

    async def restart(self, index: int, timeout: float = 30.0) -> None:
        """Restart server ``index`` (also after ``kill``) on its port and store.

        It binds the ports it had. They lie outside the kernel's ephemeral range, so no outgoing
        connection is given one meanwhile; should another process bind one on purpose, this raises
        the server's "address already in use" ``ConfigError``."""
        await self.servers[index].restart(timeout)

    def routes_of(self, index: int) -> list[RouteProxy]:
        """The route proxies from and to server ``index``: fault them all to cut it off from its peers."""
        return [proxy for pair, proxy in self.route_proxies.items() if index in pair]

    async def aclose(self) -> None:
        """Stop every server and its route proxies, and delete their temporary directories."""
        await self._discard_layout()
        if self._refusing is not None:
            self._refusing.close()
            self._refusing = None

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def _all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Await ``coros`` concurrently. On the first failure, cancel the others, wait for them and
    raise it (a taken port before any other failure seen at that moment), so no start goes on
    behind a failed one."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    if not tasks:
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    failures = [exc for task in tasks if not task.cancelled() and (exc := task.exception()) is not None]
    if failures:
        raise next((exc for exc in failures if port_taken(exc)), failures[0])
