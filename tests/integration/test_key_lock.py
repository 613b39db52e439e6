"""The lease record is the lock: late messages from a former holder cannot make a second holder.

Each test plays the former holder's late message by hand against a real nats-server (the server
accepts a stale ack and acts on a stale nak: docs/architecture.md, "Fencing"), then shows that
the key's lease record still admits no one while the rightful holder works.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.aio.client import Client

from keyqueue.core.lock import KeyLock
from keyqueue.errors import LeaseLost
from keyqueue.jetstream.pull import Token, parse_ack_subject
from keyqueue.jetstream.queue_io import QueueIO
from keyqueue.jetstream.topology import QueueConfig, Topology

ACK_WAIT = 1.0


async def setup(nc: Client) -> QueueIO:
    config = QueueConfig("lockq", ack_wait=ACK_WAIT)
    io = QueueIO(nc, config)
    await Topology(io.api, config).ensure()
    return io


async def pull_token(nc: Client, io: QueueIO, timeout: float = 5.0) -> Token:
    """One delivery of a token from the queue's consumer (a raw pull, as a worker makes)."""
    names = io.names
    reply = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{names.token_stream}.{names.consumer}",
                             json.dumps({"batch": 1, "expires": int(timeout * 1e9)}).encode(),
                             timeout=timeout + 1, old_style=True)
    assert reply.reply, f"no token delivered: {reply.headers}"
    seq, delivered, stored, pending = parse_ack_subject(reply.reply)
    return Token(names.key_of(reply.subject), reply.subject, reply.reply, seq, delivered,
                 asyncio.get_running_loop().time(), stored, pending)


def lock(io: QueueIO, key: str = "k") -> KeyLock:
    return KeyLock(io, io.names.lease(key), ACK_WAIT)


async def wait_acquire(candidate: KeyLock, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await candidate.try_acquire():
        assert loop.time() < end, "the lease record never became free"
        await asyncio.sleep(0.05)


async def test_a_former_holders_late_ack_lets_no_one_start(nc: Client) -> None:
    io = await setup(nc)
    await io.schedule("k")
    token_a = await pull_token(nc, io)
    a = lock(io)
    assert await a.try_acquire()
    # A is cut off: its record expires, the server redelivers the token to B, B acquires.
    token_b = await pull_token(nc, io)
    assert token_b.stream_seq == token_a.stream_seq and token_b.delivered == 2
    b = lock(io)
    await wait_acquire(b)
    assert b.fence > a.fence
    # A's ack arrives late: the server deletes the token B works under (fact 3) ...
    await nc.publish(token_a.reply, b"+ACK")
    await nc.flush()
    # ... so a producer's next token publish succeeds and C is handed the key. The server applies
    # an ack after it has read it, so the publish may race it: try until the slot is free.
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while not await io.schedule("k"):
        assert loop.time() < end, "the late ack did not delete the token (fact 3 changed?)"
        await asyncio.sleep(0.02)
    await pull_token(nc, io)
    c = lock(io)
    assert not await c.try_acquire(), "a third worker acquired the key while B holds it"
    await b.renew()  # B still holds it
    await b.release()
    assert await c.try_acquire()
    assert c.fence > b.fence > a.fence


async def test_a_former_holders_late_nak_lets_no_one_start(nc: Client) -> None:
    io = await setup(nc)
    await io.schedule("k")
    token_a = await pull_token(nc, io)
    a = lock(io)
    assert await a.try_acquire()
    await pull_token(nc, io)  # redelivered to B after ack_wait
    b = lock(io)
    await wait_acquire(b)
    await nc.publish(token_a.reply, b"-NAK")  # late: the server redelivers at once (fact 5)
    token_c = await pull_token(nc, io, timeout=0.9)
    assert token_c.delivered == 3
    c = lock(io)
    assert not await c.try_acquire()
    await b.renew()


async def test_late_renewal_and_release_from_a_former_holder_are_refused(nc: Client) -> None:
    io = await setup(nc)
    a = lock(io)
    assert await a.try_acquire()
    a_seq = a.seq
    b = lock(io)
    await wait_acquire(b)  # A's record expired: A is a former holder now
    with pytest.raises(LeaseLost):
        a.lease.__setattr__("deadline", a.clock() + 10)  # A wrongly believes it still holds the key
        await a.renew()
    await io.remove_record(a_seq)  # A's late release touches only A's own record
    c = lock(io)
    assert not await c.try_acquire()
    await b.renew()


async def test_own_late_renewal_is_recognised(nc: Client) -> None:
    io = await setup(nc)
    a = lock(io)
    assert await a.try_acquire()
    # A renewal whose reply A never saw landed anyway: the record moved on, and it is still A's.
    await io.compare_and_set(a.subject, a.seq, a._body(0.0), a.ttl)
    await a.renew()
    record = await io.last_record(a.subject)
    assert record is not None and record.seq == a.seq
    assert a.held


async def test_fencing_continues_above_token_sequences(nc: Client) -> None:
    """A queue that ran before lease records existed keeps its fencing tokens increasing."""
    config = QueueConfig("oldq", ack_wait=ACK_WAIT)
    io = QueueIO(nc, config)
    await io.api.add_stream(config.token_config())
    for i in range(5):
        await io.schedule(f"k{i}")
    await Topology(io.api, config).ensure()
    a = lock(io)
    assert await a.try_acquire()
    assert a.fence > 5


async def test_a_record_the_server_kept_past_twice_its_ttl_is_cleared(nc: Client) -> None:
    """nats-server can keep a TTL'd record after a kill -9 and restart (found by the chaos soak):
    a waiting worker deletes a record it has seen unchanged for twice its TTL on its own clock,
    and only such a record."""
    io = await setup(nc)
    a = lock(io)
    assert await a.try_acquire()
    now = [0.0]
    b = lock(io)
    b.expiry.clock = lambda: now[0]
    assert not await b.clear_expired()  # first sight
    assert not await b.try_acquire()
    await a.renew()  # a live holder rewrites its record: a new first sight
    now[0] += 2 * a.ttl + 1
    assert not await b.clear_expired()
    assert not await b.try_acquire()
    now[0] += 2 * a.ttl + 1  # as if the server forgot to expire it, and a stopped renewing
    assert await b.clear_expired()
    assert await b.try_acquire()
    assert b.fence > a.fence
