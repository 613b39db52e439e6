"""A JetStream cluster of embedded nats-servers on loopback (for tests and local experiments).

Routes between the servers may go through proxies (``route_proxy``): server *i* then reaches
server *j* only through proxy ``(i, j)``, so a test can cut one server off from its peers by
faulting every proxy that touches it. nats-server opens *implicit* routes to the address a peer
gossips; each server therefore gossips an address that refuses connections, which keeps every
route on a proxy, also after a cut-off heals.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

from keyqueue.errors import ConfigError, KeyqueueTimeout
from keyqueue.server.embedded import HOST, ClusterSpec, EmbeddedServer, free_tcp_port
from keyqueue.server.probe import accepts_replicated_stream

__all__ = ["EmbeddedCluster", "RouteProxy", "RouteProxyFactory"]


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
    created and kept, like the client ports, across restarts.
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
        route_ports = [free_tcp_port() for _ in range(size)]
        self.route_proxies: dict[tuple[int, int], RouteProxy] = {}
        """Per ``(from, to)`` server pair, the proxy ``from`` reaches ``to`` through (with ``route_proxy``)."""
        self._refusing: socket.socket | None = None
        advertise = None
        if route_proxy is not None:
            proxy_ports = {(i, j): free_tcp_port() for i in range(size) for j in range(size) if i != j}
            self.route_proxies = {pair: route_proxy(*pair, route_ports[pair[1]], port)
                                  for pair, port in proxy_ports.items()}
            targets = [[f"nats-route://{HOST}:{proxy_ports[i, j]}" for j in range(size) if j != i]
                       for i in range(size)]
            # Bound and never listening: a connection to it is refused, and no one else can take it.
            self._refusing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._refusing.bind((HOST, 0))
            advertise = f"{HOST}:{self._refusing.getsockname()[1]}"
        else:
            direct = [f"nats-route://{HOST}:{port}" for port in route_ports]
            targets = [direct[:i] + direct[i + 1:] for i in range(size)]
        self.servers: list[EmbeddedServer] = [
            EmbeddedServer(
                store_dir=Path(store_root) / f"n{index}" if store_root is not None else None,
                name=f"{name}-n{index}",
                cluster=ClusterSpec(name, route_port, targets[index], advertise=advertise,
                                    advertise_clients=advertise_clients),
                max_payload=max_payload,
                sync_interval=sync_interval,
            )
            for index, route_port in enumerate(route_ports)
        ]
        self._proxies_started = False

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
        """Start every server and wait until the cluster takes R``size`` streams."""
        deadline = time.monotonic() + timeout
        if not self._proxies_started:
            await asyncio.gather(*(proxy.start() for proxy in self.route_proxies.values()))
            self._proxies_started = True
        # Concurrently: no server's JetStream answers before a quorum of its peers is up.
        await asyncio.gather(*(server.start(timeout) for server in self.servers))
        while not await accepts_replicated_stream(self.urls, self.size):
            if time.monotonic() > deadline:
                raise KeyqueueTimeout(f"the {self.size}-server cluster did not form in {timeout}s")
            await asyncio.sleep(0.1)

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop every server; ports and stores are kept for a later ``start()``."""
        await asyncio.gather(*(server.stop(timeout) for server in self.servers))

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` now."""
        self.servers[index].kill()

    async def restart(self, index: int, timeout: float = 30.0) -> None:
        """Restart server ``index`` (also after ``kill``) on its port and store."""
        await self.servers[index].restart(timeout)

    def routes_of(self, index: int) -> list[RouteProxy]:
        """The route proxies from and to server ``index``: fault them all to cut it off from its peers."""
        return [proxy for pair, proxy in self.route_proxies.items() if index in pair]

    async def aclose(self) -> None:
        """Stop every server and its route proxies, and delete their temporary directories."""
        await asyncio.gather(*(server.aclose() for server in self.servers))
        await asyncio.gather(*(proxy.close() for proxy in self.route_proxies.values()))
        self._proxies_started = False
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

