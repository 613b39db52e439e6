"""The soak's memory check: each worker's RSS after warm-up against after the last fault."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from keyqueue.chaos.checker import check
from keyqueue.chaos.fleet import RssSample, rss_bytes
from keyqueue.chaos.soak import SoakResult

MIB = 2**20


def result(rss: list[RssSample], limit: float | None) -> SoakResult:
    return SoakResult(check([], {}), Counter(), 1.0, 0, Path("run.jsonl"), rss=rss, rss_limit=limit)


def test_rss_is_read_from_proc() -> None:
    assert (rss_bytes(os.getpid()) or 0) > MIB


def test_growth_past_the_limit_fails_the_soak_only_with_a_limit() -> None:
    samples = [RssSample("w0", 10, 100 * MIB, 105 * MIB), RssSample("w1", 11, 100 * MIB, 120 * MIB),
               RssSample("w2", 12, None, 90 * MIB)]  # restarted too late to warm up: not compared
    printed = result(samples, None)
    assert printed.ok and not printed.rss_over
    summary = printed.summary()
    assert "rss: 1/2 compared workers within 10% of their warm-up (1 not compared" in summary
    assert "rss w1 (pid 11): 100.0 MiB after warm-up, 120.0 MiB after the last fault (+20.0%, OVER 10%)" in summary
    assert "rss w2 (pid 12): - after warm-up, 90.0 MiB after the last fault (not compared)" in summary
    limited = result(samples, 0.10)
    assert not limited.ok
    assert [s.name for s in limited.rss_over] == ["w1"]
    assert result(samples[:1], 0.10).ok
