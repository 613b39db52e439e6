"""The peers: Celery, Dramatiq and procrastinate on the keyed workloads keyqueue's product path serves.

Each peer serves each :class:`Workload` (hot keys, 100 x 200; cold keys, 2,000 x 1), stored first,
with one worker process, as keyqueue's product path is timed. They run in their own virtual
environment, ``bench/.peers-venv`` (created here on first use, never needed by keyqueue's tests),
against Redis (``bench.peers.services``) and PostgreSQL servers started here on loopback. Anything
that cannot be set up is printed as it happens and becomes a row saying why, never a failed run.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.peers.services import Service, Unavailable, start_postgres, start_redis
from bench.results import Versus

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENV = HERE.parent / ".peers-venv"
REQUIREMENTS = ("celery[redis]>=5.4", "redis>=5", "dramatiq[redis]>=1.17", "procrastinate>=3", "psycopg[binary]>=3.2")
CONCURRENCY = 8
"""Slots per peer worker process (threads for Celery and Dramatiq, async jobs for procrastinate)."""
LABELS = {
    "celery": "Celery 5 + Redis lock",
    "dramatiq": "Dramatiq + ConcurrentRateLimiter",
    "procrastinate": "procrastinate + lock (PostgreSQL)",
}


@dataclass(frozen=True, slots=True)
class Workload:
    """A keyed workload: ``keys`` x ``per_key`` requests, stored round-robin over the keys before the
    worker starts."""

    name: str
    """"hot keys" or "cold keys"."""
    keys: int
    per_key: int

    def __str__(self) -> str:
        return f"{self.name}, {self.keys:,} x {self.per_key:,}"


@dataclass(frozen=True, slots=True)
class PeerResult:
    workload: Workload
    name: str
    rate: float
    check: str
    detail: str


def compare(workload: Workload, raw: float, keyqueue: float, results: list[PeerResult]) -> Versus:
    """keyqueue's rate on ``workload`` beside raw fetch+ack's and the peers' of the same run."""
    return Versus(str(workload), raw, keyqueue, {r.name: r.rate for r in results if r.workload == workload})


def peers_python() -> Path:
    """The peers' interpreter, creating and filling their virtual environment if needed."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    wanted = "\n".join(REQUIREMENTS)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=300)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *REQUIREMENTS],
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise Unavailable(f"pip install into {VENV} failed: {done.stderr.strip()[-300:]}")
    stamp.write_text(wanted)
    return python


def _drive(python: Path, peer: str, workload: Workload, work_dir: Path, redis: str, pg: str,
           timeout: float) -> PeerResult:
    cmd = [str(python), "-m", "bench.peers.drive", peer, "--keys", str(workload.keys), "--per-key",
           str(workload.per_key), "--concurrency", str(CONCURRENCY), "--out", str(work_dir), "--timeout",
           str(timeout), "--redis", redis, "--pg", pg]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout + 120, check=False)
    except subprocess.TimeoutExpired:
        return PeerResult(workload, LABELS[peer], math.nan, "", f"did not finish within {timeout + 120:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return PeerResult(workload, LABELS[peer], math.nan, "", f"failed: {done.stderr.strip()[-300:]}")
    data = json.loads(lines[-1])
    detail = f"{data['ran']:,} of {data['total']:,} ran, {CONCURRENCY} slots, 1 process"
    if not data["finished"]:
        detail += f"; stopped at the {timeout:.0f} s limit"
    if data["detail"] != "ok":
        detail += f"; {data['detail']}"
    return PeerResult(workload, LABELS[peer], float(data["rate"]), data["check"], detail)


def _run_all(workloads: list[Workload], work_dir: Path, say: Callable[[str], None]) -> list[PeerResult]:
    def not_run(reason: str, labels: list[str]) -> list[PeerResult]:
        say(f"  not run: {', '.join(labels)}: {reason}")
        return [PeerResult(w, label, math.nan, "", f"not run: {reason}") for w in workloads for label in labels]

    say(f"  the peers' virtual environment ({VENV.relative_to(REPO)}; the first run installs {len(REQUIREMENTS)} "
        "packages into it) ...")
    try:
        python = peers_python()
    except (Unavailable, subprocess.SubprocessError, OSError) as e:
        return not_run(str(e), list(LABELS.values()))
    services: dict[str, Service | str] = {}
    for name, start in (("redis", start_redis), ("postgres", start_postgres)):
        try:
            services[name] = start()
        except (Unavailable, OSError, subprocess.SubprocessError) as e:
            services[name] = str(e)
    peers = (("celery", "redis"), ("dramatiq", "redis"), ("procrastinate", "postgres"))
    results = []
    try:
        for needs in ("redis", "postgres"):
            service = services[needs]
            if isinstance(service, str):
                results += not_run(f"{needs}: {service}", [LABELS[p] for p, n in peers if n == needs])
        redis, pg = (s.url if isinstance(s, Service) else "" for s in (services["redis"], services["postgres"]))
        for workload in workloads:
            timeout = max(60.0, workload.keys * workload.per_key / 50)
            for peer, needs in peers:
                if isinstance(services[needs], Service):
                    say(f"  {LABELS[peer]}: {workload} ...")
                    results.append(_drive(python, peer, workload, work_dir / workload.name.replace(" ", "-"),
                                          redis, pg, timeout))
    finally:
        for service in services.values():
            if isinstance(service, Service):
                service.stop()
    return results


async def run_peers(workloads: list[Workload], work_dir: Path, say: Callable[[str], None]) -> list[PeerResult]:
    """Run every peer on each of ``workloads``; one result per peer and workload, with the reason
    (also printed through ``say``) when it could not run."""
    return await asyncio.to_thread(_run_all, workloads, work_dir, say)
