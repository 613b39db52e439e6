"""``EmbeddedCluster`` and the ports it picks free up front (route ports, route-proxy ports).

Another process can take such a port between ``free_tcp_port()`` releasing it and the server (or
proxy) binding it. These tests make that happen every time: ``free_tcp_port`` as the cluster sees
it answers, at a chosen call, a port a socket of the test holds listening. Without the retry in
``EmbeddedCluster.start()`` the first test fails with nats-server's "address already in use".
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Iterator

import nats
import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from keyqueue.chaos.proxy import FaultProxy
from keyqueue.errors import ConfigError
from keyqueue.server import cluster as cluster_module
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import HOST, free_tcp_port


@pytest.fixture
def taken() -> Iterator[Callable[[], int]]:
    """``taken()`` is a port that a socket of the test listens on until the test ends."""
    sockets: list[socket.socket] = []

    def take() -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sockets.append(sock)
        sock.bind((HOST, 0))
        sock.listen()
        port: int = sock.getsockname()[1]
        return port

    yield take
    for sock in sockets:
        sock.close()


def _answers(monkeypatch: pytest.MonkeyPatch, answers: Callable[[int], int]) -> list[int]:
    """Make the cluster's ``free_tcp_port()`` answer ``answers(call number)``; returns the answers given."""
    given: list[int] = []
    calls = itertools.count()

    def patched() -> int:
        given.append(answers(next(calls)))
        return given[-1]

    monkeypatch.setattr(cluster_module, "free_tcp_port", patched)
    return given


async def _route_port(monitoring_url: str) -> int:
    def get() -> int:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{monitoring_url}/varz", timeout=5) as response:
            port: int = json.load(response)["cluster"]["cluster_port"]
            return port

    return await asyncio.to_thread(get)


async def _serves_r3(cluster: EmbeddedCluster) -> None:
    """A publish to a new R3 stream is stored, on every server."""
    nc = await nats.connect(cluster.urls)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="PORTS", subjects=["ports.>"], num_replicas=3))
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # "no responders" until the new stream's leader is elected and known
            try:
                ack = await js.publish("ports.x", b"stored")
                break
            except nats.js.errors.NoStreamResponseError:
                assert asyncio.get_running_loop().time() < deadline, "the R3 stream never answered"
                await asyncio.sleep(0.05)
        assert ack.seq == 1
        info = await js.stream_info("PORTS")
        assert info.state.messages == 1 and info.cluster is not None
        peers = {info.cluster.leader} | {replica.name for replica in info.cluster.replicas or []}
        assert peers == {server.name for server in cluster.servers}
    finally:
        await nc.close()


@pytest.mark.parametrize("proxied", [False, True], ids=["direct", "proxied"])
async def test_a_port_taken_before_the_cluster_binds_it_is_picked_again(
        proxied: bool, taken: Callable[[], int], monkeypatch: pytest.MonkeyPatch) -> None:
    # The first answer is server 0's route port; with proxies, the fourth is proxy (0, 1)'s port.
    stolen_at = 3 if proxied else 0
    held = taken()
    given = _answers(monkeypatch, lambda call: held if call == stolen_at else free_tcp_port())
    factory = (lambda _i, _j, upstream, port: FaultProxy(HOST, upstream, port=port)) if proxied else None
    async with EmbeddedCluster(3, route_proxy=factory) as cluster:
        ports_per_layout = 3 + (6 if proxied else 0)
        # The layout with the held port was given up. (A later one can be too: a port picked afresh
        # may still be held by a server of the layout just stopped, which the retry also rides out.)
        layouts = len(given) // ports_per_layout
        assert len(given) % ports_per_layout == 0 and layouts >= 2, given
        last = given[(layouts - 1) * ports_per_layout:]
        route_ports = [await _route_port(server.monitoring_url) for server in cluster.servers]
        assert route_ports == last[:3]
        if proxied:
            proxies = [proxy for proxy in cluster.route_proxies.values() if isinstance(proxy, FaultProxy)]
            assert sorted(proxy.port for proxy in proxies) == sorted(last[3:])
        await _serves_r3(cluster)


async def test_ports_taken_on_every_attempt_fail_the_start_saying_so(
        taken: Callable[[], int], monkeypatch: pytest.MonkeyPatch) -> None:
    held = [taken() for _ in range(3)]
    given = _answers(monkeypatch, lambda call: held[call % 3])
    cluster = EmbeddedCluster(3)
    with pytest.raises(ConfigError, match=r"(?s)on each of 5 attempts, another process took a route or "
                                          r"route-proxy port .* address already in use"):
        await cluster.start(timeout=30)
    assert len(given) == 5 * 3
    assert not any(server.running for server in cluster.servers)
    await cluster.aclose()
