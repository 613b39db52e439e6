"""bench.revisions: reading bench.user_path's rows, the order of the runs, and the round-by-round comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.revisions import Figures, checkout, in_turns, medians, parse, ratios

OUTPUT = """raw fetch(200)+ack            23,544 msg/s
hot keys 100 x 200             7,695 req/s  0.33x raw  worker CPU   125 us/req
cold keys 2,000 x 1            1,510 req/s  0.06x raw  worker CPU   610 us/req
unkeyed 1                         31 req/s  0.00x raw  worker CPU     0 us/req
cold, per key              server: 1.00 API calls + 6.00 stored messages = 7.00, 10.54 client messages
"""


def test_the_hot_and_cold_rows_are_read() -> None:
    assert parse(OUTPUT) == Figures(7695.0, 125.0, 1510.0, 610.0)


def test_an_output_without_both_rows_is_an_error_that_shows_it() -> None:
    with pytest.raises(ValueError, match="raw fetch"):
        parse(OUTPUT.splitlines()[0])


def test_rounds_are_compared_pairwise_then_the_median_taken() -> None:
    base = [Figures(100, 10, 50, 20), Figures(200, 10, 50, 20), Figures(100, 20, 50, 40)]
    other = [Figures(110, 9, 50, 18), Figures(180, 11, 60, 20), Figures(120, 18, 55, 30)]
    assert ratios(base, other) == Figures(1.1, 0.9, 1.1, 0.9)
    assert medians(base) == Figures(100, 10, 50, 20)


def test_the_revisions_take_turns_at_running_first() -> None:
    runs = list(in_turns((("base", "b"), ("other", "o")), 4))
    assert [(n, name) for n, name, _ in runs] == [
        (1, "base"), (1, "other"), (2, "other"), (2, "base"), (3, "base"), (3, "other"), (4, "other"), (4, "base")]
    assert all(tree == name[0] for _, name, tree in runs)


def test_one_revision_twice_is_checked_out_twice(tmp_path: Path) -> None:
    with checkout("HEAD", tmp_path) as first, checkout("HEAD", tmp_path, 2) as second:
        assert first != second and (first / "bench" / "revisions.py").exists()
        assert (second / "bench" / "revisions.py").exists()
    assert not first.exists() and not second.exists()
