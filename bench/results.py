"""The benchmark's results: sizes per mode, one row per figure, and the whole report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each workload is in one mode."""

    mode: str
    hot_keys: int
    hot_per_key: int
    cold_keys: int
    bulk: int
    single: int
    raw: int
    probes: int
    probe_interval: float
    held_keys: int
    solo: int
    """Requests on one hot key, alone, for the hand-off figure."""
    product_per_key: int = 0
    """Requests per hot key on the product path and for the peers (the hot workload the goals are set
    on: 100 x 200); 0: ``hot_per_key``."""
    product_cold_keys: int = 0
    """Keys of one request each on the product path and for the peers (the cold workload the goals are
    set on: 2,000 x 1); 0: ``cold_keys``."""

    @property
    def hot_total(self) -> int:
        return self.hot_keys * self.hot_per_key

    @property
    def product_hot_per_key(self) -> int:
        return self.product_per_key or self.hot_per_key

    @property
    def product_cold(self) -> int:
        return self.product_cold_keys or self.cold_keys


FULL = Sizes("full", hot_keys=100, hot_per_key=100, cold_keys=5000, bulk=20_000, single=2000, raw=50_000,
             probes=600, probe_interval=0.01, held_keys=10_000,
             solo=2000, product_per_key=200, product_cold_keys=2000)
QUICK = Sizes("quick", hot_keys=100, hot_per_key=20, cold_keys=1000, bulk=5000, single=500, raw=10_000,
              probes=150, probe_interval=0.01, held_keys=1000,
              solo=500)
SMOKE = Sizes("smoke", hot_keys=5, hot_per_key=4, cold_keys=20, bulk=100, single=20, raw=200,
              probes=10, probe_interval=0.005, held_keys=20, solo=20)
MODES = {s.mode: s for s in (FULL, QUICK, SMOKE)}


@dataclass(slots=True)
class Row:
    """One line of the table: a figure for one system on one workload."""

    workload: str
    system: str
    value: float
    unit: str
    detail: str = ""
    """Secondary figures (p99, counts) as text."""
    ratio: float | None = None
    """The figure over its baseline (raw JetStream), when there is one."""
    baseline: str = ""
    goal: str = ""
    """The issue's goal for this figure, as text ("ratio >= 0.5", "p50 <= 2 ms")."""
    met: bool | None = None
    check: str = ""
    """For keyed workloads: did the run keep per-key order and exclusivity."""

    def figure(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        if self.unit in ("req/s", "msg/s", "events/s"):
            return f"{self.value:,.0f} {self.unit}"
        if self.unit == "x":
            return f"{self.value:,.2f}x"
        if self.unit == "ms":
            return f"{self.value:.2f} ms"
        return f"{self.value:,.2f} {self.unit}".strip()


@dataclass(slots=True)
class Versus:
    """One keyed workload served by raw fetch+ack, keyqueue's product path and each peer, in one run."""

    workload: str
    """What was served, as "hot keys, 100 x 200"."""
    raw: float
    """Raw JetStream fetch(200)+ack, msg/s (no exclusivity: the ceiling)."""
    keyqueue: float
    """The product path (``keyqueue worker``), req/s."""
    peers: dict[str, float] = field(default_factory=dict)
    """Each peer's rate by its label, req/s; NaN for a peer that did not run (its row says why)."""

    def best_peer(self) -> tuple[str, float] | None:
        """The fastest peer that ran, or None if none did."""
        ran = [(rate, name) for name, rate in self.peers.items() if not math.isnan(rate) and rate > 0]
        return (max(ran)[1], max(ran)[0]) if ran else None

    @property
    def vs_raw(self) -> float:
        return self.keyqueue / self.raw if self.raw else math.nan

    @property
    def vs_best_peer(self) -> float:
        best = self.best_peer()
        return self.keyqueue / best[1] if best else math.nan


@dataclass
class Report:
    """Everything one run measured."""

    mode: str
    command: str
    machine: dict[str, str] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    distributions: dict[str, list[float]] = field(default_factory=dict)
    """Latency samples in ms, by label, for the chart."""
    notes: list[str] = field(default_factory=list)
    versus: list[Versus] = field(default_factory=list)
    """keyqueue beside raw JetStream and the peers, per keyed workload (with ``--peers``)."""
    seconds: float = 0.0

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def find(self, workload: str, system: str = "keyqueue") -> Row | None:
        for row in self.rows:
            if row.workload == workload and row.system == system:
                return row
        return None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["distributions"] = {k: len(v) for k, v in self.distributions.items()}
        return data
