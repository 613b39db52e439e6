"""What nats-server does with the lease layout of design D2, "one fenced release publish"
(docs/decisions.md, "The one-publish release (D2): its server facts, checked"), measured on the server the
tests run (2.15.1): the facts the research note marks "(code)" and D2 depends on, checked against a real
server before anyone builds on them. Each test asserts what the server did; where that differs from the
note, the comment says so.

The layout: one stream holds a key's requests (``kq.t.in.<key>``), its lease record (``kq.t.ls.<key>``) and
the lease record's never-fired schedule target (``kq.t.wk.<key>``), so ``kq.t.*.<key>`` covers exactly the
key's subjects.

1. A lease record written as a schedule that never fires in the test (``@every 24h``) with ``Nats-TTL`` is
   a working lease: compare-and-set 0 takes it, a second CAS(0) is refused while it lives, a renewal (CAS on
   its seq) replaces it, and it expires by its TTL (measured from the renewal). The schedule target must be
   a subject of the stream.
2. On one server (R1), one publish on ``kq.t.in.<key>`` with a rollup, a TTL, a compare-and-set on the
   wildcard ``kq.t.*.<key>`` and ``Nats-Schedule-Next: purge`` of ``kq.t.ls.<key>`` is the fenced release:
   when nothing was written on the key after the expected seq it is stored alone, with the requests before
   it and the lease gone; when a request or a lease record was written after it, it is refused and nothing
   is purged (also when the request was sent just before it on the same connection).
3. On a 3-node R3 stream, the wildcard compare-and-set does not see a write on a matching literal subject
   that is proposed but not yet applied: the release is accepted after it and its rollup (or schedule
   purge) removes that write. A literal check refuses (10164). So D2's single wildcard publish is R1-only.
   (``bench/r3_wildcard_cas.py`` counts the same race between two connections.)
4. A ``$JS.API.STREAM.MSG.DELETE`` request published with no reply subject is still carried out.
5. A stream that allows schedules cannot discard new messages (created so, updated to it, or with
   schedules turned on over a cap), and schedules cannot be turned off again: a D2 inbox cannot have
   the per-key backlog cap, ever.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from server_facts import api, publish

from keyqueue.jetstream.connect import connect
from keyqueue.server.cluster import EmbeddedCluster

STREAM = {"name": "S", "subjects": ["kq.t.in.*", "kq.t.ls.*", "kq.t.wk.*"], "retention": "limits",
          "storage": "file", "discard": "old", "allow_msg_schedules": True, "allow_msg_ttl": True,
          "allow_rollup_hdrs": True}
POLL = 0.05


def lease(key: str, expected: int, ttl: str = "2s") -> dict[str, str]:
    """A lease record: a schedule that fires in a day at the earliest, gone by its TTL long before."""
    return {"Nats-Schedule": "@every 24h", "Nats-Schedule-Target": f"kq.t.wk.{key}", "Nats-TTL": ttl,
            "Nats-Expected-Last-Subject-Sequence": str(expected)}


def release(key: str, expected: int, *, wildcard: bool = True) -> dict[str, str]:
    """D2's release publish on ``kq.t.in.<key>``: the check is on ``kq.t.*.<key>`` (or on the literal
    ``kq.t.in.<key>``), the rollup purges the requests before it, the schedule purge the lease."""
    return {"Nats-Rollup": "sub", "Nats-TTL": "1s", "Kq-Done": "1",
            "Nats-Expected-Last-Subject-Sequence": str(expected),
            "Nats-Expected-Last-Subject-Sequence-Subject": f"kq.t.*.{key}" if wildcard else f"kq.t.in.{key}",
            "Nats-Schedule-Next": "purge", "Nats-Scheduler": f"kq.t.ls.{key}"}


def error(ack: dict[str, Any]) -> tuple[int, str] | None:
    return (ack["error"]["err_code"], ack["error"]["description"]) if "error" in ack else None


async def subjects(nc: Client, stream: str = "S") -> dict[str, int]:
    """Each stored subject of ``stream`` with its message count."""
    info = await api(nc, f"STREAM.INFO.{stream}", {"subjects_filter": ">"})
    return dict(info["state"].get("subjects") or {})


async def message(nc: Client, seq: int, stream: str = "S") -> dict[str, Any] | None:
    """The stored message at ``seq`` with its headers decoded, or None (10037, no message found)."""
    reply = await api(nc, f"STREAM.MSG.GET.{stream}", {"seq": seq})
    if "error" in reply:
        assert reply["error"]["err_code"] == 10037, reply
        return None
    found: dict[str, Any] = reply["message"]
    lines = base64.b64decode(found.get("hdrs", "")).decode().split("\r\n")[1:]
    found["headers"] = dict(line.split(": ", 1) for line in lines if ": " in line)
    return found


async def until(condition: Callable[[], Awaitable[bool]], timeout: float) -> float:
    """Poll the server's state until ``condition`` holds; the seconds it took."""
    started = time.monotonic()
    async with asyncio.timeout(timeout):
        while not await condition():  # noqa: ASYNC110 (a server's state: nothing to await)
            await asyncio.sleep(POLL)
    return time.monotonic() - started


