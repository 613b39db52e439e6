"""Short soaks of each fault class (the full soak is ``make chaos``; see README and docs/chaos.md).

Three worker processes, each behind its own fault proxy (on a 3-node cluster: connected to all
nodes), a producer on twelve keys, seeded faults of one class; the checker must find no overlap,
no order violation, no lost request and no stale write accepted by the fenced store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyqueue.chaos.soak import SoakOptions, soak

EXPECTED_KINDS = {
    "network": {"net-blackhole", "net-reset"},
    "process": {"stall-over", "sigstop", "kill-9"},
    "server": {"server-restart", "server-kill-9"},
    "cluster": {f"leader-kill-9-{target}" for target in ("inbox", "tokens", "leases", "consumer")},
}


@pytest.mark.parametrize("fault_class", ["network", "process", "server", "cluster"])
async def test_short_soak(fault_class: str, tmp_path: Path) -> None:
    # Seeds chosen so that each class injects its dangerous kinds within the short run.
    options = SoakOptions(seed=3, duration={"server": 16.0, "cluster": 25.0}.get(fault_class, 20.0),
                          classes=(fault_class,), workdir=tmp_path, progress=None)
    result = await soak(options)
    print(result.summary())
    assert result.ok, result.summary()
    assert result.verdict.completed == result.verdict.requests > 100
    assert result.verdict.writes_accepted >= result.verdict.completed
    injected = set(result.faults)
    assert injected, "no fault was injected"
    assert injected <= EXPECTED_KINDS[fault_class] | {"net-latency", "net-bandwidth", "stall-under", "drain"}
    # (the cluster soak's faults are spaced 4-8 s apart, so a short run injects few of them)
    assert EXPECTED_KINDS[fault_class] & injected, f"none of {EXPECTED_KINDS[fault_class]} was injected"
