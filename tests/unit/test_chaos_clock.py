"""A chaos worker's skewed wall clock (``keyqueue.chaos.clock``), in a child process: the skew
patches process-wide clocks, which must not leak into the test process."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import datetime, json, time
from keyqueue.chaos.clock import TRUE_TIME, skew_wall_clock
import keyqueue.core.lock as lock
skew_wall_clock({offset})
true = TRUE_TIME()
print(json.dumps({{
    "time": time.time() - true,
    "time_ns": time.time_ns() / 1e9 - true,
    "module_now": datetime.datetime.now(datetime.UTC).timestamp() - true,
    "keyqueue_now": lock.datetime.now(datetime.UTC).timestamp() - true,
    "utcnow": (datetime.datetime.utcnow() - datetime.datetime(1970, 1, 1)).total_seconds() - true,
    "isinstance_kept": isinstance(datetime.datetime.fromtimestamp(0), lock.datetime),
    "true_clock": abs(TRUE_TIME() - true) < 5,
}}))
"""


def skewed(offset: float) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(offset=offset)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    result: dict[str, float] = json.loads(out)
    return result


def test_every_wall_clock_of_the_process_runs_off_by_the_offset_and_the_true_clock_stays() -> None:
    for offset in (-42.5, 30.0):
        seen = skewed(offset)
        for clock in ("time", "time_ns", "module_now", "keyqueue_now", "utcnow"):
            assert abs(seen[clock] - offset) < 1.0, (clock, seen)
        assert seen["isinstance_kept"] and seen["true_clock"]


def test_no_offset_changes_nothing() -> None:
    seen = skewed(0.0)
    assert all(abs(seen[clock]) < 1.0 for clock in ("time", "time_ns", "module_now", "keyqueue_now", "utcnow"))
