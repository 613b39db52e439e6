"""keyqueue/jetstream/kv.py, the revision-checked KV bucket the Rebaser keeps snapshots in."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from keyqueue.errors import ConfigError, TopologyMismatch, WrongLastSequence
from keyqueue.ext import KeyValue


async def test_writes_are_checked_against_the_last_revision(nc: Client) -> None:
    kv = KeyValue(nc, "snaps")
    await kv.ensure()
    await kv.ensure()  # idempotent
    assert await kv.get("w1.cs1") is None
    first = await kv.put("w1.cs1", b"a", expected_revision=0)
    with pytest.raises(WrongLastSequence) as refused:
        await kv.put("w1.cs1", b"b", expected_revision=0)  # "must not exist" no longer holds
    assert refused.value.err_code == 10071
    second = await kv.put("w1.cs1", b"b", expected_revision=first)
    with pytest.raises(WrongLastSequence):
        await kv.put("w1.cs1", b"stale", expected_revision=first)  # a writer that read before `second`
    value, revision = await kv.get("w1.cs1") or (b"", 0)
    assert (value, revision) == (b"b", second)
    assert await kv.put("w1.cs1", b"c", expected_revision=None) > second  # unconditional
    # Standard NATS KV layout: nats-py's own KV client reads what this wrote.
    entry = await (await nc.jetstream().key_value("snaps")).get("w1.cs1")
    assert entry.value == b"c"


async def test_a_bucket_that_differs_is_named_not_changed(nc: Client) -> None:
    await KeyValue(nc, "snaps", history=5).ensure()
    with pytest.raises(TopologyMismatch, match="max_msgs_per_subject is 5"):
        await KeyValue(nc, "snaps", history=1).ensure()


def test_names_are_checked(nc: Client) -> None:
    with pytest.raises(ConfigError, match="bucket name"):
        KeyValue(nc, "bad.name")
    with pytest.raises(ConfigError, match="KV key"):
        KeyValue(nc, "ok").subject("w1..cs1")
