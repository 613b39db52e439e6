"""The benchmark suite runs end to end on its smallest sizes and reports every workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report as output
from bench.fleet import WorkerOptions
from bench.floor import floor
from bench.results import SMOKE
from bench.run import (
    BULK,
    COLD,
    HANDOFF_SOLO,
    HELD,
    HOT_1,
    HOT_2,
    LAT_IDLE,
    LAT_LOAD,
    PRODUCT_COLD,
    PRODUCT_HOT,
    PRODUCT_HOT_2,
    PRODUCT_UNKEYED,
    RAW_FETCH,
    REBASER,
    run,
)
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.topology import QueueConfig


@pytest.mark.timeout(60)
async def test_smallest_run_reports_every_workload(tmp_path: Path) -> None:
    result = await run(SMOKE, peers=False, command="python -m bench --smoke", work_dir=tmp_path,
                       options=WorkerOptions(concurrency=32), say=lambda _: None)

    workloads = {row.workload for row in result.rows}
    for name in (RAW_FETCH, HOT_1, HOT_2, COLD, BULK, LAT_IDLE, LAT_LOAD, HANDOFF_SOLO, HELD, REBASER, PRODUCT_HOT,
                 PRODUCT_HOT_2, PRODUCT_COLD, PRODUCT_UNKEYED):
        assert name in workloads, name
    for name in (HOT_1, HOT_2, COLD):
        row = result.find(name)
        assert row is not None and row.value > 0 and row.ratio is not None and row.ratio > 0, row
        assert row.check == "order kept, exclusive", row
    for name in (PRODUCT_HOT, PRODUCT_HOT_2, PRODUCT_COLD, PRODUCT_UNKEYED):  # through `keyqueue worker`, plugins on
        row = result.find(name)
        assert row is not None and row.value > 0 and row.baseline == RAW_FETCH, row
    idle = result.find(LAT_IDLE)
    assert idle is not None and 0 < idle.value < 1000
    held = result.find(HELD)
    assert held is not None and f"{SMOKE.held_keys} of {SMOKE.held_keys} held" in held.detail
    rebaser = result.find(REBASER)
    assert rebaser is not None and rebaser.value > 0 and "DVU triggers ran as" in rebaser.detail

    text = output.table(result)
    assert HOT_1 in text and REBASER in text
    page = output.markdown(result, chart=None)
    assert "| workload |" in page and output.ANALYSIS_START in page


@pytest.mark.timeout(60)
async def test_the_floor_gives_every_key_back_with_the_protocols_messages(nats_url: str) -> None:
    """``bench.floor`` sends a cold key's messages by hand: every key is acquired, read (one request
    each), acked and marked released; a refused write, a read that found another count or a token
    left behind fails it."""
    figures = await floor(nats_url, "floorsmoke", 40)

    assert figures.rate > 0 and figures.cpu_per_key > 0
    nc = await connect(nats_url)
    try:
        api = JetStreamApi(nc)
        names = QueueConfig("floorsmoke").names
        assert (await api.stream_info(names.token_stream))["state"]["messages"] == 0
        assert await requests_waiting(api, names) == 0  # the markers removed every request
    finally:
        await nc.close()
