"""What nats-py reports through error_cb is logged, each type at most once per interval."""

from __future__ import annotations

import logging

import nats.errors
import pytest

from keyqueue.errors import ConnectionFailed
from keyqueue.jetstream.connect import NatsErrorLog, disconnected


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slow_consumer(subject: str) -> nats.errors.SlowConsumerError:
    """nats-py's slow-consumer error, without the subscription it names (nothing here reads it)."""
    return nats.errors.SlowConsumerError(subject, "", 1, None)  # type: ignore[arg-type]


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "keyqueue.connection" and r.levelno == level]


async def test_each_type_is_logged_once_per_interval_with_a_count_of_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    errors = NatsErrorLog("w1", interval=60, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="keyqueue.connection"):
        await errors.report(slow_consumer("orders.>"))
        clock.now += 10
        await errors.report(slow_consumer("orders.>"))
        await errors.report(slow_consumer("orders.>"))
        await errors.report(nats.errors.Error("nats: permissions violation for publish to x"))
        clock.now += 60
        await errors.report(slow_consumer("orders.>"))
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 3
    assert warnings[0].startswith("NATS connection w1: SlowConsumerError: nats: slow consumer")
    assert "not logged" not in warnings[0]
    assert warnings[1] == "NATS connection w1: Error: nats: permissions violation for publish to x"
    assert warnings[2].endswith("(2 more of this type since the last one were not logged)")


async def test_a_lost_connection_and_failed_reconnects_stay_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    errors = NatsErrorLog("w1")
    with caplog.at_level(logging.DEBUG, logger="keyqueue.connection"):
        await errors.report(nats.errors.UnexpectedEOF())
        await errors.report(ConnectionRefusedError(111, "Connect call failed"))
        await errors.report(TimeoutError())
        await errors.report(nats.errors.FlushTimeoutError())  # a timeout, but not of a reconnect
    assert len(messages(caplog, logging.DEBUG)) == 3
    assert messages(caplog, logging.WARNING) == ["NATS connection w1: FlushTimeoutError: nats: flush timeout"]


async def test_an_exception_from_a_callback_carries_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    errors = NatsErrorLog("w1")
    try:
        raise KeyError("missing")
    except KeyError as e:
        error = e
    with caplog.at_level(logging.WARNING, logger="keyqueue.connection"):
        await errors.report(error)
        await errors.report(slow_consumer("s"))
    [from_callback, from_nats] = caplog.records
    assert from_callback.exc_info is not None and from_callback.exc_info[1] is error
    assert from_nats.exc_info is None


async def test_expected_errors_are_one_line_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """No responders, a timeout, the connection down: what an outage makes callbacks raise too."""
    try:
        try:
            raise nats.errors.NoRespondersError()
        except nats.errors.NoRespondersError as e:
            raise ConnectionFailed("no responders for $JS.API.CONSUMER.INFO.KQ_shop_TOKENS.workers") from e
    except ConnectionFailed as e:
        from_callback = e
    errors = NatsErrorLog("w1")
    with caplog.at_level(logging.WARNING, logger="keyqueue.connection"):
        await errors.report(nats.errors.NoRespondersError())
        await errors.report(from_callback)
        await errors.report(disconnected("the request to $JS.API.INFO"))
        await errors.report(RuntimeError("a bug in a callback"))
    assert [(r.getMessage(), r.exc_info is None) for r in caplog.records] == [
        ("NATS connection w1: NoRespondersError: nats: no responders available for request", True),
        ("NATS connection w1: ConnectionFailed: no responders for $JS.API.CONSUMER.INFO.KQ_shop_TOKENS.workers", True),
        (f"NATS connection w1: Disconnected: {disconnected('the request to $JS.API.INFO')}", True),
        ("NATS connection w1: RuntimeError: a bug in a callback", False),
    ]


async def test_failed_reconnect_attempts_are_counted_not_logged_one_by_one(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    errors = NatsErrorLog("w1", interval=60, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="keyqueue.connection"):
        for _ in range(28):  # a 7 s outage, one attempt every 0.25 s
            await errors.report(ConnectionRefusedError(111, "Connect call failed"))
            clock.now += 0.25
        clock.now += 60
        await errors.report(ConnectionRefusedError(111, "Connect call failed"))
    assert messages(caplog, logging.DEBUG) == [
        "NATS connection w1: ConnectionRefusedError: [Errno 111] Connect call failed",
        "NATS connection w1: ConnectionRefusedError: [Errno 111] Connect call failed (27 more of this type since "
        "the last one were not logged)",
    ]
    assert messages(caplog, logging.WARNING) == []
