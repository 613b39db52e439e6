"""Short soaks of each fault class, and of every class at once on a cluster (the full soaks are
``make chaos`` and ``make chaos-cluster``; see README and docs/chaos.md).

Three worker processes, each behind its own fault proxy (on a 3-node cluster: a proxy per node), a
producer on twelve keys, seeded faults; the checker must find no overlap, no order violation, no
lost request, no stale write accepted by the fenced store, and no strand or hand-off past its bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyqueue.chaos.checker import LivenessBounds, read_log
from keyqueue.chaos.handlers import BAD_INPUTS, HANDLERS, SHAPES
from keyqueue.chaos.soak import CLASSES, SoakOptions, soak

pytestmark = pytest.mark.serial  # alone, after the parallel part of make test TEST_WORKERS=N

BOUNDS = LivenessBounds.for_lease(2.0, strand=4.0, resume=4.0, slack=2.0)
"""The soaks' lease is 2 s. A test shares its machine with others (in CI, and here): its strands and
hand-offs are held to twice the documented soak's bounds (docs/chaos.md: strand and resume 2 s, a
lost holder's keys within the lease's whole seconds + 1 s), which still fails a request left to a
reconciler sweep (5 s in the chaos worker) or a key kept a lease too long. (At the documented
bounds a full suite's run once missed by 14 ms: a stepdown's key moved after 2.126 s, not 2.112.)"""

EXPECTED_KINDS = {
    "network": {"net-blackhole", "net-reset"},
    "process": {"stall-over", "sigstop", "kill-9", "block-loop"},
    "server": {"server-restart", "server-kill-9"},
    "cluster": {f"leader-kill-9-{target}" for target in ("inbox", "tokens", "leases", "consumer")},
}


@pytest.mark.parametrize("fault_class", ["network", "process", "server", "cluster"])
async def test_short_soak(fault_class: str, tmp_path: Path) -> None:
    # Seeds chosen so that each class injects its dangerous kinds within the short run.
    options = SoakOptions(seed=3, duration={"server": 16.0, "cluster": 25.0}.get(fault_class, 20.0),
                          classes=(fault_class,), workdir=tmp_path, progress=None, bounds=BOUNDS)
    result = await soak(options)
    print(result.summary())
    assert result.ok, result.summary()
    assert result.verdict.completed == result.verdict.requests > 100
    assert result.verdict.writes_accepted >= result.verdict.completed
    injected = set(result.faults)
    assert injected, "no fault was injected"
    assert injected <= EXPECTED_KINDS[fault_class] | {"net-latency", "net-bandwidth", "stall-under", "drain"}
    # (the cluster soak's faults are spaced 2-5 s apart, so a short run injects few of them)
    assert EXPECTED_KINDS[fault_class] & injected, f"none of {EXPECTED_KINDS[fault_class]} was injected"


async def test_short_cluster_soak_mixing_every_class(tmp_path: Path) -> None:
    options = SoakOptions(seed=3, duration=25.0, classes=CLASSES, workdir=tmp_path, progress=None, bounds=BOUNDS)
    assert options.clustered
    result = await soak(options)
    print(result.summary())
    records = read_log(result.log_path)
    # Every worker ran with its wall clock tens of seconds off, and logged on the true clock.
    offsets = {r["w"]: r["clock_offset"] for r in records if r["kind"] == "ready"}
    assert len(offsets) == 3 and all(10 <= abs(offset) <= 60 for offset in offsets.values())
    assert offsets == result.clock_offsets
    # Faults of the worker's network, the nodes and the processes were all injected.
    kinds = set(result.faults)
    assert {kind for kind in kinds if kind.startswith("net-")}
    assert kinds & {"rolling-restart", "node-cut"} or any(k.startswith(("stepdown-", "leader-")) for k in kinds)
    assert result.verdict.liveness is not None
    assert len(result.verdict.liveness.strands) == result.verdict.requests > 100
    assert result.ok, result.summary()


async def test_short_soak_running_every_handler_shape_and_bad_input(tmp_path: Path) -> None:
    # Every request takes the async, thread or process shape; one every 4 s stalls its worker for 1.5x
    # the lease, holding the GIL in C code or blocking the loop in turn; bad input every second.
    options = SoakOptions(seed=3, duration=20.0, classes=("process",), handlers=HANDLERS, stall_every=4.0,
                          bad_every=1.0, rss_warmup=5.0, workdir=tmp_path, progress=None, bounds=BOUNDS)
    result = await soak(options)
    print(result.summary())
    verdict = result.verdict
    # Every shape ran, none overlapped, and every bad request was settled (dead-lettered with its reason).
    assert set(verdict.shapes) == set(SHAPES), verdict.shapes
    assert all(runs > 0 and not overlaps for runs, overlaps in verdict.shapes.values()), verdict.shapes
    assert {b.bad for b in verdict.bad_inputs} == set(BAD_INPUTS)
    assert not verdict.unsettled
    assert all(b.reason for b in verdict.bad_inputs if b.bad not in ("long-inbox", "foreign-subject"))
    # Lines no client library writes (subjects and a status line that are not UTF-8) reached every
    # worker; each token among them was read, its key given back, and no connection was lost to them.
    assert all(b.settled == "given back" for b in verdict.bad_inputs if b.bad == "foreign-subject")
    records = read_log(result.log_path)
    assert not [r for r in records if r["kind"] == "reconnected"]  # (process faults only: none drops one)
    assert verdict.completed == verdict.requests > 100
    # A stalled worker may be ended (the loop watchdog's exit 75, or a SIGKILL at its lease's end):
    # the fleet starts a new process under its name, as after a kill -9 fault.
    for died in (r for r in records if r["kind"] == "exited"):
        assert any(r["kind"] == "ready" and r["w"] == died["w"] and r["t"] > died["t"] for r in records), died
    # Each worker's memory after warm-up and at the end is printed.
    assert {s.name for s in result.rss} == {"w0", "w1", "w2"}
    assert "rss:" in result.summary()
    assert result.ok, result.summary()
