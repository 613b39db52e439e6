"""Facts about the machine a benchmark ran on, for the report."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime

from keyqueue.server.embedded import find_nats_server


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> str:
    try:
        with open("/proc/meminfo") as meminfo:
            kb = int(meminfo.readline().split()[1])
        return f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except OSError:
        return "not installed"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def facts() -> dict[str, str]:
    from nats.aio.client import __version__ as nats_py

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "memory": _mem_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "nats-server": _version([find_nats_server(), "--version"]),
        "nats-py": nats_py,
    }