async def test_a_never_firing_schedule_with_a_ttl_is_a_lease_record(nc: Client) -> None:
    in_and_ls = {**STREAM, "subjects": ["kq.t.in.*", "kq.t.ls.*"]}
    assert "error" not in await api(nc, "STREAM.CREATE.S", in_and_ls)
    # The schedule target must be a subject of the stream, although the schedule never fires.
    assert error(await publish(nc, "kq.t.ls.k", lease("k", 0))) == (10190, "message schedules target is invalid")
    assert "error" not in await api(nc, "STREAM.UPDATE.S", STREAM)

    # The TTL is taken as a duration ("2s") and as whole seconds ("2": present at 1.2 s, gone with "2s").
    assert error(await publish(nc, "kq.t.ls.seconds", lease("seconds", 0, ttl="2"))) is None
    acquired = await publish(nc, "kq.t.ls.k", lease("k", 0))
    written = time.monotonic()
    assert error(acquired) is None
    stored = await message(nc, acquired["seq"])
    assert stored is not None
    # The server adds the rollup a schedule message carries; the TTL is kept as sent.
    assert stored["headers"]["Nats-Rollup"] == "sub" and stored["headers"]["Nats-TTL"] == "2s"
    # A second acquire (CAS 0) is refused while the record lives.
    assert error(await publish(nc, "kq.t.ls.k", lease("k", 0))) == (10071, f"wrong last sequence: {acquired['seq']}")

    # Renew 1.2 s into the record's 2 s life (watching that it is still there until then).
    async def renewal_due() -> bool:
        left = await subjects(nc)
        assert "kq.t.ls.k" in left and "kq.t.ls.seconds" in left, "a lease expired before its TTL"
        return time.monotonic() - written >= 1.2
    await until(renewal_due, timeout=5)
    renewed = await publish(nc, "kq.t.ls.k", lease("k", acquired["seq"]))
    renewed_at = time.monotonic()
    assert error(renewed) is None and renewed["seq"] > acquired["seq"]
    # The renewal replaced the record (the schedule's rollup): one message, the first one gone.
    assert (await subjects(nc))["kq.t.ls.k"] == 1
    assert await message(nc, acquired["seq"]) is None
    # A stale renewal (CAS on the replaced seq) is refused.
    assert error(await publish(nc, "kq.t.ls.k", lease("k", acquired["seq"]))) == \
        (10071, f"wrong last sequence: {renewed['seq']}")

    # It expires by its TTL, counted from the renewal: past the first record's 2 s, not before ~2 s after
    # the renewal (the server's TTL clock has its own granularity: 1.5 s is the bound asserted).
    async def expired() -> bool:
        return not {"kq.t.ls.k", "kq.t.ls.seconds"} & set(await subjects(nc))
    await until(expired, timeout=8)
    gone_at = time.monotonic()
    assert gone_at - renewed_at >= 1.5, gone_at - renewed_at
    assert gone_at - written >= 2.5, gone_at - written
    # Nothing fired on the target, and no marker was left: a new acquire (CAS 0) is taken.
    left = await subjects(nc)
    assert "kq.t.wk.k" not in left and "kq.t.ls.k" not in left, left
    assert error(await publish(nc, "kq.t.ls.k", lease("k", 0))) is None


