"""The chaos checker's rules, on synthetic run logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keyqueue.chaos.checker import Verdict, build_runs, check, read_log
from keyqueue.chaos.liveness import Distribution, LivenessBounds


def rec(kind: str, w: str, t: float, key: str = "", tag: str = "", **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"kind": kind, "w": w, "t": t, **fields}
    if key:
        record["key"], record["tag"] = key, tag
    return record


def run(w: str, key: str, tag: str, start: float, end: float) -> list[dict[str, Any]]:
    return [rec("start", w, start, key, tag), rec("end", w, end, key, tag)]


def write(w: str, t: float, key: str, tag: str, fencing: list[int], accepted: bool, **fields: Any) -> dict[str, Any]:
    return rec("write", w, t, key, tag, fencing=fencing, accepted=accepted, **fields)


EXPECTED = {"k": ["a", "b", "c"]}


def clean_log() -> list[dict[str, Any]]:
    return [
        *run("w1", "k", "a", 1.0, 2.0), write("w1", 1.5, "k", "a", [1, 1], True),
        *run("w2", "k", "b", 2.0, 3.0), write("w2", 2.5, "k", "b", [2, 1], True),
        *run("w1", "k", "c", 3.5, 4.0), write("w1", 3.7, "k", "c", [3, 1], True),
        *run("w2", "j", "x", 1.0, 4.0),  # another key runs alongside: no overlap
    ]


def test_a_clean_log_is_ok() -> None:
    verdict = check(clean_log(), {**EXPECTED, "j": ["x"]})
    assert verdict.ok, verdict.summary()
    assert (verdict.runs, verdict.completed, verdict.requests) == (4, 4, 4)
    assert verdict.writes_accepted == 3
    assert not (verdict.overlaps or verdict.fenced_overlaps or verdict.duplicates)
    assert verdict.summary().startswith("verdict: OK")


def test_two_runs_of_one_key_running_together_overlap() -> None:
    log = [*run("w1", "k", "a", 1.0, 3.0), *run("w2", "k", "b", 2.0, 4.0), *run("w1", "k", "c", 4.0, 5.0)]
    verdict = check(log, EXPECTED)
    assert not verdict.ok
    [overlap] = verdict.overlaps
    assert (overlap.first.tag, overlap.second.tag, overlap.active) == ("a", "b", 1.0)
    assert "overlap k: a@w1" in verdict.summary()


def test_a_run_starting_the_instant_another_ends_does_not_overlap() -> None:
    log = [*run("w1", "k", "a", 1.0, 2.0), *run("w2", "k", "b", 2.0, 3.0), *run("w1", "k", "c", 3.0, 4.0)]
    assert check(log, EXPECTED).ok


def test_an_instant_run_inside_another_overlaps() -> None:
    log = [*run("w1", "k", "a", 1.0, 3.0), *run("w2", "k", "b", 2.0, 2.0), *run("w1", "k", "c", 3.0, 4.0)]
    assert len(check(log, EXPECTED).overlaps) == 1


# --- open runs and kills -----------------------------------------------------------------------


def test_an_open_run_lasts_to_the_end_of_the_log() -> None:
    log = [rec("start", "w1", 1.0, "k", "a"), *run("w2", "k", "a", 2.0, 3.0), *run("w2", "k", "b", 3.0, 4.0),
           *run("w2", "k", "c", 4.0, 5.0)]
    verdict = check(log, EXPECTED)
    assert verdict.open_runs == 1
    assert [(o.first.tag, o.second.tag) for o in verdict.overlaps] == [("a", "a"), ("a", "b"), ("a", "c")]


def test_a_killed_workers_open_run_ends_at_the_kill() -> None:
    log = [rec("start", "w1", 1.0, "k", "a"), rec("killed", "w1", 1.5),
           *run("w2", "k", "a", 2.0, 3.0), *run("w2", "k", "b", 3.0, 4.0), *run("w2", "k", "c", 4.0, 5.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    [killed] = [r for r in build_runs(log) if r.open]
    assert (killed.w, killed.end) == ("w1", 1.5)


def test_a_run_starting_before_the_kill_still_overlaps() -> None:
    log = [rec("start", "w1", 1.0, "k", "a"), *run("w2", "k", "a", 1.2, 3.0), rec("killed", "w1", 1.5),
           *run("w2", "k", "b", 3.0, 4.0), *run("w2", "k", "c", 4.0, 5.0)]
    [overlap] = check(log, EXPECTED).overlaps
    assert overlap.active == 1.5 - 1.2


def test_other_records_of_a_running_worker_do_not_end_its_open_run() -> None:
    # w1 logs runs of other keys after k's start: k's run is still going (then w1 is killed).
    log = [rec("start", "w1", 1.0, "k", "a"), *run("w1", "j", "x", 1.1, 1.2), *run("w2", "k", "b", 2.0, 2.5),
           rec("killed", "w1", 3.0)]
    [overlap] = check(log, {"k": ["a", "b"], "j": ["x"]}).overlaps
    assert (overlap.first.tag, overlap.second.tag) == ("a", "b")


def test_a_restarted_worker_ends_its_previous_processes_open_runs() -> None:
    # w1 died unseen (no killed record); the new w1 process says ready, then runs a again.
    log = [rec("start", "w1", 1.0, "k", "a"), rec("ready", "w1", 2.0), *run("w1", "k", "a", 2.5, 3.0),
           *run("w1", "k", "b", 3.0, 3.5), *run("w1", "k", "c", 3.5, 4.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    assert [(r.start, r.end, r.open) for r in build_runs(log) if r.tag == "a"] == [(1.0, 2.0, True), (2.5, 3.0, False)]


# --- pauses ------------------------------------------------------------------------------------


def paused_log(resume: float, b_start: float, b_end: float) -> list[dict[str, Any]]:
    """w1 runs a from 1 to 10, paused from 2 to ``resume``; w2 re-runs a in between (the redelivery).

    The zombie's run ends failed (it found its hold lost); w2 then runs b and c.
    """
    return [
        rec("start", "w1", 1.0, "k", "a"), rec("paused", "w1", 2.0), rec("resumed", "w1", resume),
        rec("end", "w1", 10.0, "k", "a", ok=False), *run("w2", "k", "a", b_start, b_end),
        *run("w2", "k", "b", 11.0, 12.0), *run("w2", "k", "c", 12.0, 13.0),
    ]


def test_a_run_handed_over_during_a_pause_is_fenced_not_an_overlap() -> None:
    verdict = check(paused_log(resume=8.0, b_start=5.0, b_end=6.0), EXPECTED)
    assert verdict.ok, verdict.summary()
    [fenced] = verdict.fenced_overlaps
    assert ((fenced.first.w, fenced.second.w), fenced.active) == (("w1", "w2"), 0.0)
    assert not verdict.duplicates


def test_a_zombie_running_on_after_resume_is_fenced_and_its_time_together_measured() -> None:
    verdict = check(paused_log(resume=5.0, b_start=4.0, b_end=7.0), EXPECTED)
    assert verdict.ok and not verdict.overlaps
    assert verdict.fenced_overlaps[0].active == 7.0 - 5.0


def test_a_run_starting_while_the_holder_runs_overlaps_despite_a_later_pause() -> None:
    log = [rec("start", "w1", 1.0, "k", "a"), *run("w2", "k", "b", 1.5, 6.0), rec("paused", "w1", 2.0),
           rec("resumed", "w1", 8.0), rec("end", "w1", 10.0, "k", "a")]
    verdict = check(log, {"k": ["a", "b"]})
    assert [(o.first.tag, o.second.tag, o.active) for o in verdict.overlaps] == [("a", "b", 0.5)]
    assert not verdict.fenced_overlaps


def test_a_handover_sooner_than_handover_after_is_an_overlap() -> None:
    log = paused_log(resume=8.0, b_start=2.5, b_end=6.0)
    assert check(log, EXPECTED).ok
    verdict = check(log, EXPECTED, handover_after=1.0)
    assert len(verdict.overlaps) == 1
    assert check(paused_log(resume=8.0, b_start=3.5, b_end=6.0), EXPECTED, handover_after=1.0).ok


def test_a_pause_shorter_than_handover_after_excuses_nothing() -> None:
    # Paused 2..2.5 only: w1 kept its hold, so b starting at 3 while a runs is an overlap.
    verdict = check(paused_log(resume=2.5, b_start=3.0, b_end=4.0), EXPECTED, handover_after=1.0)
    assert len(verdict.overlaps) == 1


def test_a_pause_never_resumed_lasts_until_the_kill() -> None:
    log = [rec("start", "w1", 1.0, "k", "a"), rec("paused", "w1", 2.0), *run("w2", "k", "a", 3.0, 4.0),
           rec("killed", "w1", 5.0), *run("w2", "k", "b", 5.0, 6.0), *run("w2", "k", "c", 6.0, 7.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    assert verdict.fenced_overlaps[0].active == 0.0


# --- completions -------------------------------------------------------------------------------


def test_completions_out_of_enqueue_order_are_order_violations() -> None:
    log = [*run("w1", "k", "b", 1.0, 2.0), *run("w1", "k", "a", 2.0, 3.0), *run("w1", "k", "c", 3.0, 4.0)]
    verdict = check(log, EXPECTED)
    assert [(v.tag, v.after) for v in verdict.order_violations] == [("a", "b")]
    assert not verdict.ok


def test_only_first_completions_count_for_order() -> None:
    # a re-runs after b (a duplicate, e.g. after a lost ack): the first completions are in order.
    log = [*run("w1", "k", "a", 1.0, 2.0), *run("w1", "k", "b", 2.0, 3.0), *run("w2", "k", "a", 3.0, 4.0),
           *run("w2", "k", "c", 4.0, 5.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    assert verdict.duplicates == {("k", "a"): 2}


def test_a_request_never_completed_is_lost() -> None:
    log = [*run("w1", "k", "a", 1.0, 2.0), rec("start", "w1", 2.0, "k", "b"),
           rec("end", "w1", 2.5, "k", "b", ok=False), *run("w1", "k", "c", 3.0, 4.0)]
    verdict = check(log, EXPECTED)
    assert verdict.lost == (("k", "b"),)
    assert verdict.completed == 2
    assert not verdict.ok
    assert "lost k: b" in verdict.summary()


def test_a_completion_nobody_enqueued_is_unexpected() -> None:
    log = [*clean_log(), *run("w1", "k", "z", 5.0, 6.0)]
    verdict = check(log, {**EXPECTED, "j": ["x"]})
    assert verdict.unexpected == (("k", "z"),)
    assert not verdict.ok


# --- fencing -----------------------------------------------------------------------------------


def stale_verdict(**store: Any) -> Verdict:
    log = [*run("w1", "k", "a", 1.0, 2.0), write("w1", 1.5, "k", "a", [2, 1], True),
           *run("w2", "k", "b", 2.0, 3.0), write("w2", 2.5, "k", "b", [1, 1], True),
           write("w2", 2.6, "k", "b", [1, 1], False), *run("w1", "k", "c", 3.0, 4.0)]
    return check(log, EXPECTED, **store)


def test_an_accepted_write_with_lower_fencing_is_a_stale_violation() -> None:
    verdict = stale_verdict()
    [stale] = verdict.stale_accepted
    assert (stale.fencing, stale.highest, stale.source, stale.w, stale.tag) == ((1, 1), (2, 1), "log", "w2", "b")
    assert (verdict.writes_accepted, verdict.writes_refused) == (2, 1)
    assert not verdict.ok


def test_refused_stale_writes_and_equal_fencing_are_fine() -> None:
    log = [*run("w1", "k", "a", 1.0, 2.0), write("w1", 1.2, "k", "a", [2, 1], True),
           write("w1", 1.4, "k", "a", [2, 1], True), write("w0", 1.6, "k", "a", [1, 3], False),
           *run("w1", "k", "b", 2.0, 3.0), *run("w1", "k", "c", 3.0, 4.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    assert (verdict.writes_accepted, verdict.writes_refused) == (2, 1)


def test_accepted_writes_are_ordered_by_store_sequence_when_logged() -> None:
    # The lower-fenced write was committed first (seq 1) but logged last: not stale.
    log = [write("w2", 1.0, "k", "b", [2, 1], True, seq=2), write("w1", 2.0, "k", "a", [1, 1], True, seq=1)]
    assert not check(log, {}).stale_accepted
    unsequenced = [{k: v for k, v in r.items() if k != "seq"} for r in log]
    assert len(check(unsequenced, {}).stale_accepted) == 1


def test_the_stores_own_history_is_checked_too() -> None:
    verdict = check([], {}, store_history={"k": [[1, 1], [2, 1], [2, 1], [1, 5]], "j": [[1, 1], [3, 1]]})
    assert [(s.key, s.fencing, s.highest, s.source) for s in verdict.stale_accepted] == [("k", (1, 5), (2, 1), "store")]
    assert not verdict.ok


def test_a_write_without_a_known_outcome_is_counted_apart() -> None:
    log = [rec("write", "w1", 1.0, "k", "a", fencing=[1, 1], accepted=None)]
    verdict = check(log, {})
    assert (verdict.writes_accepted, verdict.writes_refused, verdict.writes_unknown) == (0, 0, 1)


def test_read_log_skips_a_half_written_last_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    lines = [json.dumps(r) for r in clean_log()]
    path.write_text("\n".join(lines) + '\n{"kind": "sta')
    assert read_log(path) == clean_log()


def test_a_holder_whose_renewals_a_fault_cut_gives_up_during_its_pause_and_is_fenced() -> None:
    # The server went down while w1 ran a (its renewals failed), then w1 stalled; w2 took the key
    # sooner than handover_after after the stall began, and w1 gave a up on resuming.
    server_down = rec("fault", "soak", 1.5, fault="server-kill-9")
    log = [*paused_log(resume=8.0, b_start=2.5, b_end=6.0), server_down]
    verdict = check(log, EXPECTED, handover_after=1.0)
    assert verdict.ok and len(verdict.fenced_overlaps) == 1, verdict.summary()
    # Without the fault, or with w1 finishing a after it resumed, it is still an overlap.
    assert len(check(paused_log(resume=8.0, b_start=2.5, b_end=6.0), EXPECTED, handover_after=1.0).overlaps) == 1
    finished = [r if r.get("kind") != "end" or r["w"] != "w1" else {**r, "ok": True} for r in log]
    assert len(check(finished, EXPECTED, handover_after=1.0).overlaps) == 1
    # A network fault on another worker's connection excuses nothing.
    elsewhere = [*paused_log(resume=8.0, b_start=2.5, b_end=6.0), rec("fault", "soak", 1.5, fault="net-reset",
                                                                       target="w3")]
    assert len(check(elsewhere, EXPECTED, handover_after=1.0).overlaps) == 1
    # A handler that blocked w1's own loop before the stall cut its renewals too (no watchdog runs
    # in a stopped process): fenced. Another worker's blocked loop excuses nothing.
    blocked = [*paused_log(resume=8.0, b_start=2.5, b_end=6.0), rec("blocked", "w1", 1.2, "k", "a", seconds=3.0)]
    assert check(blocked, EXPECTED, handover_after=1.0).ok
    blocked_elsewhere = [*paused_log(resume=8.0, b_start=2.5, b_end=6.0), rec("blocked", "w3", 1.2, "j", "x")]
    assert len(check(blocked_elsewhere, EXPECTED, handover_after=1.0).overlaps) == 1


# --- liveness: strands -------------------------------------------------------------------------

BOUNDS = LivenessBounds(lease=2.0)
"""strand 2 s, resume 2 s, a lost holder's keys move within ceil(2) + 1 = 3 s."""


