"""The Rebaser's pure logic: functions, updates, DVU computation, state transitions, the DVU task."""

from __future__ import annotations

import asyncio
import itertools
import random

import cbor2
import pytest

from keyqueue.errors import LeaseLost
from keyqueue.wire import decode, encode, to_fields
from keyqueue_rebaser import hookimpl
from keyqueue_rebaser.dvu import SerialDvuTask
from keyqueue_rebaser.errors import DvuFailed, UnreadableSnapshot
from keyqueue_rebaser.functions import BUILTINS, FunctionRegistry, load_functions
from keyqueue_rebaser.graph import Node, UpdateError, apply_updates, full_recompute, recompute
from keyqueue_rebaser.messages import (
    REGISTRY,
    EnqueueUpdatesRequestV1,
    EnqueueUpdatesRequestV3,
    Update,
)
from keyqueue_rebaser.state import ChangeSetState, decode_state, encode_state
from keyqueue_rebaser.workload import ChangeSetModel, compare, setup_updates

FUNCTIONS = FunctionRegistry(BUILTINS)


def build(*updates: Update) -> dict[str, Node]:
    nodes, _ = apply_updates({}, list(updates), 1, FUNCTIONS)
    return nodes


# --- functions -----------------------------------------------------------------------------------


def test_builtin_functions() -> None:
    assert BUILTINS["identity"]([7], {}) == 7
    assert BUILTINS["sum"]([1, 2, 3.5], {}) == 6.5
    assert BUILTINS["concat"](["a", 1, "b"], {"sep": "-"}) == "a-1-b"
    assert BUILTINS["min"]([3, -1], {}) == -1 and BUILTINS["max"]([3, -1], {}) == 3
    assert BUILTINS["template"](["x", 2], {"text": "{1}:{0}:{0.__class__}"}) == "2:x:{0.__class__}"
    for name, inputs in (("sum", ["a"]), ("max", []), ("identity", [1, 2]), ("concat", [None]), ("min", [True])):
        with pytest.raises(Exception):  # noqa: B017 - any exception is how a function reports failure
            BUILTINS[name](inputs, {})


def test_functions_come_from_the_hook() -> None:
    class Doubling:
        @hookimpl
        def rebaser_register_functions(self, functions: FunctionRegistry) -> None:
            functions.register("double", lambda inputs, args: 2 * inputs[0])

    registry = load_functions([Doubling()], autoload=False)
    assert "double" in registry and "sum" in registry
    nodes = build(Update.add_node("a", 21), Update.add_node("b"))
    nodes, _ = apply_updates(nodes, [Update.add_dependency("b", "double", ["a"])], 2, registry)
    assert full_recompute(nodes, registry)["b"].value == 42


# --- updates -------------------------------------------------------------------------------------


def test_updates_apply_all_or_nothing_with_clear_reasons() -> None:
    nodes = build(Update.add_node("a", 1), Update.add_node("b", 2), Update.add_node("c"),
                  Update.add_dependency("c", "sum", ["a", "b"]))
    cases = [
        ([Update.set_value("a", 5), Update.set_value("zz", 1)], r"update 1 \(set_value zz=1\): no such node"),
        ([Update.set_value("c", 1)], "computed by sum"),
        ([Update.add_dependency("a", "identity", ["c"])], "cycle: a -> c -> a"),
        ([Update.add_dependency("a", "nope", ["b"])], "unknown function 'nope'"),
        ([Update.remove_node("a")], "nodes c depend on it"),
        ([Update.add_node("a")], "already exists"),
        ([Update.remove_dependency("a")], "has no dependency"),
        ([Update.add_node("n"), Update.remove_node("n"), Update.remove_node("n")], "update 2 .*no such node"),
    ]
    for updates, reason in cases:
        with pytest.raises(UpdateError, match=reason):
            apply_updates(nodes, updates, 2, FUNCTIONS)
    assert nodes["a"].value == 1, "a refused request changed the graph"
    changed, roots = apply_updates(nodes, [Update.set_value("a", 5), Update.remove_dependency("c", 7)], 2, FUNCTIONS)
    assert roots == {"a", "c"} and changed["a"].stamp == 2
    # The value of a node made plain is the update's, never what some DVU last computed.
    assert not changed["c"].computed and changed["c"].value == 7