async def test_the_fenced_release_publish_on_one_server(nc: Client) -> None:
    assert "error" not in await api(nc, "STREAM.CREATE.S", STREAM)
    # The lease is the newest write of the key: the release expects the lease's seq.
    r1 = await publish(nc, "kq.t.in.a", body=b"r1")
    r2 = await publish(nc, "kq.t.in.a", body=b"r2")
    held = await publish(nc, "kq.t.ls.a", lease("a", 0, ttl="30s"))
    # A release that expects the last request, not the lease written after it: refused, nothing purged.
    assert error(await publish(nc, "kq.t.in.a", release("a", r2["seq"]))) == \
        (10071, f"wrong last sequence: {held['seq']}")
    assert await subjects(nc) == {"kq.t.in.a": 2, "kq.t.ls.a": 1}
    # The right one: the server takes the rollup, the wildcard check and the schedule purge together
    # (2.15.1; the note says both purges run since 2.14): stored alone, the requests and the lease gone.
    done = await publish(nc, "kq.t.in.a", release("a", held["seq"]))
    assert error(done) is None and done["seq"] > held["seq"]
    assert await subjects(nc) == {"kq.t.in.a": 1}
    assert [await message(nc, seq) for seq in (r1["seq"], r2["seq"], held["seq"])] == [None, None, None]
    # The schedule purge leaves no marker: the next holder's acquire is a plain CAS(0).
    assert error(await publish(nc, "kq.t.ls.a", lease("a", 0, ttl="30s"))) is None

    # A request arrived after the lease: refused with the request's seq, nothing purged.
    b1 = await publish(nc, "kq.t.in.b", body=b"b1")
    held_b = await publish(nc, "kq.t.ls.b", lease("b", 0, ttl="30s"))
    b2 = await publish(nc, "kq.t.in.b", body=b"b2")
    assert error(await publish(nc, "kq.t.in.b", release("b", held_b["seq"]))) == \
        (10071, f"wrong last sequence: {b2['seq']}")
    assert {s: n for s, n in (await subjects(nc)).items() if s.endswith(".b")} == {"kq.t.in.b": 2, "kq.t.ls.b": 1}
    assert error(await publish(nc, "kq.t.in.b", release("b", b2["seq"]))) is None
    assert {s: n for s, n in (await subjects(nc)).items() if s.endswith(".b")} == {"kq.t.in.b": 1}
    assert await message(nc, b1["seq"]) is None

    # A late release after a renewal (another lease record written since): refused, the lease kept.
    c1 = await publish(nc, "kq.t.in.c", body=b"c1")
    first = await publish(nc, "kq.t.ls.c", lease("c", 0, ttl="30s"))
    again = await publish(nc, "kq.t.ls.c", lease("c", first["seq"], ttl="30s"))
    assert error(await publish(nc, "kq.t.in.c", release("c", first["seq"]))) == \
        (10071, f"wrong last sequence: {again['seq']}")
    assert await message(nc, c1["seq"]) is not None and await message(nc, again["seq"]) is not None

    # No lease record at all (expired, or never written): the schedule purge of the empty subject is taken.
    d1 = await publish(nc, "kq.t.in.d", body=b"d1")
    assert error(await publish(nc, "kq.t.in.d", release("d", d1["seq"]))) is None
    assert {s: n for s, n in (await subjects(nc)).items() if s.endswith(".d")} == {"kq.t.in.d": 1}
    # A message on the scheduler subject that is not a schedule: refused (as the note says), nothing purged.
    await publish(nc, "kq.t.in.e", body=b"e1")
    plain = await publish(nc, "kq.t.ls.e", body=b"not a schedule")
    assert error(await publish(nc, "kq.t.in.e", release("e", plain["seq"]))) == \
        (10212, "message schedules invalid scheduler")
    assert {s: n for s, n in (await subjects(nc)).items() if s.endswith(".e")} == {"kq.t.in.e": 1, "kq.t.ls.e": 1}

    # On one server a request sent just before the release, on the same connection and not awaited, is
    # always seen by the wildcard check (contrast with R3 below): refused, and the request kept.
    for n in range(20):
        key = f"p{n}"
        last = await publish(nc, f"kq.t.in.{key}", body=b"handled")
        arriving = asyncio.ensure_future(publish(nc, f"kq.t.in.{key}", body=b"new"))
        late = asyncio.ensure_future(publish(nc, f"kq.t.in.{key}", release(key, last["seq"])))
        request, refused = await arriving, await late
        assert error(refused) == (10071, f"wrong last sequence: {request['seq']}"), (n, refused)
        assert await message(nc, request["seq"]) is not None

    # The release goes by its own TTL (1 s).
    async def released_marker_gone() -> bool:
        return "kq.t.in.d" not in await subjects(nc)
    await until(released_marker_gone, timeout=5)


