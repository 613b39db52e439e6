"""Renamed or re-ordered APIs keep working for a deprecation period and warn with the new spelling:
``App.cancel(queue, request_id)`` (the first versions' order) is ``App.cancel(request_id, queue=...)``."""

from __future__ import annotations

import warnings

import pytest

import keyqueue


async def test_the_old_cancel_order_still_cancels_and_warns_with_the_new_spelling(nats_url: str) -> None:
    async with keyqueue.App("shop", nats_url, autoload_plugins=False, set_as_default=False, result_ttl=600) as app:
        @app.task(key="{order}")
        def charge(order: str) -> str:
            return order

        old = await charge.enqueue(order="o1")
        new = await charge.enqueue(order="o2")
        with pytest.warns(DeprecationWarning) as caught:
            assert await app.cancel("shop", old.request_id) == "pending"
        [warning] = caught.list
        assert f"write app.cancel({old.request_id!r}, queue='shop')" in str(warning.message)
        assert warning.filename == __file__  # it points at the caller's line
        assert await app.status(old.request_id) == "cancelled"

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert await app.cancel(new.request_id, queue="shop") == "pending"
        with pytest.raises(TypeError, match=r"App.cancel\(request_id, queue=...\)"):
            await app.cancel("shop", new.request_id, queue="shop")
