"""A Spark standalone cluster on loopback, from the pyspark distribution itself: a master and workers.

Each daemon is ``bin/spark-class org.apache.spark.deploy.master.Master`` (or ``...worker.Worker``)
of the installed pyspark, started on port 0 (Spark picks a free port and logs it); nothing is
downloaded. A thread per daemon reads its log as it is written, so the start waits on the lines
that say the master listens and each worker registered, not on a clock. Executors started by
the workers are JVMs of their own, with Python workers of their own; their logs are in each
worker's ``work`` directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Final

import pyspark

SPARK_HOME: Final = Path(pyspark.__file__).parent
SPARK_CLASS: Final = SPARK_HOME / "bin" / "spark-class"

MASTER_URL: Final = re.compile(r"Starting Spark master at (spark://\S+)")
REGISTERED: Final = re.compile(r"Successfully registered with master")
CONNECT_STARTED: Final = re.compile(r"Spark Connect server started at: (\S+)")

DAEMON_MEMORY: Final = "256m"
"""Heap of the master and worker daemons (Spark's default is 1g): they only schedule."""

WORKER_MEMORY: Final = "1g"
"""What a worker offers its executors."""

EXECUTOR_MEMORY: Final = "512m"
"""What the tests' drivers ask per executor (``spark.executor.memory``)."""

FAST_JVM: Final = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def loopback_env() -> dict[str, str]:
    """The environment of every process of the cluster, drivers included: bound to 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update({"SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOCAL_HOSTNAME": "localhost", "SPARK_HOME": str(SPARK_HOME)})
    return env


class Daemon:
    """One JVM of the cluster, its log copied to ``log`` by a reader thread that also watches for a line."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        with self.log.open("w") as out:
            for raw in stream:
                line = raw.decode(errors="replace")
                out.write(line)
                out.flush()
                with self._changed:
                    self._lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The first log line matching ``pattern``; raises if the JVM exits or ``timeout`` passes first."""
        found: list[re.Match[str]] = []

        def matched() -> bool:
            for line in self._lines:
                match = pattern.search(line)
                if match:
                    found.append(match)
                    return True
            return self._ended

        with self._changed:
            self._changed.wait_for(matched, timeout)
        if not found:
            state = "exited" if self._ended else f"no such line within {timeout:.0f}s"
            raise RuntimeError(f"{self.log.stem}: {state} waiting for {pattern.pattern!r}; "
                               f"log: {self.log}\n{''.join(self._lines[-20:])}")
        return found[0]

    def stop(self) -> None:
        """Stop the JVM (and anything it started, such as executors) and wait for it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(timeout=10)


class StandaloneCluster:
    """A master and ``workers`` workers (``cores`` each) on 127.0.0.1; ``url`` is ``spark://127.0.0.1:PORT``."""

    def __init__(self, root: Path, *, workers: int = 2, cores: int = 1, timeout: float = 120.0) -> None:
        self.root = root
        self.env = {**loopback_env(), "SPARK_DAEMON_MEMORY": DAEMON_MEMORY, "SPARK_DAEMON_JAVA_OPTS": FAST_JVM,
                    "SPARK_LOG_DIR": str(root / "logs"), "SPARK_WORKER_DIR": str(root / "work")}
        self.daemons: list[Daemon] = []
        self.work_dirs: list[Path] = []
        root.mkdir(parents=True, exist_ok=True)
        try:
            master = self._start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                                  "--webui-port", "0"], root / "master.log")
            self.url = master.wait_for(MASTER_URL, timeout).group(1)
            for n in range(workers):
                work = root / f"worker-{n}"
                work.mkdir()
                self.work_dirs.append(work)
                self._start(["org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1", "--port", "0",
                             "--webui-port", "0", "--cores", str(cores), "--memory", WORKER_MEMORY,
                             "--work-dir", str(work)], root / f"worker-{n}.log")
            for worker in self.daemons[1:]:
                worker.wait_for(REGISTERED, timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str], log: Path) -> Daemon:
        daemon = Daemon([str(SPARK_CLASS), *args], log, self.env)
        self.daemons.append(daemon)
        return daemon

    @contextmanager
    def connect_server(self, timeout: float = 120.0) -> Iterator[str]:
        """pyspark's Spark Connect server (``sbin/start-connect-server.sh --wait``) as a driver of this
        cluster; yields its ``sc://127.0.0.1:PORT``. Its Python workers run this Python."""
        env = {k: v for k, v in self.env.items() if k != "SPARK_DAEMON_MEMORY"}  # it is a driver, not a daemon
        env["PYSPARK_PYTHON"] = sys.executable
        conf = {**self.driver_conf(), "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": "0", "spark.pyspark.python": sys.executable}
        settings = [arg for name, value in conf.items() for arg in ("--conf", f"{name}={value}")]
        command = [str(SPARK_HOME / "sbin" / "start-connect-server.sh"), "--wait", "--master", self.url,
                   "--driver-memory", "768m", *settings]
        server = Daemon(command, self.root / "connect-server.log", env)
        try:
            yield f"sc://{server.wait_for(CONNECT_STARTED, timeout).group(1)}"
        finally:
            server.stop()

    def driver_conf(self) -> dict[str, str]:
        """Settings for a driver of this cluster: executors small, on loopback, quick to start."""
        return {"spark.executor.memory": EXECUTOR_MEMORY, "spark.executor.cores": "1",
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.driver.extraJavaOptions": FAST_JVM, "spark.executor.extraJavaOptions": FAST_JVM,
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "2"}

    def executor_dirs(self) -> list[list[Path]]:
        """Per worker: the directories of the executors it ran (``work/<app>/<executor id>``)."""
        return [sorted(p for p in work.glob("app-*/*") if p.is_dir()) for work in self.work_dirs]

    def stop(self, on_stopped: Callable[[], None] | None = None) -> None:
        """Stop the workers (and their executors), then the master."""
        for daemon in reversed(self.daemons):
            daemon.stop()
        if on_stopped is not None:
            on_stopped()