@contextlib.asynccontextmanager
async def leader_connection(cluster: EmbeddedCluster) -> AsyncIterator[Client]:
    """A connection to the node that leads stream S (R3, the D2 layout), once it takes publishes."""
    nc = await connect(cluster.urls[0])
    try:
        created = await api(nc, "STREAM.CREATE.S", {**STREAM, "num_replicas": 3})
        assert "error" not in created, created
        leader = ""

        async def elected() -> bool:
            nonlocal leader
            leader = (await api(nc, "STREAM.INFO.S")).get("cluster", {}).get("leader", "")
            return bool(leader)
        await until(elected, timeout=10)
        index = [server.name for server in cluster.servers].index(leader)
        await nc.close()
        nc = await connect(cluster.urls[index])

        async def takes_publishes() -> bool:  # the stream's interest reaches the node a moment later
            try:
                return error(await publish(nc, "kq.t.in.warm-up")) is None
            except Exception:
                return False
        await until(takes_publishes, timeout=10)
        yield nc
    finally:
        await nc.close()


async def test_on_r3_a_wildcard_check_misses_a_write_in_flight_and_a_literal_one_does_not() -> None:
    """Each round sends a write on the key and, right behind it on the same connection (not awaited), a
    release that expects the key's newest seq before that write. The stream leader proposes the write and
    checks the release before the write is applied; the wildcard check reads only applied messages."""
    rounds = 20
    async with EmbeddedCluster(3) as cluster, leader_connection(cluster) as nc:
        # A write whose PubAck came back (applied on the leader) is seen by the wildcard check: refused.
        last = await publish(nc, "kq.t.in.awaited", body=b"handled")
        arrived = await publish(nc, "kq.t.in.awaited", body=b"new")
        assert error(await publish(nc, "kq.t.in.awaited", release("awaited", last["seq"]))) == \
            (10071, f"wrong last sequence: {arrived['seq']}")
        outcomes: dict[str, list[str]] = {"request": [], "lease": [], "literal request": [], "literal lease": []}
        for n in range(rounds):
            for variant, outcome in outcomes.items():
                key = f"{variant.replace(' ', '-')}{n}"
                last = await publish(nc, f"kq.t.in.{key}", body=b"handled")
                if variant.endswith("request"):
                    write = asyncio.ensure_future(publish(nc, f"kq.t.in.{key}", body=b"new"))
                else:  # another worker's acquire
                    write = asyncio.ensure_future(publish(nc, f"kq.t.ls.{key}", lease(key, 0, ttl="30s")))
                headers = release(key, last["seq"], wildcard=not variant.startswith("literal"))
                if variant == "literal lease":  # D2's R3 fence: a literal check on the lease subject
                    headers["Nats-Expected-Last-Subject-Sequence"] = "0"
                    headers["Nats-Expected-Last-Subject-Sequence-Subject"] = f"kq.t.ls.{key}"
                late = asyncio.ensure_future(publish(nc, f"kq.t.in.{key}", headers))
                written, answer = await write, await late
                assert error(written) is None, written
                if (refused := error(answer)) is not None:
                    outcome.append(f"refused {refused[0]} {refused[1]}")
                    assert await message(nc, written["seq"]) is not None, "a refused release purged"
                else:
                    assert answer["seq"] > written["seq"]  # it was sent after the write
                    # Accepted although the write came first: its rollup or schedule purge removed it.
                    assert await message(nc, written["seq"]) is None
                    outcome.append("accepted, the write purged")
        summary = {variant: {o: outcome.count(o) for o in set(outcome)} for variant, outcome in outcomes.items()}
        # The hazard (note, section 1, "R3 hazard (code)"): it held in every round when this was written.
        assert outcomes["request"].count("accepted, the write purged") >= 1, summary
        assert outcomes["lease"].count("accepted, the write purged") >= 1, summary
        # A literal check sees the proposal in flight: refused (10164) or, once applied, 10071. Never accepted.
        for variant in ("literal request", "literal lease"):
            assert all(o == "refused 10164 wrong last sequence" or o.startswith("refused 10071")
                       for o in outcomes[variant]), summary


