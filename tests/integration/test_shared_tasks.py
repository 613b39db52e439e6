"""``@keyqueue.task`` in a process with two apps: a shared task belongs to the app that serves its
queue, whichever app was created first, and a worker that would dead-letter a queue's shared tasks
says so by name (docs/decisions.md, "Which app a shared task belongs to")."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import keyqueue
from keyqueue.app import application as app_module


@pytest.fixture
def fresh_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[app_module._Defaults]:
    """No apps or shared tasks of other tests: this test's are the process's only ones."""
    defaults = app_module._Defaults()
    monkeypatch.setattr(app_module, "_DEFAULTS", defaults)
    yield defaults


async def test_the_worker_of_the_app_that_claims_the_queue_serves_its_shared_tasks(
        nats_url: str, fresh_defaults: app_module._Defaults) -> None:
    @keyqueue.task(queue="billing", key="{order}", max_attempts=1)
    def invoice(order: str, amount: int) -> dict[str, object]:
        return {"order": order, "invoiced": amount}

    shop = keyqueue.App("shop", nats_url, autoload_plugins=False)  # created first: the default app
    billing = keyqueue.App("billing", nats_url, autoload_plugins=False)

    @billing.task(key="{order}", max_attempts=1)
    def settle(order: str) -> str:
        return f"settled {order}"

    try:
        async with billing.worker():
            # Sent by the task itself, and from the other app's side: both reach billing's worker,
            # which knows the shared task (the first app does not take it).
            assert await invoice.call(order="o1", amount=5, timeout=20) == {"order": "o1", "invoiced": 5}
            assert await settle.call(order="o1", timeout=20) == "settled o1"
        assert "invoice" not in shop.tasks
    finally:
        await billing.close()
        await shop.close()


async def test_a_worker_names_the_shared_tasks_of_its_queue_that_belong_to_another_app(
        nats_url: str, fresh_defaults: app_module._Defaults, caplog: pytest.LogCaptureFixture) -> None:
    @keyqueue.task(queue="ledger", key="{account}")
    def audit(account: str) -> None: ...

    shop = keyqueue.App("shop", nats_url, autoload_plugins=False)  # the default app takes audit
    ledger = keyqueue.App("ledger", nats_url, autoload_plugins=False, set_as_default=False)

    @ledger.task(key="{account}")
    def post(account: str) -> None: ...

    caplog.set_level(logging.WARNING, logger="keyqueue.worker")
    try:
        async with ledger.worker():
            pass
    finally:
        await ledger.close()
        await shop.close()
    [warning] = [r.getMessage() for r in caplog.records if "belong to another app" in r.getMessage()]
    assert ("queue ledger: @keyqueue.task tasks audit (on app 'shop') belong to another app, not to app ledger"
            in warning)
    assert "UnknownMessageType" in warning
