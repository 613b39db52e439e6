"""The peers: Celery, Dramatiq and procrastinate on the same keyed workload as keyqueue's workload 1.

They run in their own virtual environment, ``bench/.peers-venv`` (created here on first use,
never needed by keyqueue's tests), against Redis and PostgreSQL servers started here on
loopback. Anything that cannot be set up becomes a row saying why, never a failed run.
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
class PeerResult:
    name: str
    rate: float
    check: str
    detail: str


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


def _drive(python: Path, peer: str, keys: int, per_key: int, work_dir: Path, redis: str, pg: str,
           timeout: float) -> PeerResult:
    cmd = [str(python), "-m", "bench.peers.drive", peer, "--keys", str(keys), "--per-key", str(per_key),
           "--concurrency", str(CONCURRENCY), "--out", str(work_dir), "--timeout", str(timeout),
           "--redis", redis, "--pg", pg]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout + 120, check=False)
    except subprocess.TimeoutExpired:
        return PeerResult(LABELS[peer], math.nan, "", f"did not finish within {timeout + 120:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return PeerResult(LABELS[peer], math.nan, "", f"failed: {done.stderr.strip()[-300:]}")
    data = json.loads(lines[-1])
    detail = f"{data['ran']:,} of {data['total']:,} ran, {CONCURRENCY} slots, 1 process"
    if not data["finished"]:
        detail += f"; stopped at the {timeout:.0f} s limit"
    if data["detail"] != "ok":
        detail += f"; {data['detail']}"
    return PeerResult(LABELS[peer], float(data["rate"]), data["check"], detail)


def _run_all(keys: int, per_key: int, work_dir: Path, say: Callable[[str], None]) -> list[PeerResult]:
    try:
        python = peers_python()
    except (Unavailable, subprocess.SubprocessError, OSError) as e:
        return [PeerResult(label, math.nan, "", f"not run: {e}") for label in LABELS.values()]
    services: dict[str, Service | str] = {}
    for name, start in (("redis", start_redis), ("postgres", start_postgres)):
        try:
            services[name] = start()
        except (Unavailable, OSError, subprocess.SubprocessError) as e:
            services[name] = str(e)
    timeout = max(60.0, keys * per_key / 50)
    results = []
    try:
        for peer, needs in (("celery", "redis"), ("dramatiq", "redis"), ("procrastinate", "postgres")):
            service = services[needs]
            if isinstance(service, str):
                results.append(PeerResult(LABELS[peer], math.nan, "", f"not run: {needs}: {service}"))
                continue
            say(f"  {LABELS[peer]} ...")
            redis = services["redis"].url if isinstance(services["redis"], Service) else ""
            pg = services["postgres"].url if isinstance(services["postgres"], Service) else ""
            results.append(_drive(python, peer, keys, per_key, work_dir, redis, pg, timeout))
    finally:
        for service in services.values():
            if isinstance(service, Service):
                service.stop()
    return results


async def run_peers(keys: int, per_key: int, work_dir: Path, say: Callable[[str], None]) -> list[PeerResult]:
    """Run every peer on ``keys`` x ``per_key``; one result per peer, with a reason when it could not run."""
    return await asyncio.to_thread(_run_all, keys, per_key, work_dir, say)
