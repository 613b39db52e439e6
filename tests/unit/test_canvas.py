"""Compiling a canvas (chain, group, chord, links, errbacks) into a workflow's plan: pure logic, no server."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import keyqueue
from keyqueue import chain, chord, group
from keyqueue.tasks.canvas import (
    WorkflowPlan,
    decode_shape,
    is_workflow_id,
    parse_step_request_id,
    step_request_id,
    validate_workflow_id,
)

app = keyqueue.App("units", set_as_default=False, autoload_plugins=False)


@app.task(key="n{x}")
async def add(x: int, y: int) -> int:
    return x + y


@app.task(key="s")
async def xsum(numbers: list[int]) -> int:
    return sum(numbers)


@dataclass(frozen=True)
class Point:
    x: int
    y: int


@app.task(key="p{point.x}")
async def move(point: Point, by: int) -> Point:
    return Point(point.x + by, point.y)


def targets(plan: WorkflowPlan) -> list[list[tuple[object, ...]]]:
    return [step.then for step in plan.steps]


def test_a_chain_hands_each_result_to_the_next_step_and_the_last_to_the_end() -> None:
    plan = chain(add.s(4, 4), add.s(8), add.s(10)).plan(workflow_id="wf-c")
    assert plan.entries == [0]
    assert targets(plan) == [[("step", 1)], [("step", 2)], [("end",)]]
    assert [s.args for s in plan.steps] == [[4, 4], [8], [10]]
    assert plan.shape == ["step", 2] and plan.queue == "units"


def test_chains_made_with_the_pipe_flatten() -> None:
    piped = chain(add.s(4, 4) | add.s(8)).plan(workflow_id="wf-p")
    assert targets(piped) == [[("step", 1)], [("end",)]]


def test_a_group_joins_its_parts_and_a_chord_hands_the_list_to_its_body() -> None:
    plan = chord([add.s(1, 1), add.s(2, 2) | add.s(3)], xsum.s()).plan(workflow_id="wf-ch")
    assert plan.entries == [0, 1]
    assert targets(plan) == [[("join", 0, 0)], [("step", 2)], [("join", 0, 1)], [("end",)]]
    assert [(j.size, j.then) for j in plan.joins] == [(2, [("step", 3)])]
    assert plan.shape == ["step", 3]
    assert group(add.s(1, 1), add.s(2, 2)).plan().shape == ["list", [["step", 0], ["step", 1]]]
    # group | task is a chord; a group after a step gets the step's result in every part.
    upgraded = (group(add.s(1, 1), add.s(2, 2)) | xsum.s()).plan(workflow_id="wf-u")
    assert upgraded.joins[0].then == [("step", 2)]
    fan = (add.s(1, 1) | group(add.s(1), add.s(2))).plan(workflow_id="wf-f")
    assert fan.steps[0].then == [("step", 1), ("step", 2)] and fan.joins[0].then == [("end",)]


def test_links_and_errbacks_come_after_the_flow() -> None:
    flow = (add.s(1, 1) | add.s(2)).link_error(add.si(0, 0))
    plan = add.s(5, 5).link(xsum.s()).plan(workflow_id="wf-l")
    assert plan.steps[0].then == [("end",), ("step", 1)] and plan.steps[1].role == "link"
    assert plan.steps[1].then == []  # a link's result is not the workflow's
    with_errbacks = flow.plan(workflow_id="wf-e")
    assert [s.role for s in with_errbacks.steps] == ["step", "step", "errback", "errback"]
    assert [s.errors for s in with_errbacks.steps[:2]] == [[2], [3]]  # one errback copy per step


def test_sources_say_what_delivers_to_each_step_and_slot() -> None:
    plan = chord([add.s(1, 1), add.s(2, 2)], xsum.s()).link_error(add.si(0, 0)).plan(workflow_id="wf-s")
    sources = plan.sources()
    assert sources[("step", 0)] == sources[("step", 1)] == ("start",)
    assert sources[("join", 0, 1)] == ("step", 1)
    assert sources[("step", 2)] == ("join", 0)
    assert sources[("step", 3)] == ("error", 0)


def test_the_plan_survives_its_record() -> None:
    plan = chord([add.s(1, 1), move.s(Point(1, 2), 3)], xsum.s()).plan(workflow_id="wf-r")
    again = WorkflowPlan.from_record(plan.to_record())
    assert again == plan
    assert plan.steps[1].args == [{"x": 1, "y": 2}, 3]  # a dataclass argument stored as its fields
    with pytest.raises(keyqueue.ConfigError, match="version"):
        WorkflowPlan.from_record({**plan.to_record(), "v": 99})


def test_arguments_are_checked_before_anything_is_stored() -> None:
    assert (add.s(4) | add.s(8)).plan(args=(16,)).steps[0].args == [16, 4]  # Celery's partial
    assert add.si(1, 2).plan(args=(99,)).steps[0].args == [1, 2]  # immutable: takes nothing
    with pytest.raises(TypeError, match=r"add\(\)"):
        (add.s(4) | add.s(8)).plan()
    with pytest.raises(TypeError, match=r"workflow step 1: add\(\) \(its first parameter takes the result"):
        (add.s(1, 2) | add.s(3, 4)).plan()
    with pytest.raises(TypeError, match="argument 'y' must be int, not str"):
        (add.s(1, 2) | add.s("3")).plan()
    with pytest.raises(keyqueue.MalformedBody):
        (add.s(1, 2) | add.s(y=object())).plan()
    with pytest.raises(keyqueue.ConfigError, match="at least one"):
        chain()
    with pytest.raises(keyqueue.ConfigError, match="not 3"):
        group(add.s(1, 1), 3)  # type: ignore[arg-type]


def test_workflow_and_step_ids() -> None:
    assert validate_workflow_id("wf-order-17") == "wf-order-17" and is_workflow_id("wf-01J9ZQ")
    for bad in ("order-17", "wf-", "wf-a.b", "wf-a_b", "wf-" + "x" * 200):
        with pytest.raises(keyqueue.InvalidRequestId):
            validate_workflow_id(bad)
    assert step_request_id("wf-a", 3) == "wf-a_3"
    assert parse_step_request_id("wf-a_3") == ("wf-a", 3)
    assert parse_step_request_id("wf-a_3.replay-17") == ("wf-a", 3)
    assert parse_step_request_id("charge-1") is None


def test_results_are_decoded_by_their_shape() -> None:
    result_types = {0: Point, 1: None}.get
    assert decode_shape(["step", 0], {"x": 1, "y": 2}, result_types) == Point(1, 2)
    assert decode_shape(["list", [["step", 0], ["step", 1]]], [{"x": 1, "y": 2}, 5], result_types) == [Point(1, 2), 5]
    assert decode_shape(["step", 1], {"x": 1}, result_types) == {"x": 1}


async def test_the_eager_mode_says_it_does_not_run_workflows() -> None:
    from keyqueue.testing import eager

    with eager(app), pytest.raises(keyqueue.ConfigError, match="eager test mode runs single tasks"):
        await (add.s(1, 2) | add.s(3)).enqueue()