def ready(w: str, t: float, concurrency: int = 4) -> dict[str, Any]:
    return rec("ready", w, t, concurrency=concurrency)


def stored(t: float, key: str, tag: str) -> dict[str, Any]:
    return rec("stored", "producer", t, key, tag)


def event(name: str, w: str, t: float, key: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "event", "event": name, "w": w, "t": t, "key": key, **fields}


def fault(t: float, kind: str, target: str | None, fault_id: int) -> dict[str, Any]:
    return rec("fault", "soak", t, fault=kind, target=target, id=fault_id)


def fault_end(t: float, fault_id: int) -> dict[str, Any]:
    return rec("fault_end", "soak", t, id=fault_id)


def session(w: str, key: str, tag: str, acquired: float, start: float, end: float, released: float,
            delivered: int = 1) -> list[dict[str, Any]]:
    return [event("acquired", w, acquired, key, delivered=delivered), *run(w, key, tag, start, end),
            event("released", w, released, key)]


def test_a_request_waiting_with_its_key_and_a_worker_free_is_stranded() -> None:
    log = [ready("w1", 0.0), stored(1.0, "k", "a"), *session("w1", "k", "a", 3.9, 4.0, 4.1, 4.2)]
    verdict = check(log, {"k": ["a"]}, bounds=BOUNDS)
    assert verdict.liveness is not None
    [worst, *_] = verdict.liveness.strands
    assert (worst.key, worst.tag, round(worst.seconds, 6)) == ("k", "a", 2.9)
    assert worst.longest == (1.0, 3.9)
    assert not verdict.ok and verdict.liveness.strands_over == (worst,)
    assert "strand k a: 2.900s" in verdict.summary()
    # Without bounds it is reported, and fails nothing.
    assert check(log, {"k": ["a"]}).ok