def test_dvu_recomputes_downstream_in_topological_order_and_reports_failures() -> None:
    nodes = build(Update.add_node("a", 1), Update.add_node("b", 2), Update.add_node("s"),
                  Update.add_dependency("s", "sum", ["a", "b"]), Update.add_node("t"),
                  Update.add_dependency("t", "template", ["s"], {"text": "s={0}"}), Update.add_node("u"),
                  Update.add_dependency("u", "identity", ["b"]))
    result = recompute(nodes, ["a"], FUNCTIONS)
    assert list(result.values) == ["s", "t"] and result.values["t"] == ("s=3", None)
    nodes, _ = apply_updates(nodes, [Update.set_value("a", "oops")], 2, FUNCTIONS)
    result = recompute(nodes, ["a"], FUNCTIONS)
    assert result.values["s"][0] is None and "TypeError" in (result.values["s"][1] or "")
    assert result.values["t"] == ("s=None", None), "downstream nodes see the failed node as None"
    assert len(result.errors) == 1


def test_a_stored_cycle_is_reported_not_looped_on() -> None:
    # Updates refuse cycles; a snapshot written by something else might still hold one.
    nodes = {"a": Node(1, "identity", ["b"]), "b": Node(2, "identity", ["a"]), "c": Node(3)}
    result = recompute(nodes, ["a", "c"], FUNCTIONS)
    assert result.values == {} and result.errors == ["cycle: a, b depend on each other and were not recomputed"]


# --- state ---------------------------------------------------------------------------------------


def request(*updates: Update, event_session: str | None = None) -> EnqueueUpdatesRequestV3:
    return EnqueueUpdatesRequestV3("w", "cs", list(updates), None, event_session)


@pytest.mark.parametrize("seed", range(40))
def test_dvu_beside_requests_ends_equal_to_sequential_application(seed: int) -> None:
    """DVUs computed from snapshots while requests keep landing end with the values of a full recompute."""
    rng = random.Random(seed)
    model = ChangeSetModel(FUNCTIONS)
    state = ChangeSetState()
    in_flight = None  # (plan, result) of a DVU computed but not yet committed
    for seq in range(1, 121):
        updates = setup_updates() if seq == 1 else model.random_request(rng)
        model.apply(updates)
        new, response = state.apply(request(*updates), seq=seq, request_id=str(seq), functions=FUNCTIONS,
                                    fencing=(1, 1))
        assert (new is not None) == response.ok
        state = new or state
        if in_flight is None and state.dvu_owed and rng.random() < 0.4:
            plan = state.plan_dvu()
            in_flight = (plan, recompute(plan.nodes, plan.roots, FUNCTIONS))
        elif in_flight is not None and rng.random() < 0.3:
            state, _, _ = state.commit_dvu(*in_flight, started=0, finished=0, fencing=(1, 1), worker="t")
            in_flight = None
    if in_flight is not None:
        state, _, _ = state.commit_dvu(*in_flight, started=0, finished=0, fencing=(1, 1), worker="t")
    runs = 0
    while state.dvu_owed:
        plan = state.plan_dvu()
        state, _, _ = state.commit_dvu(plan, recompute(plan.nodes, plan.roots, FUNCTIONS), started=0, finished=0,
                                       fencing=(1, 1), worker="t")
        runs += 1
    assert runs <= 1, "with nothing landing meanwhile, one run settles every pending root"
    assert compare(state.nodes, model.expected()) == []
    assert state.change == model.applied and 0 < state.triggers <= model.applied


def test_replayed_request_is_not_applied_twice_and_gets_its_response() -> None:
    state = ChangeSetState()
    first, response = state.apply(request(Update.add_node("a", 1)), seq=5, request_id="r5", functions=FUNCTIONS,
                                  fencing=(3, 1))
    assert first is not None and response.change == 1
    again, replay = first.apply(request(Update.add_node("a", 1)), seq=5, request_id="r5", functions=FUNCTIONS,
                                fencing=(4, 1))
    assert again is None and replay == response, "a re-run after a crash must not apply the request again"


