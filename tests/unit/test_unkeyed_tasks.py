"""Declaring unkeyed tasks (``@app.task()`` without ``key=``), where their requests go, and what is
refused; no server (the lane itself is proven on a real one in tests/integration/test_unkeyed.py)."""

from __future__ import annotations

import pytest

import keyqueue
from keyqueue.errors import ConfigError, InvalidKey
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import UNKEYED, QueueNames, validate_key, validate_request_key
from keyqueue.testing import eager
from keyqueue.wire import headers as H


def make_app(name: str = "plain") -> keyqueue.App:
    return keyqueue.App(name, url="nats://127.0.0.1:1", set_as_default=False, autoload_plugins=False)


def test_a_task_without_a_key_is_unkeyed_and_its_requests_have_the_key_tilde() -> None:
    app = make_app()

    @app.task()
    async def add(x: int, y: int) -> int:
        return x + y

    @app.task(key=None, max_attempts=2)
    def send_email(to: str) -> None: ...

    @app.task(key="{order_id}")
    async def charge(order_id: str) -> None: ...

    assert add.spec.unkeyed and send_email.spec.unkeyed and not charge.spec.unkeyed
    assert add.fields_for((1,), {"y": 2}) == (UNKEYED, {"x": 1, "y": 2})
    assert charge.fields_for(("o1",), {})[0] == "o1"


@pytest.mark.parametrize("policy", ["batch", "latest", "merge"])
def test_policies_that_fold_a_keys_backlog_need_a_key(policy: str) -> None:
    app = make_app()
    with pytest.raises(ConfigError, match="needs key="):
        app.task(policy=policy)(lambda items: None)  # type: ignore[call-overload]


def test_the_unkeyed_key_is_reserved() -> None:
    with pytest.raises(InvalidKey, match="reserved for the requests of unkeyed tasks"):
        validate_key(UNKEYED)
    assert validate_request_key(UNKEYED) == UNKEYED  # where a stored request's key is given (status, cancel)
    app = make_app()

    @app.task(key="{name}")
    async def named(name: str) -> None: ...

    with pytest.raises(InvalidKey):
        named.fields_for(("~",), {})


def test_unkeyed_requests_are_stored_on_their_tasks_subject_of_the_work_stream() -> None:
    names = QueueNames("plain")
    publisher = Publisher(None, names)  # type: ignore[arg-type]  # subject() sends nothing
    headers = {H.MESSAGE_TYPE: "send_email", H.MSG_ID: "r1"}
    assert publisher.subject(OutgoingRequest(UNKEYED, headers, b"", "r1")) == "kq.plain.work.send_email"
    dotted = {H.MESSAGE_TYPE: "mail.send", H.MSG_ID: "r2"}
    assert publisher.subject(OutgoingRequest(UNKEYED, dotted, b"", "r2")) == "kq.plain.work.~bWFpbC5zZW5k"  # one token
    assert publisher.subject(OutgoingRequest("o1", headers, b"", "r3")) == "kq.plain.in.o1"
    assert names.work_stream == "KQ_plain_WORK"


async def test_a_queue_has_an_unkeyed_lane_for_its_own_unkeyed_tasks_or_when_declared() -> None:
    app = make_app()

    @app.task()
    async def add(x: int) -> int:
        return x

    @app.task(key="{k}", queue="keyed")
    async def step(k: str) -> None: ...

    @app.task(key="{k}", queue="latest", policy="latest")
    async def refresh(k: str) -> None: ...

    @app.task(queue="latest")  # beside a non-serial task: unkeyed requests never reach its key sessions
    async def ping() -> None: ...

    app.add_queue("routed")
    assert set(app.unkeyed_tasks("plain")) == {"add", "ping"}
    assert app.unkeyed_tasks("keyed") == {}
    assert set(app.unkeyed_tasks("routed")) == {"add", "ping"}
    with eager(app):
        assert await add.options(queue="routed").call(x=1) == 1
        with pytest.raises(ConfigError, match="its workers take no unkeyed requests"):
            await add.options(queue="keyed").enqueue(x=1)  # no worker of the app would run it there


async def test_in_eager_mode_an_unkeyed_run_may_call_another_unkeyed_task() -> None:
    app = make_app()

    @app.task()
    async def double(x: int) -> int:
        return 2 * x

    @app.task()
    async def quadruple(x: int) -> int:
        return await double.call(x=await double.call(x=x))  # waits for no key: a worker runs it beside

    with eager(app) as runner:
        assert await quadruple.call(x=3) == 12
        receipt = await double.enqueue(x=1)
    assert receipt.key == UNKEYED
    assert len(runner.succeeded) == 4
