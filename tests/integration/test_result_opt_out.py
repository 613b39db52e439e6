"""A task opts out of its app's default ``result_ttl`` with ``result_ttl=0``: nothing of its requests is
written to the records stream (no pending record, no result), and asking for a result says why."""

from __future__ import annotations

from typing import Any

import pytest

import keyqueue
from keyqueue.jetstream.records import RequestRecords


async def test_a_task_with_result_ttl_0_keeps_nothing_on_an_app_that_keeps_results(nats_url: str, nc: Any) -> None:
    app = keyqueue.App("ledger", nats_url, autoload_plugins=False, set_as_default=False, result_ttl=600)

    @app.task(key="{account}", max_attempts=1)
    def kept(account: str, n: int) -> int:
        return n

    @app.task(key="{account}", max_attempts=1, result_ttl=0)
    def transient(account: str, n: int) -> int:
        return n

    try:
        async with app.worker(queues=["ledger"]):
            # The same key: the requests run in order, so once the last result is there the others ran.
            opted_out = await transient.enqueue(account="a1", n=1)
            replied = await transient.call(account="a1", n=2, timeout=20)  # a caller waiting still gets it
            last = await kept.enqueue(account="a1", n=3)
            assert await last.result(timeout=20) == 3
        assert replied == 2
        records = RequestRecords(nc, "ledger")
        assert await records.get_result(last.request_id) is not None
        assert await records.get_result(opted_out.request_id) is None
        with pytest.raises(keyqueue.ResultNotKept, match="declared with result_ttl=0"):
            await app.result(opted_out.request_id, task="transient", timeout=1)
        with pytest.raises(keyqueue.ResultNotKept):
            await opted_out.result(timeout=1)
    finally:
        await app.close()


def test_result_ttl_0_is_a_task_option_and_below_a_second_is_still_refused() -> None:
    app = keyqueue.App("ledger", "nats://127.0.0.1:1", autoload_plugins=False, set_as_default=False,
                       result_ttl=600)
    task = app.task(key="{k}", result_ttl=0)(lambda k: k)
    assert task.spec.kept_for(app.result_ttl) is None
    assert app.task(key="{k}", name="inherits")(lambda k: k).spec.kept_for(app.result_ttl) == 600
    with pytest.raises(keyqueue.ConfigError, match="or 0 to keep no results"):
        app.task(key="{k}", name="half", result_ttl=0.5)(lambda k: k)