async def test_a_message_delete_without_a_reply_subject_is_carried_out(nc: Client) -> None:
    assert "error" not in await api(nc, "STREAM.CREATE.S", STREAM)
    seqs = [(await publish(nc, f"kq.t.ls.k{n}", body=b"x"))["seq"] for n in range(3)]
    # A core publish: no reply subject, so no answer ever comes. With and without no_erase.
    await nc.publish("$JS.API.STREAM.MSG.DELETE.S", json.dumps({"seq": seqs[0], "no_erase": True}).encode())
    await nc.publish("$JS.API.STREAM.MSG.DELETE.S", json.dumps({"seq": seqs[1]}).encode())

    async def deleted() -> bool:
        return await message(nc, seqs[0]) is None and await message(nc, seqs[1]) is None
    await until(deleted, timeout=5)
    assert await message(nc, seqs[2]) is not None
    assert await subjects(nc) == {"kq.t.ls.k2": 1}


async def test_a_stream_with_schedules_cannot_discard_new_so_d2_rules_out_the_backlog_cap(nc: Client) -> None:
    # The inbox's per-key backlog cap is discard-new per subject (keyqueue.jetstream.topology.backlog_cap);
    # D2 keeps its lease records as schedules in the inbox. The server takes neither together, nor
    # schedules turned on for a capped inbox, nor schedules turned off again once on: a D2 inbox could
    # never be given a cap.
    capped = {**STREAM, "max_msgs_per_subject": 100, "discard": "new", "discard_new_per_subject": True}
    refused = await api(nc, "STREAM.CREATE.S", capped)
    assert "error" in refused and "message scheduling cannot use discard new" in refused["error"]["description"]

    without = {key: value for key, value in capped.items() if key != "allow_msg_schedules"}
    assert "error" not in await api(nc, "STREAM.CREATE.S", without)
    turned_on = await api(nc, "STREAM.UPDATE.S", {**without, "allow_msg_schedules": True})
    assert "error" in turned_on and "message scheduling cannot use discard new" in turned_on["error"]["description"]

    assert "error" not in await api(nc, "STREAM.DELETE.S")
    assert "error" not in await api(nc, "STREAM.CREATE.S", STREAM)
    turned_off = await api(nc, "STREAM.UPDATE.S", {**STREAM, "allow_msg_schedules": False})
    assert "error" in turned_off and "can not be disabled" in turned_off["error"]["description"]
    capped_later = await api(nc, "STREAM.UPDATE.S", capped)
    assert "error" in capped_later and "cannot use discard new" in capped_later["error"]["description"]
