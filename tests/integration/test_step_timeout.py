"""A key session's step that nobody answers is sent again after the step timeout, not the API's.

A replicated stream electing a leader takes publishes and answers none of them for up to
nats-server's election timeout; a session that waited the API's usual 5 s for each would hold its
key that long after the election ended, and a lease of a few seconds could not wait at all. So
``QueueIO`` waits ``ack_wait / 10`` (0.5-5 s) for a step's reply and the session sends it again
(core/outage.py). Here the dead-letter copy, a step that is safe to send twice (the DLQ stores it
once, by the request's sequence), is sent to a subject that a silent subscriber takes and nobody
answers, as a leaderless stream does.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.core.outage import Deadline, ride_out
from keyqueue.jetstream.api import API_TIMEOUT, JetStreamApi, StoredMsg
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.wire import headers as H


async def test_an_unanswered_dead_letter_copy_is_sent_again_after_the_step_timeout(nc: Client) -> None:
    config = QueueConfig("silent", ack_wait=2.0)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    io = QueueIO(nc, config)
    assert io.step_timeout == 0.5 and io.step_timeout * 4 < API_TIMEOUT

    # The DLQ stream gone and a subscriber that never answers on its subjects: a publish is taken
    # and unanswered, as by a replicated stream with no leader.
    await api.delete_stream(config.names.dlq_stream)
    copies: asyncio.Queue[float] = asyncio.Queue()
    async def take(msg: Msg) -> None:
        copies.put_nowait(asyncio.get_running_loop().time())

    silent = await nc.subscribe(config.names.dlq("k"), cb=take)
    await nc.flush()

    request = StoredMsg(subject=config.names.inbox("k"), seq=7, headers={H.MSG_ID: "r-7"}, data=b"body")
    why = {H.DLQ_REASON: "rejected"}
    loop = asyncio.get_running_loop()
    started = loop.time()
    step = asyncio.ensure_future(ride_out(lambda: io.dead_letter("k", request, why), Deadline(60, "the copy"), io))
    try:
        first = await asyncio.wait_for(copies.get(), 10)
        # Sent again once the step timeout (0.5 s) passed unanswered: before the API's 5 s would
        # have let it (the wait ends half a second before those 5 s; a copy sent again only after
        # the API's timeout comes too late, as the test shows with io.api.timeout set to it).
        second = await asyncio.wait_for(copies.get(), API_TIMEOUT - 0.5 - (loop.time() - started))
        assert second - first >= io.step_timeout * 0.9
        # The stream back (its leader elected, as it were): the next copy is stored and answered.
        await silent.unsubscribe()
        await Topology(api, config).ensure()
        await asyncio.wait_for(step, 30)
    finally:
        step.cancel()
    dead = await api.get_msg(config.names.dlq_stream, last_by_subject=config.names.dlq("k"))
    assert dead is not None and dead.data == b"body"
    assert dead.headers[H.DLQ_REASON] == "rejected"
    info = await api.stream_info(config.names.dlq_stream)
    assert info["state"]["messages"] == 1  # stored once, however often it was sent