def test_waiters_and_event_sessions_follow_the_run_that_covers_them() -> None:
    state = ChangeSetState()
    state, _ = state.apply(request(Update.add_node("a", 1), event_session="es1"), seq=1, request_id="r1",
                           functions=FUNCTIONS, fencing=(1, 1), await_dvu_inbox="_INBOX.x.1")
    plan = state.plan_dvu()
    state2, _ = state.apply(request(Update.set_value("a", 2)), seq=2, request_id="r2", functions=FUNCTIONS,
                            fencing=(1, 1), await_dvu_inbox="_INBOX.x.2")
    assert state2 is not None
    done, run, served = state2.commit_dvu(plan, recompute(plan.nodes, plan.roots, FUNCTIONS), started=1, finished=2,
                                          fencing=(1, 1), worker="t")
    assert [w.request_id for w in served] == ["r1"] and [w.request_id for w in done.waiters] == ["r2"]
    assert run.run == 1 and run.covered == 1 and run.event_sessions == ["es1"] and done.dvu_owed
    assert done.run_covering(1) == run and done.run_covering(2) is None


def test_state_round_trips_and_unknown_formats_are_refused() -> None:
    state = ChangeSetState()
    state, _ = state.apply(request(*setup_updates()), seq=1, request_id="r1", functions=FUNCTIONS, fencing=(9, 2))
    assert state is not None
    assert decode_state(encode_state(state)) == state
    assert cbor2.loads(encode_state(state)) == to_fields(state), "the fast codec must lay out what to_fields does"
    with pytest.raises(UnreadableSnapshot, match="format 2"):
        from keyqueue.wire import CBOR, dumps

        decode_state(dumps({"format": 2}, CBOR))


def test_older_request_versions_upgrade() -> None:
    v1 = encode(EnqueueUpdatesRequestV1("w", "cs", [Update.set_value("a", 1)]))
    upgraded = decode(v1.headers, v1.body, REGISTRY)
    assert upgraded == EnqueueUpdatesRequestV3("w", "cs", [Update.set_value("a", 1)], None, None)


# --- the serial DVU task -------------------------------------------------------------------------


async def test_signals_during_a_run_collapse_into_exactly_one_more_run() -> None:
    owed = {"roots": 1}
    started: list[int] = []
    running, release = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        started.append(owed["roots"])
        running.set()
        taken = owed["roots"]
        if len(started) == 1:
            await release.wait()
        owed["roots"] -= taken

    task = SerialDvuTask("k", owed=lambda: owed["roots"] > 0, run=run, lease_valid=lambda: True)
    task.start()
    task.signal()
    await running.wait()
    for _ in range(200):  # 200 triggers while the first run is busy
        owed["roots"] += 1
        task.signal()
    release.set()
    await task.wait_idle()
    assert started == [1, 200], "200 triggers during one run must give exactly one more run"
    task.signal()  # nothing owed: a signal alone does not start a run
    await task.wait_idle()
    assert task.runs == 2
    await task.stop()


async def test_a_failing_dvu_is_retried_with_backoff_then_given_up() -> None:
    attempts: list[float] = []

    async def run() -> None:
        attempts.append(asyncio.get_running_loop().time())
        raise RuntimeError("store unavailable")

    task = SerialDvuTask("k", owed=lambda: True, run=run, lease_valid=lambda: True, max_failures=4, base_delay=0.02)
    task.start()
    with pytest.raises(DvuFailed, match="failed 4 times"):
        await task.wait_idle()
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(attempts) == 4 and gaps[0] < gaps[-1], f"no growing backoff: {gaps}"


async def test_a_lost_lease_stops_the_dvu_task() -> None:
    lease = {"valid": True}

    async def run() -> None:
        raise AssertionError("must not run without the lease")

    task = SerialDvuTask("k", owed=lambda: False, run=run, lease_valid=lambda: lease["valid"], lease_poll=0.01)
    task.start()
    await task.wait_idle()
    lease["valid"] = False
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task.wait_idle(), 2)
