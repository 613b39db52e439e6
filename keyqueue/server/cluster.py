"""A JetStream cluster of embedded nats-servers on loopback (for tests and local experiments)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from keyqueue.errors import ConfigError, KeyqueueTimeout
from keyqueue.server.embedded import HOST, ClusterSpec, EmbeddedServer, free_tcp_port
from keyqueue.server.probe import accepts_replicated_stream

__all__ = ["EmbeddedCluster"]


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
    ) -> None:
        if size < 1:
            raise ConfigError(f"a cluster needs at least one server, not {size}")
        self.size, self.name = size, name
        route_ports = [free_tcp_port() for _ in range(size)]
        routes = [f"nats-route://{HOST}:{port}" for port in route_ports]
        self.servers: list[EmbeddedServer] = [
            EmbeddedServer(
                store_dir=Path(store_root) / f"n{index}" if store_root is not None else None,
                name=f"{name}-n{index}",
                cluster=ClusterSpec(name, route_port, routes[:index] + routes[index + 1 :]),
                max_payload=max_payload,
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
        """Start every server and wait until the cluster takes R``size`` streams."""
        deadline = time.monotonic() + timeout
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

    async def aclose(self) -> None:
        """Stop every server and delete their temporary directories."""
        await asyncio.gather(*(server.aclose() for server in self.servers))

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

