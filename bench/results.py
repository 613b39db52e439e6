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
    """Requests per hot key on the product path (the hot workload the goals are set on: 100 x 200); 0:
    ``hot_per_key``."""

    @property
    def hot_total(self) -> int:
        return self.hot_keys * self.hot_per_key


FULL = Sizes("full", hot_keys=100, hot_per_key=100, cold_keys=5000, bulk=20_000, single=2000, raw=50_000,
             probes=600, probe_interval=0.01, held_keys=10_000,
             solo=2000, product_per_key=200)
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
        if self.unit == "ms":
            return f"{self.value:.2f} ms"
        return f"{self.value:,.2f} {self.unit}".strip()


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
