"""The chaos harness's node faults on a real 3-node cluster: when a fault is over."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from keyqueue.chaos import injectors
from keyqueue.chaos.fleet import Faults, Fleet
from keyqueue.errors import KeyqueueError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.cluster import EmbeddedCluster

pytestmark = pytest.mark.asyncio


class _Notes:
    """Stands in for the fleet's log: what the faults note."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def note(self, who: str, kind: str, **fields: Any) -> None:
        self.records.append((kind, fields))


async def test_a_rolling_restart_step_lasts_until_every_group_of_the_queue_has_a_leader() -> None:
    # Three nodes restarted one after another can leave a group without a leader for longer than
    # the node takes to come back; time after the step's end counts against keyqueue, so the step
    # must last until the queue can be served again.
    async with EmbeddedCluster(3) as cluster:
        nc = await connect(cluster.url)
        try:
            config = QueueConfig("rolling", ack_wait=2.0, replicas=3)
            deadline = time.monotonic() + 30
            while True:  # the streams' interest spreads over the routes a moment after they are created
                try:
                    await Topology(JetStreamApi(nc), config).ensure()
                    break
                except KeyqueueError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            notes = _Notes()
            targets = injectors._leader_targets(config)
            await injectors._rolling_restart(cluster, JetStreamApi(nc), targets, Faults(cast(Fleet, notes)),
                                             asyncio.Event())
        finally:
            await nc.close()
    nodes = {server.name for server in cluster.servers}
    ends = [fields for kind, fields in notes.records if kind == "fault_end"]
    assert len(ends) == 3
    for end in ends:
        leaders = end["leaders"]
        assert set(leaders) == set(targets) and set(leaders.values()) <= nodes, leaders
