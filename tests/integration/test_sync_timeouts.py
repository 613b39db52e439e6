"""The sync forms raise what the async forms raise: a call or a result that is not there in time is
the async form's ``KeyqueueTimeout`` ("the request is stored and will still run"), never the
portal's ``SyncTimeout`` (whose advice, enqueue it again, would double-submit); ``SyncTimeout``
stays for the portal itself not answering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

import keyqueue
from keyqueue.errors import EnqueueTimeout, KeyqueueTimeout, SyncTimeout


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("lonely", nats_url, autoload_plugins=False, set_as_default=False, result_ttl=600)
    try:
        yield app
    finally:
        await app.close()


async def test_call_sync_and_result_sync_with_no_worker_raise_the_async_forms_timeout(app: keyqueue.App) -> None:
    @app.task(key="{order}")
    def charge(order: str) -> str:
        return order

    with pytest.raises(KeyqueueTimeout) as async_call:
        await charge.options(timeout=0.5).call(order="o1")

    def view() -> tuple[BaseException, BaseException, str]:
        with pytest.raises(KeyqueueTimeout) as sync_call:
            charge.options(timeout=0.5).call_sync(order="o1")
        receipt = charge.delay(order="o2")
        with pytest.raises(KeyqueueTimeout) as sync_result:
            receipt.result_sync(timeout=0.5)
        return sync_call.value, sync_result.value, receipt.request_id

    sync_call, sync_result, request_id = await asyncio.to_thread(view)
    assert type(sync_call) is type(async_call.value)
    assert not isinstance(sync_call, SyncTimeout)
    assert "will still run" in str(sync_call) and "enqueue it again" not in str(sync_call)
    with pytest.raises(KeyqueueTimeout) as async_result:
        await app.result(request_id, timeout=0.5)
    assert type(sync_result) is type(async_result.value)
    assert str(sync_result) == str(async_result.value)
    assert "enqueue it again" not in str(sync_result)


class Unacknowledged:
    """An enqueue that gets no acknowledgement, as the transport reports it after its retry."""

    @keyqueue.hookimpl
    def keyqueue_wrap_enqueue(self) -> object:
        raise EnqueueTimeout("lonely", "o1", "r-1", 5.0)


async def test_an_enqueue_timeout_keeps_its_type_through_delay(nats_url: str) -> None:
    """``EnqueueTimeout`` raised by the enqueue reaches ``delay()``'s caller as itself."""
    app = keyqueue.App("lonely", nats_url, autoload_plugins=False, set_as_default=False,
                       plugins=[Unacknowledged()])

    @app.task(key="{order}")
    def charge(order: str) -> str:
        return order

    def view() -> BaseException:
        with pytest.raises(KeyqueueTimeout) as raised:
            charge.delay(order="o1")
        return raised.value

    try:
        raised = await asyncio.to_thread(view)
    finally:
        await app.close()
    assert type(raised) is EnqueueTimeout
    assert "Enqueue it again with request_id=" in str(raised)


async def test_the_portal_not_answering_is_still_a_sync_timeout(app: keyqueue.App) -> None:
    never = asyncio.Event()

    def view() -> BaseException:
        with pytest.raises(SyncTimeout) as raised:
            app.run_sync(never.wait, bound=0.3, what="waiting for nothing")
        return raised.value

    raised = await asyncio.to_thread(view)
    assert "waiting for nothing did not finish within 0.3s" in str(raised)
