"""``JetStreamApi.stream_or_create``: the one way keyqueue's own streams (KV buckets, records,
schedules) are created or found, also by many processes starting at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from keyqueue.errors import JetStreamError
from keyqueue.jetstream.api import JetStreamApi


async def test_many_creators_at_once_all_get_the_one_stream(nc: Any) -> None:
    wanted = {"name": "SOC", "subjects": ["soc.>"], "max_msgs_per_subject": 1, "storage": "file"}
    apis = [JetStreamApi(nc) for _ in range(8)]
    configs = await asyncio.gather(*(api.stream_or_create(wanted) for api in apis))
    assert all(c["name"] == "SOC" and c["max_msgs_per_subject"] == 1 for c in configs)
    # A stream already there is returned as the server has it, not as asked.
    assert (await apis[0].stream_or_create({**wanted, "max_msgs_per_subject": 5}))["max_msgs_per_subject"] == 1


async def test_a_stream_the_server_refuses_raises_the_refusal(nc: Any) -> None:
    api = JetStreamApi(nc)
    await api.stream_or_create({"name": "TAKEN", "subjects": ["taken.>"]})
    # Overlapping subjects: refused, and no stream of that name exists to fall back on.
    with pytest.raises(JetStreamError, match="overlap"):
        await api.stream_or_create({"name": "OTHER", "subjects": ["taken.x"]})
