"""How the token puller treats what the server answers a pull with, against a real nats-server."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.pull import PullOptions, Token, TokenPuller
from keyqueue.jetstream.topology import QueueConfig, Topology


async def test_a_pull_the_consumer_refuses_with_409_is_sent_again_after_a_pause(nc: Client) -> None:
    config = QueueConfig("refused", ack_wait=5)
    api = JetStreamApi(nc)
    await Topology(api, config).ensure()
    names = config.names
    consumer = (await api.consumer_info(names.token_stream, names.consumer))["config"]
    # Every pull of the puller (a chunk of 4 or more) now asks for more than the consumer allows:
    # the server answers each one 409 "Exceeded MaxRequestBatch" at once.
    await api.request(f"CONSUMER.CREATE.{names.token_stream}.{names.consumer}",
                      {"stream_name": names.token_stream, "config": {**consumer, "max_batch": 1}, "action": "update"})

    async def on_token(token: Token) -> None:
        raise AssertionError("no token was stored")

    puller = TokenPuller(nc, names, capacity=lambda: 8, on_token=on_token, options=PullOptions(heartbeat=1.0))
    running = asyncio.create_task(puller.run())
    try:
        await asyncio.sleep(1.0)  # a rate is measured over time: one second of refused pulls
    finally:
        puller.stop()
        await running
    # Pulled again at once, a refused pull costs a round trip: hundreds a second. With pauses of
    # 0.05 s doubling up to 2 s (as for "no responders"), a handful.
    assert 1 <= puller.statuses.get("409", 0) <= 12, puller.statuses
