"""The operator's view (the dashboard) without a server: a key's runs from its events, what blocks a key, the
health verdicts, the request filter and the search index's pruning, history minutes, key conditions."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest

from keyqueue.admin.diagnosis import HeadRequest, KeyDiagnosis, RateWindow, blockers
from keyqueue.admin.inspection import Holder, KeyState, QueueReport
from keyqueue.admin.key_history import StoredEvent, runs_of
from keyqueue.admin.workers import WorkerState
from keyqueue.app.heartbeat import WorkerRecord
from keyqueue.dashboard.health import judge, overall
from keyqueue.dashboard.history import Minute
from keyqueue.dashboard.latency import bin_of
from keyqueue.dashboard.search import IndexEntry, RequestFilter, SearchIndex, _Stream

NOW = 1_800_000_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(NOW + seconds, UTC)


def ev(seq: int, event: str, **fields: Any) -> StoredEvent:
    return StoredEvent(seq, NOW + seq, event, **fields)


def worker(name: str, *, live: bool = True, slots: int = 4) -> WorkerState:
    record = WorkerRecord(name=name, host="h", pid=7, version="1", queues=["shop"], slots=slots, used=0,
                          started=NOW - 100, heartbeat=NOW, interval=5.0)
    return WorkerState(record, NOW, live)


# --- runs_of -----------------------------------------------------------------------------------------


def test_runs_name_holder_fence_outcome_and_duration_newest_first() -> None:
    events = [
        ev(1, "acquired", worker="w1", fence=40),
        ev(2, "started", request_id="r1", task="pay", worker="w1", attempt=1),
        ev(3, "retried", request_id="r1", task="pay", worker="w1", attempt=1, reason="boom", delay=0.5),
        ev(4, "started", request_id="r1", task="pay", worker="w1", attempt=2),
        ev(5, "succeeded", request_id="r1", task="pay", worker="w1", run=0.25),
        ev(6, "cancelled", request_id="r2", task="pay", worker="w1", reason="cancelled before it started"),
        ev(7, "released", worker="w1", reason="released"),
        ev(8, "acquired", worker="w2", fence=55),
        ev(9, "started", request_id="r3", task="pay", worker="w2", attempt=1),
    ]
    runs = runs_of(events)
    assert [(r.request_id, r.attempt, r.worker, r.fence, r.outcome) for r in runs] == [
        ("r3", 1, "w2", 55, "running"), ("r2", None, "w1", 40, "cancelled"), ("r1", 2, "w1", 40, "succeeded"),
        ("r1", 1, "w1", 40, "retried")]
    assert runs[2].duration == 0.25 and runs[3].duration == 1.0 and runs[3].reason == "boom"


def test_a_cancelled_request_is_one_row_whatever_events_its_holder_published() -> None:
    events = [
        ev(1, "acquired", worker="w1", fence=3),
        ev(2, "started", request_id="r1", task="t", worker="w1", attempt=1),
        ev(3, "superseded", request_id="r1", task="t", worker="w1", reason="superseded by (cancelled)"),
        ev(4, "cancelled", request_id="r1", task="t", worker="w1", reason="cancelled before it started"),
        ev(5, "released", worker="w1", reason="released"),
    ]
    [run] = runs_of(events)
    assert (run.request_id, run.outcome, run.fence, run.reason) == ("r1", "cancelled", 3, "cancelled before it started")


def test_an_attempt_cut_off_by_a_new_holding_is_interrupted_and_a_dead_letter_matches_its_last_attempt() -> None:
    events = [
        ev(1, "acquired", worker="w1", fence=3),
        ev(2, "started", request_id="r1", task="t", worker="w1", attempt=1),
        ev(3, "acquired", worker="w1", fence=9),  # the same worker holds the key again: the first run ended
        ev(4, "started", request_id="r1", task="t", worker="w1", attempt=2),
        ev(5, "dead_lettered", request_id="r1", task="t", worker="w1", attempt=5, reason="crash-loop"),
    ]
    runs = runs_of(events)
    assert [(r.attempt, r.fence, r.outcome) for r in runs] == [(2, 9, "dead_lettered"), (1, 3, "interrupted")]


# --- blockers ----------------------------------------------------------------------------------------


def diagnosis(**fields: Any) -> KeyDiagnosis:
    base: dict[str, Any] = dict(queue="shop", key="k", backlog=1, token="held", token_seq=5, holder=None,
                                holder_worker=None, head=None, position=None, waiting_tokens=0,
                                live_workers=[worker("w1")], ack_wait=30.0, checked=NOW)
    base.update(fields)
    return KeyDiagnosis(**base)


HOLDER = Holder("w1", at(-60), at(-2), 40, ttl=30, token_seq=5)
HEAD = HeadRequest(9, "r1", "pay", {"a": 1}, NOW - 70)


@pytest.mark.parametrize(("fields", "kinds", "text"), [
    ({"holder": HOLDER, "holder_worker": worker("w1"),
      "head": HeadRequest(9, "r1", "pay", {}, NOW - 70, 1, NOW - 5)}, ["running"], "running request r1 (pay)"),
    ({"holder": HOLDER, "holder_worker": worker("w1"),
      "head": HeadRequest(9, "r1", "pay", {}, NOW - 70, 2, None, "boom", NOW + 3)}, ["retry-backoff"],
     "attempt 2 of request r1 failed (boom): next attempt at"),
    ({"holder": HOLDER, "holder_worker": worker("w1"), "head": HeadRequest(9, "r1", "pay", {}, NOW - 70, 1, NOW - 1),
      "rate": RateWindow("pay", [NOW - 20], 60.0)}, ["rate-limit"], "1 run(s) in the last 60s"),
    ({"holder": HOLDER, "holder_worker": worker("w1", live=False), "head": HEAD}, ["gone-holder"],
     "which is gone (silent"),
    ({"holder": HOLDER, "holder_worker": worker("w1", live=False), "head": HEAD, "live_workers": []},
     ["no-worker", "gone-holder"], "no worker serves queue shop"),
    ({}, ["changing-hands"], "no lease record names a holder"),
    ({"token": "scheduled", "position": 3, "waiting_tokens": 8}, ["waiting-for-slot"], "position 3 of 8"),
    ({"token": "scheduled", "backlog": 0}, ["empty-token"], "finds nothing"),
    ({"token": "none", "backlog": 2}, ["no-token"], "the reconciler gives the key one"),
    ({"token": "none", "backlog": 0}, [], ""),
])
def test_what_blocks_a_key(fields: dict[str, Any], kinds: list[str], text: str) -> None:
    found = blockers(diagnosis(**fields))
    assert [b.kind for b in found] == kinds
    assert text in " ".join(b.text for b in found)


def test_a_rate_limited_run_has_taken_its_slot_once_its_start_is_in_the_window() -> None:
    head = HeadRequest(9, "r1", "pay", {}, NOW - 70, 1, NOW - 1)
    taken = diagnosis(holder=HOLDER, holder_worker=worker("w1"), head=head, rate=RateWindow("pay", [NOW - 0.5], 60.0))
    assert [b.kind for b in blockers(taken)] == ["running"]


def test_a_lapsed_lease_of_a_worker_outside_the_registry_is_a_gone_holder() -> None:
    old = Holder("w9", at(-200), at(-100), 7, ttl=30)
    assert [b.kind for b in blockers(diagnosis(holder=old, head=HEAD))] == ["gone-holder"]


# --- health ------------------------------------------------------------------------------------------


def report(**fields: Any) -> QueueReport:
    base: dict[str, Any] = dict(queue="shop", keys=[], requests=0, keys_with_backlog=0, keys_held=0,
                                pending_tokens=0, dlq_size=0, consumer={}, workers={})
    base.update(fields)
    return QueueReport(**base)


def test_health_verdicts() -> None:
    ok = judge(report(requests=3, oldest_request=at(-10)), [worker("w1")], now=NOW, max_wait=300,
               backlog_then=3, dlq_then=0)
    assert (ok.status, ok.reasons) == ("ok", [])
    orphan = judge(report(requests=5), [worker("w1", live=False)], now=NOW, max_wait=300, backlog_then=2,
                   dlq_then=None)
    assert orphan.status == "fail" and orphan.reasons == [
        "5 request(s) stored, +3 in the last 60s and no live worker serves the queue"]
    late = judge(report(requests=1, oldest_request=at(-900)), [worker("w1")], now=NOW, max_wait=300,
                 backlog_then=None, dlq_then=None)
    assert late.status == "fail" and "waited 900s (bound 300s)" in late.reasons[0]
    held = [KeyState("k1", 1, "held", Holder("gone", at(-20), at(-10), 4, ttl=30))]
    dlq = judge(report(requests=1, dlq_size=4, keys=held), [worker("w1"), worker("gone", live=False)], now=NOW,
                max_wait=300, backlog_then=None, dlq_then=1)
    assert dlq.status == "warn" and dlq.reasons == ["1 key(s) held by a gone worker until its lease ends (k1)",
                                                    "the DLQ grew by 3 in the last 5 min (4 now)"]
    stale = [KeyState("k1", 1, "held", Holder("gone", at(-200), at(-100), 4, ttl=30))]
    assert judge(report(keys=stale), [worker("w1"), worker("gone", live=False)], now=NOW, max_wait=300,
                 backlog_then=None, dlq_then=None).status == "fail"
    assert overall([ok, dlq]) == "warn" and overall([ok, dlq, orphan]) == "fail" and overall([]) == "ok"


def test_health_counts_unkeyed_requests_in_the_backlog_and_their_wait() -> None:
    """A queue whose only work is unkeyed tasks is judged like one with keyed requests."""
    orphan = judge(report(unkeyed=4), [worker("w1", live=False)], now=NOW, max_wait=300, backlog_then=1,
                   dlq_then=None)
    assert orphan.status == "fail" and orphan.reasons == [
        "4 request(s) stored, +3 in the last 60s and no live worker serves the queue"]
    assert (orphan.figures["backlog"], orphan.figures["unkeyed"]) == (4, 4)
    late = judge(report(requests=1, oldest_request=at(-10), unkeyed=1, oldest_unkeyed=at(-900)), [worker("w1")],
                 now=NOW, max_wait=300, backlog_then=None, dlq_then=None)
    assert late.status == "fail" and "waited 900s (bound 300s)" in late.reasons[0]


# --- the request filter and the search index ---------------------------------------------------------


def entry(seq: int, key: str, **fields: Any) -> IndexEntry:
    base: dict[str, Any] = dict(where="pending", seq=seq, key=key, request_id=f"id-{seq}", task="touch",
                                arguments='{"n": 1}', stored=None)
    base.update(fields)
    return IndexEntry(**base)


def test_the_filter_matches_id_key_pattern_task_text_and_error() -> None:
    dead = entry(7, "order-17", where="dead", task="pay", arguments='{"amount": 4242}', error="ValueError: declined")
    assert RequestFilter(text="4242").matches(dead) and RequestFilter(text="ID-7").matches(dead)
    assert RequestFilter(key="order-1*").matches(dead) and not RequestFilter(key="order-2*").matches(dead)
    assert RequestFilter(task="pay", error="declined").matches(dead) and not RequestFilter(task="pa").matches(dead)
    assert not RequestFilter(where="pending").matches(dead)
    assert RequestFilter.from_query({"q": " x ", "in": "nonsense"}) == RequestFilter(text="x")
    assert RequestFilter(text="a b", key="k*", where="dead").query() == {"q": "a b", "key": "k*", "in": "dead"}


def test_the_index_drops_what_left_a_key_from_its_front_and_never_what_is_still_stored() -> None:
    index = SearchIndex(None)  # type: ignore[arg-type]  # trim and search never reach the server
    stream = index.pending["shop"] = _Stream()
    for seq, key in ((1, "a"), (2, "a"), (3, "b"), (4, "a"), (5, "c"), (6, "a")):
        stream.add(entry(seq, key))
    stream.read_through = stream.last_seq = 6
    # The inbox's last sequence was 5 just before the backlogs were read: key a then had 2 requests
    # stored, b none, c one. Sequence 6 came later and may or may not be one of a's two: so of a's
    # entries up to 5 (1, 2, 4) the oldest beyond two goes, and 6 stays whatever the counts say.
    keys = [KeyState("a", 2, "held"), KeyState("c", 1, "scheduled")]
    dropped = index.trim(QueueReport("shop", keys, 3, 2, 1, 1, 0, {}, {}, keys_total=2, inbox_last_seq=5))
    assert dropped == 2 and sorted(stream.entries) == [2, 4, 5, 6]
    found = index.search("shop", RequestFilter(key="a"), page=2, size=2)
    assert (found.total, found.pages, [e.seq for e in found.entries]) == (3, 2, [6])
    assert found.complete


def test_a_truncated_snapshot_prunes_nothing() -> None:
    index = SearchIndex(None)  # type: ignore[arg-type]
    index.pending["shop"] = _Stream()
    index.pending["shop"].add(entry(1, "a"))
    truncated = QueueReport("shop", [], 1, 1, 0, 0, 0, {}, {}, keys_total=5, inbox_last_seq=9)
    assert index.trim(truncated) == 0


# --- history minutes ---------------------------------------------------------------------------------


def test_a_minute_counts_events_and_bins_waits_and_runs_and_survives_its_encoding() -> None:
    minute = Minute(30_000_000)
    minute.add("started", {"wait": 0.5})
    minute.add("succeeded", {"run": 0.01})
    minute.add("dead_lettered", {"run": float("nan")})
    minute.add("retried", {})
    again = Minute.decode(minute.encode())
    assert again is not None and again.minute == minute.minute
    assert again.counts == Counter({"started": 1, "succeeded": 1, "dead_lettered": 1, "retried": 1})
    assert again.waits == Counter({bin_of(0.5): 1}) and again.runs == Counter({bin_of(0.01): 1})
    assert Minute.decode(b"not json") is None


# --- key conditions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "condition"), [
    (KeyState("k", 1, "held", HOLDER), "held"), (KeyState("k", 1, "held"), "changing-hands"),
    (KeyState("k", 2, "scheduled"), "waiting"), (KeyState("k", 0, "scheduled"), "empty-token"),
    (KeyState("k", 3, "none"), "no-token")])
def test_what_a_keys_token_backlog_and_record_say_together(state: KeyState, condition: str) -> None:
    assert state.condition == condition


def test_a_retry_in_the_same_event_batch_as_its_start_is_a_backoff_not_a_run() -> None:
    """A key's events travel in batches (several events in one message): the head's ``started`` and
    ``retried`` can share one stream sequence, and their place in the batch says which came last."""
    from keyqueue.admin.diagnosis import _head
    from keyqueue.jetstream.api import StoredMsg

    head = StoredMsg("kq.shop.inbox.o1", 9, {"Nats-Msg-Id": "r1", "X-MESSAGE-TYPE": "pay"}, b"",
                     "2027-01-15T08:00:00Z")
    started = StoredEvent(12, NOW, "started", request_id="r1", attempt=1, index=0)
    retried = StoredEvent(12, NOW + 1, "retried", request_id="r1", attempt=1, reason="boom", delay=5.0, index=1)
    backing_off = _head(head, {"started": started, "retried": retried})
    assert (backing_off.next_retry, backing_off.running_since, backing_off.last_error) == (NOW + 6, None, "boom")
    restarted = StoredEvent(12, NOW + 6, "started", request_id="r1", attempt=2, index=2)
    running = _head(head, {"started": restarted, "retried": retried})
    assert (running.next_retry, running.running_since, running.attempts) == (None, NOW + 6, 2)