def test_time_the_key_was_held_is_no_strand() -> None:
    # w1 holds k from 0.5 to 3.5 (its processor busy); a waits in the key's queue, then starts at 3.6.
    log = [ready("w1", 0.0), event("acquired", "w1", 0.5, "k"), stored(1.0, "k", "a"),
           event("released", "w1", 3.5, "k"), *session("w1", "k", "a", 3.55, 3.6, 3.7, 3.8)]
    verdict = check(log, {"k": ["a"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None and round(verdict.liveness.strand.max, 6) == 0.05


def test_time_with_every_worker_full_paused_or_dead_is_no_strand() -> None:
    full = [ready("w1", 0.0, concurrency=1), event("acquired", "w1", 0.0, "j"), stored(1.0, "k", "a"),
            event("released", "w1", 3.0, "j"), *session("w1", "k", "a", 3.1, 3.2, 3.3, 3.4)]
    dead = [ready("w1", 0.0), rec("exited", "w1", 0.5), stored(1.0, "k", "a"), ready("w1", 3.0),
            *session("w1", "k", "a", 3.1, 3.2, 3.3, 3.4)]
    # (Acquired over a lease after the pause: a token its pull could have swallowed is no excuse.)
    paused = [ready("w1", 0.0), rec("paused", "w1", 0.5), stored(1.0, "k", "a"), rec("resumed", "w1", 3.0),
              *session("w1", "k", "a", 6.1, 6.2, 6.3, 6.4)]
    for log, strand in ((full, 0.1), (dead, 0.1), (paused, 3.1)):
        verdict = check(log, {"k": ["a"]}, bounds=BOUNDS)
        assert verdict.liveness is not None and round(verdict.liveness.strand.max, 6) == strand, verdict.summary()


def test_a_server_fault_disturbs_every_key_while_it_lasts() -> None:
    log = [ready("w1", 0.0), fault(2.0, "server-restart", None, 1), stored(2.1, "k", "a"), fault_end(3.0, 1),
           *session("w1", "k", "a", 3.2, 3.3, 3.4, 3.5)]
    verdict = check(log, {"k": ["a"]}, bounds=BOUNDS)
    assert verdict.liveness is not None and round(verdict.liveness.strand.max, 6) == 0.2


def killed_holder(next_start: float) -> list[dict[str, Any]]:
    """w1 holds k, runs a, and is killed at 2 with b pending; w2 takes k at ``next_start``."""
    return [ready("w1", 0.0), ready("w2", 0.0), event("acquired", "w1", 1.0, "k"), rec("start", "w1", 1.1, "k", "a"),
            stored(1.5, "k", "b"), fault(2.0, "kill-9", "w1", 1), rec("killed", "w1", 2.0), ready("w1", 2.5),
            fault_end(2.5, 1), *session("w2", "k", "a", next_start - 0.1, next_start, next_start + 0.1,
                                        next_start + 0.3, delivered=2),
            *run("w2", "k", "b", next_start + 0.15, next_start + 0.2)]


def test_a_killed_holders_keys_may_wait_for_its_lease_and_no_longer() -> None:
    verdict = check(killed_holder(next_start=5.0), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None
    [handoff] = verdict.liveness.handoffs
    assert (handoff.fault, handoff.key, handoff.seconds, handoff.bound) == ("kill-9", "k", 3.0, 3.0)
    assert str(verdict.liveness.handoffs_by_kind["kill-9"]) == "n 1, p50 3.000s, p99 3.000s, max 3.000s"

    late = check(killed_holder(next_start=6.0), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert late.liveness is not None and not late.ok
    assert [(h.key, h.seconds) for h in late.liveness.late_handoffs] == [("k", 4.0)]
    assert "late hand-off kill-9#1 on w1" in late.summary()


def test_a_killed_holders_keys_wait_no_bound_while_no_worker_can_take_them() -> None:
    # w1 holds k (b pending) and is killed at 2; the only other worker, w2, has one slot and holds j
    # until 5; w1's new process is up at 5.2. Nobody could take k from 2 to 5: that time is added to
    # the kill's bound (3 s): k moving at 5.5 is in time (the strand of b too: it may wait for w1's
    # lease until 5), and at 8.1 is late.
    def log(next_start: float) -> list[dict[str, Any]]:
        return [ready("w1", 0.0), ready("w2", 0.0, concurrency=1), event("acquired", "w2", 0.5, "j"),
                event("acquired", "w1", 1.0, "k"), rec("start", "w1", 1.1, "k", "a"), stored(1.5, "k", "b"),
                fault(2.0, "kill-9", "w1", 1), rec("killed", "w1", 2.0), event("released", "w2", 5.0, "j"),
                ready("w1", 5.2), fault_end(5.2, 1),
                *session("w2", "k", "a", next_start - 0.1, next_start, next_start + 0.1, next_start + 0.3,
                         delivered=2), *run("w2", "k", "b", next_start + 0.15, next_start + 0.2)]

    verdict = check(log(5.5), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None
    [handoff] = verdict.liveness.handoffs
    assert (handoff.key, round(handoff.seconds or 0, 6), round(handoff.bound or 0, 6)) == ("k", 3.5, 6.0)
    late = check(log(8.1), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert late.liveness is not None and not late.ok
    assert [h.key for h in late.liveness.late_handoffs] == ["k"]


def reset_holder(next_start: float, kind: str = "net-reset") -> list[dict[str, Any]]:
    """w1's connection is reset at 2 while it holds k with b pending; b starts at ``next_start``."""
    return [ready("w1", 0.0), event("acquired", "w1", 1.0, "k"), *run("w1", "k", "a", 1.1, 1.2),
            stored(1.5, "k", "b"), fault(2.0, kind, "w1", 1), fault_end(2.0, 1),
            rec("start", "w1", next_start, "k", "b"), rec("end", "w1", next_start + 0.1, "k", "b"),
            event("released", "w1", next_start + 0.2, "k")]


def test_a_holder_that_reconnects_within_its_lease_must_resume_within_the_bound() -> None:
    assert check(reset_holder(3.5), {"k": ["a", "b"]}, bounds=BOUNDS).ok
    late = check(reset_holder(4.5), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert late.liveness is not None and [(h.seconds, h.alone) for h in late.liveness.late_handoffs] == [(2.5, True)]
    assert not late.ok  # alone and late: the protocol missed its bound
    # Another fault before the key moved may own part of the time: still late, but not alone, so
    # reported and not failed.
    # (w2 is up and free meanwhile: the blackhole is no time in which nobody could take k.)
    confounded = check([ready("w2", 0.0), *reset_holder(4.5), fault(3.0, "net-blackhole", "w1", 2),
                        fault_end(3.5, 2)],
                       {"k": ["a", "b"]}, bounds=BOUNDS)
    assert confounded.liveness is not None
    assert [(h.fault, h.alone) for h in confounded.liveness.late_handoffs] == [("net-reset", False)]
    assert "late 1 (0 with no other fault before the key moved)" in confounded.summary()
    assert confounded.ok
    # A slowed link has no bound: its hand-off is only reported.
    slowed = check(reset_holder(9.0, "net-latency"), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert slowed.ok and slowed.liveness is not None and slowed.liveness.handoffs[0].seconds == 7.0


def test_a_holder_that_dies_during_a_server_fault_is_owed_its_lease_from_the_death() -> None:
    # w1 holds k with b pending when the inbox's leader steps down at 2 (over by 2.1); w1's own lease
    # alarm ends it at 2.2 (another fault had slowed it): k moves when w1's lease has ended, after the
    # stepdown's bound (2.1 + 2) but within the kill bound from the death (2.2 + 3).
    def log(next_start: float, died: bool = True) -> list[dict[str, Any]]:
        return [ready("w1", 0.0), ready("w2", 0.0), event("acquired", "w1", 1.0, "k"), *run("w1", "k", "a", 1.1, 1.2),
                stored(1.5, "k", "b"), fault(2.0, "stepdown-inbox", None, 1), fault_end(2.1, 1),
                *([rec("exited", "w1", 2.2)] if died else []),
                *session("w2", "k", "b", next_start - 0.1, next_start, next_start + 0.1, next_start + 0.2)]

    verdict = check(log(5.1), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None
    [handoff] = verdict.liveness.handoffs
    assert (handoff.fault, round(handoff.seconds or 0, 6), round(handoff.bound or 0, 6)) == ("stepdown-inbox", 3.1, 3.2)
    late = check(log(5.5), {"k": ["a", "b"]}, bounds=BOUNDS)  # past the death's bound too
    assert late.liveness is not None and not late.ok
    # A holder that lives must resume within the stepdown's own bound.
    alive = check(log(4.5, died=False), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert alive.liveness is not None and not alive.ok


def test_a_token_swallowed_by_a_stopped_workers_pull_is_no_strand() -> None:
    # w2 is paused from 1 to 4; k's token, published at 1.5, went to w2's pull and came back a lease
    # later (delivered 2), so w1, free all along, took k only at 4.
    def log(delivered: int) -> list[dict[str, Any]]:
        return [ready("w1", 0.0), ready("w2", 0.0), rec("paused", "w2", 1.0), stored(1.5, "k", "a"),
                rec("resumed", "w2", 4.0), *session("w1", "k", "a", 4.0, 4.1, 4.2, 4.3, delivered=delivered)]

    assert check(log(2), {"k": ["a"]}, bounds=BOUNDS).ok
    first_delivery = check(log(1), {"k": ["a"]}, bounds=BOUNDS)  # nobody else had it: stranded
    assert first_delivery.liveness is not None and round(first_delivery.liveness.strand.max, 6) == 2.5


def test_distributions_are_nearest_rank() -> None:
    dist = Distribution.of([float(n) for n in range(1, 101)])
    assert (dist.count, dist.p50, dist.p99, dist.max) == (100, 50.0, 99.0, 100.0)
    assert Distribution.of([]) == Distribution(0, 0.0, 0.0, 0.0)


def test_a_token_that_went_to_a_worker_that_could_not_act_on_it_is_no_strand() -> None:
    # The key's token reached w2 while its link was slowed, then w3, which died before taking the
    # key; a fresh token reached w1 at 5.0. w1 was free all along, yet only the protocol's own time
    # counts: stored 0.8 to the first token. (w1's acquisition at 5.05 is within a lease of w3's
    # death: a record w3's claim wrote just before it died could hold the key that long.)
    log = [ready("w1", 0.0), ready("w2", 0.0), ready("w3", 0.0), fault(0.5, "net-latency", "w2", 1),
           stored(0.8, "k", "a"), event("token", "w2", 1.0, "k", delivered=1), fault_end(6.0, 1),
           event("token", "w3", 3.0, "k", delivered=2), rec("exited", "w3", 3.5),
           event("token", "w1", 5.0, "k", delivered=1), *session("w1", "k", "a", 5.05, 5.1, 5.2, 5.3)]
    verdict = check(log, {"k": ["a"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None and round(verdict.liveness.strand.max, 6) == 0.2
    # Without the tokens' stay with w2 and w3 the same wait is a strand.
    bare = [r for r in log if r.get("event") != "token"]
    assert not check(bare, {"k": ["a"]}, bounds=BOUNDS).ok



def test_a_slowed_workers_claim_holds_the_key_until_its_end_or_three_leases() -> None:
    # w2 receives k's token at 1.0 under a slowed link and logs nothing more about k: its acquire's
    # write, delivered late, may be stored after w1 gives k back (1.5) and hold k for a lease, its
    # sender never told. So b, stored at 1.6, waiting until w1 can take k at 3.7, is no strand.
    def log(claim_end: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [ready("w1", 0.0), ready("w2", 0.0), fault(0.9, "net-bandwidth", "w2", 1), stored(0.95, "k", "a"),
                event("token", "w2", 1.0, "k", delivered=1), *claim_end, event("token", "w1", 1.2, "k", delivered=1),
                *session("w1", "k", "a", 1.25, 1.3, 1.4, 1.5), stored(1.6, "k", "b"), fault_end(2.4, 1),
                event("token", "w1", 1.65, "k", delivered=1), *session("w1", "k", "b", 3.7, 3.75, 3.8, 3.9)]

    verdict = check(log([]), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None and verdict.liveness.strand.max < 0.3
    # A claim that said it gave up (contended) holds nothing after that: b's wait is a strand.
    ended = check(log([event("contended", "w2", 1.1, "k")]), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert ended.liveness is not None and not ended.ok
    assert [(s.tag, round(s.seconds, 6)) for s in ended.liveness.strands_over] == [("b", 2.1)]

# --- liveness: a worker that says nothing ---------------------------------------------------------


def served_by_w2(keys: int, lag: float) -> list[dict[str, Any]]:
    """One request a second on a new key, each taken by w2 ``lag`` seconds after it was stored."""
    log: list[dict[str, Any]] = []
    for i in range(keys):
        t, key = 1.0 + i, f"k{i}"
        log += [stored(t, key, "a"), *session("w2", key, "a", t + lag, t + lag + 0.01, t + lag + 0.02, t + lag + 0.03)]
    return log


def test_a_live_worker_that_takes_nothing_while_keys_wait_fails_the_run() -> None:
    # w1 is up and available from 0 and never heard again; w2 takes every key, each within the
    # strand bound: no request strands, yet w1 sat out 30 x 0.3 s of strand time.
    log = [ready("w1", 0.0), ready("w2", 0.0), *served_by_w2(30, 0.3)]
    expected = {f"k{i}": ["a"] for i in range(30)}
    verdict = check(log, expected, bounds=BOUNDS)
    assert verdict.liveness is not None and not verdict.liveness.strands_over
    [worst, other] = verdict.liveness.silences
    assert (worst.worker, round(worst.seconds, 6), worst.heard, worst.next_heard) == ("w1", 9.0, 0.0, None)
    assert other.worker == "w2" and other.seconds < 0.31
    assert not verdict.ok and verdict.liveness.silences_over == (worst,)
    assert "silent w1 from 0.000 until the end: 9.000s of strand time" in verdict.summary()


def test_a_worker_stopped_cut_off_or_with_nothing_to_take_is_not_silent() -> None:
    expected = {f"k{i}": ["a"] for i in range(30)}
    # Stopped (SIGSTOP) or cut off (a network outage on it) all along: not available, so not silent.
    paused = [ready("w1", 0.0), ready("w2", 0.0), rec("paused", "w1", 0.5), *served_by_w2(30, 0.3)]
    cut = [ready("w1", 0.0), ready("w2", 0.0), fault(0.5, "net-outage", "w1", 1), *served_by_w2(30, 0.3)]
    # Idle while every waiting request's key is held by w2 (a hot key, in order): no strand time.
    hot = [ready("w1", 0.0), ready("w2", 0.0), event("acquired", "w2", 0.5, "k")]
    for i in range(30):
        hot += [stored(1.0 + i, "k", f"r{i}"), *run("w2", "k", f"r{i}", 1.5 + i, 1.6 + i)]
    hot.append(event("released", "w2", 31.0, "k"))
    for log, keys in ((paused, expected), (cut, expected), (hot, {"k": [f"r{i}" for i in range(30)]})):
        verdict = check(log, keys, bounds=BOUNDS)
        assert verdict.liveness is not None
        assert {x.worker: round(x.seconds, 6) for x in verdict.liveness.silences}["w1"] == 0.0, verdict.summary()
        assert verdict.ok, verdict.summary()


# --- handler shapes: a sync body counts until it really ended ----------------------------------


def shaped(w: str, key: str, tag: str, start: float, end: float, shape: str) -> list[dict[str, Any]]:
    return [rec("start", w, start, key, tag, shape=shape), rec("end", w, end, key, tag)]


def body(w: str, key: str, tag: str, enter: float, leave: float | None, pid: int,
         child: bool = False) -> list[dict[str, Any]]:
    records = [rec("enter", w, enter, key, tag, pid=pid, child=child)]
    if leave is not None:
        records.append(rec("leave", w, leave, key, tag, pid=pid, child=child))
    return records


def test_a_thread_that_outlives_its_sessions_end_extends_the_run_into_an_overlap() -> None:
    # The session logged a's end at 2.0 (its lease lost), but the thread ran on until 4.0: b, at 3.0, overlaps.
    log = [*shaped("w1", "k", "a", 1.0, 2.0, "thread"), *body("w1", "k", "a", 1.1, 4.0, pid=10),
           *run("w2", "k", "b", 3.0, 5.0), *run("w2", "k", "c", 5.0, 6.0)]
    verdict = check(log, EXPECTED)
    [overlap] = verdict.overlaps
    assert (overlap.first.tag, overlap.first.end, overlap.second.tag, overlap.active) == ("a", 4.0, "b", 1.0)
    assert verdict.shapes == {"thread": (1, 1), "async": (2, 0)}
    assert "handler shapes: async 2 runs (0 overlaps), thread 1 runs (1 overlaps)" in verdict.summary()


def test_a_thread_body_never_left_ends_when_its_process_died() -> None:
    log = [rec("start", "w1", 1.0, "k", "a", shape="thread"), *body("w1", "k", "a", 1.1, None, pid=10),
           rec("killed", "w1", 2.0), *run("w2", "k", "a", 2.5, 3.0), *run("w2", "k", "b", 3.0, 4.0),
           *run("w2", "k", "c", 4.0, 5.0), rec("ready", "w1", 6.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    [first] = [r for r in build_runs(log) if r.w == "w1"]
    assert (first.end, first.open, first.shape) == (2.0, True, "thread")


def test_a_pool_child_that_outlives_its_dead_worker_counts_until_its_own_leave() -> None:
    # w1 died at 2.0 (exit 75, say); its child ran on as an orphan and logged its leave at 5.0.
    log = [rec("start", "w1", 1.0, "k", "a", shape="process"), *body("w1", "k", "a", 1.1, None, pid=20, child=True),
           rec("exited", "w1", 2.0, code=75), *run("w2", "k", "a", 3.0, 3.5), rec("leave", "w1", 5.0, "k", "a", pid=20),
           *run("w2", "k", "b", 3.5, 4.0), *run("w2", "k", "c", 4.0, 4.5)]
    verdict = check(log, EXPECTED)
    assert not verdict.ok
    assert [(o.first.tag, o.first.end, o.second.tag, o.second.start) for o in verdict.overlaps] == [
        ("a", 5.0, "a", 3.0), ("a", 5.0, "b", 3.5), ("a", 5.0, "c", 4.0)]
    assert verdict.shapes["process"] == (1, 3)


def test_a_pool_child_without_a_leave_ends_with_its_worker() -> None:
    # The parent-death signal killed the child with its worker: nothing of a ran after 2.0.
    log = [rec("start", "w1", 1.0, "k", "a", shape="process"), *body("w1", "k", "a", 1.1, None, pid=20, child=True),
           rec("exited", "w1", 2.0, code=-9), *run("w2", "k", "a", 3.0, 3.5), *run("w2", "k", "b", 3.5, 4.0),
           *run("w2", "k", "c", 4.0, 4.5), rec("ready", "w1", 6.0)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()


def test_a_reaped_child_ends_when_its_worker_reaped_it() -> None:
    # The pool killed and joined the child at 2.5 (its session was cut off): it never logged a leave.
    log = [rec("start", "w1", 1.0, "k", "a", shape="process"), *body("w1", "k", "a", 1.1, None, pid=20, child=True),
           rec("end", "w1", 2.0, "k", "a", ok=False), rec("reaped", "w1", 2.5, "k", "a"),
           *run("w2", "k", "a", 3.0, 3.5), *run("w2", "k", "b", 3.5, 4.0), *run("w2", "k", "c", 4.0, 4.5)]
    verdict = check(log, EXPECTED)
    assert verdict.ok, verdict.summary()
    assert [r.end for r in build_runs(log) if r.w == "w1"] == [2.5]
    # Reaped after the next holder started: an overlap.
    late = [*log[:3], rec("reaped", "w1", 3.2, "k", "a"), *log[4:]]
    assert [o.second.start for o in check(late, EXPECTED).overlaps] == [3.0]


def test_a_sigstop_of_the_worker_excuses_nothing_while_its_child_runs_on() -> None:
    # A pause of w1 long enough to hand k over would fence a (a zombie): not while a's child still ran.
    handed = [rec("start", "w1", 1.0, "k", "a", shape="process"), rec("paused", "w1", 1.5),
              *run("w2", "k", "b", 4.0, 4.5), rec("resumed", "w1", 6.0), rec("end", "w1", 6.1, "k", "a", ok=False),
              *run("w2", "k", "c", 7.0, 8.0)]
    no_child = check(handed, EXPECTED, handover_after=1.0)
    assert not no_child.overlaps and len(no_child.fenced_overlaps) == 1
    child = [*handed, *body("w1", "k", "a", 1.1, 5.0, pid=20, child=True)]
    verdict = check(child, EXPECTED, handover_after=1.0)
    [overlap] = verdict.overlaps
    assert (overlap.second.tag, overlap.active) == ("b", 0.5)
    assert not verdict.fenced_overlaps


# --- bad input -------------------------------------------------------------------------------


def bad(t: float, key: str, tag: str, kind: str) -> dict[str, Any]:
    return rec("bad_input", "producer", t, key, tag, request_id=f"7-{tag}", bad=kind)


def test_bad_requests_dead_lettered_with_a_reason_are_settled_and_never_counted_for_order() -> None:
    log = [*clean_log(), bad(1.2, "k", "k-bad-0", "malformed-body"), bad(1.3, "k", "k-bad-1", "long-inbox"),
           event("dead_lettered", "w1", 2.2, "k", request_id="7-k-bad-0", reason="rejected"),
           # the long inbox's body is good: it ran (after c, out of order: not counted) and was done
           *run("w1", "k", "k-bad-1", 4.1, 4.2), event("succeeded", "w1", 4.3, "k", request_id="7-k-bad-1")]
    verdict = check(log, {**EXPECTED, "j": ["x"]})
    assert verdict.ok, verdict.summary()
    assert [(b.bad, b.settled, b.reason) for b in verdict.bad_inputs] == [
        ("malformed-body", "dead-lettered", "rejected"), ("long-inbox", "done", "")]
    assert not (verdict.unexpected or verdict.order_violations or verdict.lost)
    assert "bad input: 2 (long-inbox 1, malformed-body 1); dead-lettered 1, done 1" in verdict.summary()


def test_a_bad_request_never_dead_lettered_fails_the_run() -> None:
    log = [*clean_log(), bad(1.2, "k", "k-bad-0", "bad-version"), bad(1.3, "k", "k-bad-1", "unknown-type"),
           event("dead_lettered", "w1", 2.2, "k", request_id="7-k-bad-0", reason=""),  # no reason: not settled
           event("succeeded", "w1", 2.3, "k", request_id="7-k-bad-1")]  # run, though it must be refused
    verdict = check(log, {**EXPECTED, "j": ["x"]})
    assert not verdict.ok
    assert [b.tag for b in verdict.unsettled] == ["k-bad-0", "k-bad-1"]
    assert "unsettled bad input k: k-bad-0 (bad-version, request 7-k-bad-0)" in verdict.summary()


def test_a_bad_request_whose_only_trace_is_its_stored_dead_letter_copy_is_settled() -> None:
    # The worker dead-lettered k-bad-0 (its copy is in the DLQ stream, read by the soak after the
    # run) and died before it logged so; k-bad-1 is in neither the log nor the stream.
    log = [*clean_log(), bad(1.2, "k", "k-bad-0", "bad-version"), bad(1.3, "k", "k-bad-1", "unknown-type"),
           event("started", "w1", 2.0, "k", request_id="7-k-bad-0"),
           rec("dlq", "soak", 9.0, "k", request_id="7-k-bad-0", reason="rejected")]
    verdict = check(log, {**EXPECTED, "j": ["x"]})
    assert [(b.tag, b.settled, b.reason) for b in verdict.bad_inputs] == [
        ("k-bad-0", "dead-lettered", "rejected"), ("k-bad-1", "", "")]
    assert [b.tag for b in verdict.unsettled] == ["k-bad-1"]


def test_a_foreign_token_is_settled_once_a_worker_gives_its_key_back_after_it_was_sent() -> None:
    # Tokens stored on subjects that are not UTF-8: a worker reads each key with \\xNN escapes,
    # finds no request and gives it back. One given back only before it was sent is not settled.
    foreign = [rec("bad_input", "producer", 1.0, "\\xff\\xfe0", "foreign-0", request_id="foreign-0",
                   bad="foreign-subject"),
               rec("bad_input", "producer", 2.0, "\\xff\\xfe1", "foreign-1", request_id="foreign-1",
                   bad="foreign-subject")]
    given_back = [event("released", "w1", 1.01, "\\xff\\xfe0"), event("handed-off", "w2", 1.5, "\\xff\\xfe1")]
    verdict = check([*clean_log(), *foreign, *given_back], {**EXPECTED, "j": ["x"]})
    assert [(b.tag, b.settled) for b in verdict.bad_inputs] == [("foreign-0", "given back"), ("foreign-1", "")]
    assert not verdict.ok and "unsettled bad input \\xff\\xfe1: foreign-1" in verdict.summary()
    verdict = check([*clean_log(), *foreign, *given_back, event("released", "w2", 2.2, "\\xff\\xfe1")],
                    {**EXPECTED, "j": ["x"]})
    assert verdict.ok, verdict.summary()


def test_a_foreign_token_found_gone_after_the_run_is_settled_though_its_holder_never_logged_the_end() -> None:
    # w1 takes the key and dies in its give-back, after releasing the token and before it logs
    # "released" (seen in an R3 soak: a GIL-holding run froze it, its lease alarm killed it). The
    # soak finds the token gone from the stream after the run: released, so settled.
    foreign = [rec("bad_input", "producer", 1.0, "\\xff\\xfe0", "foreign-0", request_id="foreign-0",
                   bad="foreign-subject"), event("acquired", "w1", 1.1, "\\xff\\xfe0"), rec("killed", "w1", 1.3)]
    verdict = check([*clean_log(), *foreign], {**EXPECTED, "j": ["x"]})
    assert [b.settled for b in verdict.bad_inputs] == [""] and not verdict.ok
    verdict = check([*clean_log(), *foreign, rec("token_gone", "soak", 9.0, "\\xff\\xfe0")], {**EXPECTED, "j": ["x"]})
    assert [b.settled for b in verdict.bad_inputs] == ["token released"]
    assert verdict.ok, verdict.summary()


def test_a_hand_off_counts_from_the_end_of_a_sync_body_running_at_the_fault() -> None:
    # w1's thread runs a from 1.1 to 5.0 (a slow sync task) when its connection is reset at 2; b can
    # only start once a is done: the hand-off is measured from 5.0, not 2.0.
    def log(next_start: float) -> list[dict[str, Any]]:
        return [ready("w1", 0.0), event("acquired", "w1", 1.0, "k"), rec("start", "w1", 1.1, "k", "a", shape="thread"),
                *body("w1", "k", "a", 1.1, 5.0, pid=10), rec("end", "w1", 5.0, "k", "a"), stored(1.5, "k", "b"),
                fault(2.0, "net-reset", "w1", 1), fault_end(2.0, 1), *run("w1", "k", "b", next_start, next_start + 0.1),
                event("released", "w1", next_start + 0.2, "k")]

    verdict = check(log(5.5), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None and [h.seconds for h in verdict.liveness.handoffs] == [0.5]
    late = check(log(7.5), {"k": ["a", "b"]}, bounds=BOUNDS)
    assert late.liveness is not None and [(h.seconds, h.alone) for h in late.liveness.late_handoffs] == [(2.5, True)]


def test_a_sync_body_that_waited_for_a_free_pool_child_counts_from_its_runs_start() -> None:
    # a starts at 1.1 but its pool child takes it only at 4.0 (every child busy with other keys'
    # slow bodies), and it ends at 4.1: at the fault (2.0) the key was the handler's, waiting for
    # its own resources; b starts at 4.6, 0.5 s after a's body.
    log = [ready("w1", 0.0), event("acquired", "w1", 1.0, "k"), rec("start", "w1", 1.1, "k", "a", shape="process"),
           *body("w1", "k", "a", 4.0, 4.1, pid=11, child=True), rec("end", "w1", 4.1, "k", "a"), stored(1.5, "k", "b"),
           fault(2.0, "stepdown-dlq", None, 1), fault_end(2.2, 1), *run("w1", "k", "b", 4.6, 4.7),
           event("released", "w1", 4.8, "k")]
    verdict = check(log, {"k": ["a", "b"]}, bounds=BOUNDS)
    assert verdict.ok, verdict.summary()
    assert verdict.liveness is not None and [round(h.seconds or 0, 6) for h in verdict.liveness.handoffs] == [0.5]


def test_a_late_hand_off_under_a_server_fault_still_in_effect_is_not_alone() -> None:
    """A node cut off (or any fault of the server) just before a worker's connection was reset keeps
    that worker's lease writes unanswered until it heals: the reset's hand-off is late, but the time
    is the earlier fault's too. A fault then still in effect on another worker does not excuse it."""
    server = check([*reset_holder(4.5), fault(1.8, "server-restart", None, 2), fault_end(4.0, 2)],
                   {"k": ["a", "b"]}, bounds=BOUNDS)
    assert server.liveness is not None
    assert [(h.fault, h.alone) for h in server.liveness.late_handoffs] == [("net-reset", False)]
    assert server.ok
    other_worker = check([ready("w2", 0.0), *reset_holder(4.5), fault(1.8, "net-blackhole", "w2", 2),
                          fault_end(4.0, 2)], {"k": ["a", "b"]}, bounds=BOUNDS)
    assert other_worker.liveness is not None
    assert [(h.fault, h.alone) for h in other_worker.liveness.late_handoffs] == [("net-reset", True)]
    assert not other_worker.ok
    ended = check([*reset_holder(4.5), fault(1.0, "server-restart", None, 2), fault_end(1.5, 2)],
                  {"k": ["a", "b"]}, bounds=BOUNDS)
    assert ended.liveness is not None and not ended.ok  # over before the reset: no excuse
