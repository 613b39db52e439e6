"""``python -m bench.r3_wildcard_cas``: on an R3 stream, does a wildcard compare-and-set miss a write in flight?

Design D2 (docs/decisions.md, "The one-publish release (D2): its server facts, checked") gives a key
back with one publish on ``kq.t.in.<key>`` that expects the newest seq of ``kq.t.*.<key>``
(``Nats-Expected-Last-Subject-Sequence`` with ``...-Subject`` a wildcard) and rolls the subject up. The
research note's "R3 hazard (code)": the stream leader
checks an expected seq against the messages it has applied, and blocks only writes in flight on the
*literal* subject of the check; a wildcard check does not see a request that is proposed but not yet
applied, so the release can be stored after that request and its rollup purge it.
tests/integration/test_lease_layout_facts.py shows it deterministically (the request and the release
sent back to back on one connection). This script counts the race as it happens in use: a producer's
connection and a worker's connection (two connections, also when both are on the same node), each on any
of the 3 nodes.

A 3-node embedded cluster (``EmbeddedCluster``), one R3 file stream with the D2 layout (``kq.t.in.*``,
``kq.t.ls.*``, ``kq.t.wk.*``; schedules, TTLs and rollups allowed). Each round, on a fresh key: the worker
stores a request and awaits its PubAck (seq ``s``); then, in the same turn of the event loop, the producer
sends ``--burst`` requests on the key (not awaited) and the worker sends the release expecting ``s``
(wildcard ``kq.t.*.<key>``, or with ``--literal`` the literal ``kq.t.in.<key>``). Outcomes per round:

- ``refused``: the release was refused (error code and description, less the seq it names); every
  request stays.
- ``before``: accepted with a seq below every request of the burst (it came first: correct).
- ``HAZARD``: accepted with a seq above a request of the burst that its check did not see; ``lost``
  counts the requests of the burst that are gone afterwards (acked, then purged by the rollup).

``--pipelined`` sends the burst and the release on the worker's own connection instead (one node pair, the
leader's). ``--literal`` is the control (the note: a literal check is in-flight-safe), ``--replicas 1`` the
other (an R1 stream on the same cluster). The rates vary from run to run: it is a race.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from typing import Any

from nats.aio.client import Client

from keyqueue.jetstream.connect import connect
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import find_nats_server, server_version

STREAM = {"name": "S", "subjects": ["kq.t.in.*", "kq.t.ls.*", "kq.t.wk.*"], "retention": "limits",
          "storage": "file", "discard": "old", "allow_msg_schedules": True, "allow_msg_ttl": True,
          "allow_rollup_hdrs": True}


async def api(nc: Client, subject: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.{subject}", json.dumps(payload).encode() if payload else b"", timeout=5)
    result: dict[str, Any] = json.loads(reply.data)
    return result


async def publish(nc: Client, subject: str, headers: dict[str, str] | None = None, body: bytes = b"") -> dict[str, Any]:
    reply = await nc.request(subject, body, timeout=5, headers=headers)
    result: dict[str, Any] = json.loads(reply.data)
    return result


def release(key: str, expected: int, literal: bool) -> dict[str, str]:
    return {"Nats-Rollup": "sub", "Nats-TTL": "1s", "Nats-Expected-Last-Subject-Sequence": str(expected),
            "Nats-Expected-Last-Subject-Sequence-Subject": f"kq.t.in.{key}" if literal else f"kq.t.*.{key}",
            "Nats-Schedule-Next": "purge", "Nats-Scheduler": f"kq.t.ls.{key}"}


async def stored(nc: Client, seq: int) -> bool:
    reply = await api(nc, "STREAM.MSG.GET.S", {"seq": seq})
    if "error" in reply:
        assert reply["error"]["err_code"] == 10037, reply
        return False
    return True


async def one_round(producer: Client, worker: Client, key: str, burst: int, literal: bool) -> tuple[str, int]:
    """The round's outcome and how many of the burst's (acked) requests are gone."""
    last = await publish(worker, f"kq.t.in.{key}", body=b"handled")
    writes = [asyncio.ensure_future(publish(producer, f"kq.t.in.{key}", body=b"r%d" % n)) for n in range(burst)]
    late = asyncio.ensure_future(publish(worker, f"kq.t.in.{key}", release(key, last["seq"], literal)))
    acks = [await w for w in writes]
    answer = await late
    assert all("error" not in a for a in acks), acks
    lost = [not await stored(worker, a["seq"]) for a in acks].count(True)
    if "error" in answer:
        assert lost == 0, (answer, acks)
        description = answer["error"]["description"].split(":")[0]  # without the seq it names
        return f"refused {answer['error']['err_code']} {description}", lost
    if all(answer["seq"] < a["seq"] for a in acks):
        return "before", lost
    return "HAZARD", lost


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.r3_wildcard_cas", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="rounds per (producer node, worker node) pair")
    parser.add_argument("--burst", type=int, default=3, help="requests the producer sends per round (default 3)")
    parser.add_argument("--literal", action="store_true", help="check the literal kq.t.in.<key> (no wildcard)")
    parser.add_argument("--replicas", type=int, default=3, choices=(1, 3),
                        help="the stream's replicas (default 3; 1: an R1 stream on the same 3-node cluster)")
    parser.add_argument("--pipelined", action="store_true",
                        help="the burst on the worker's own connection, just before the release")
    args = parser.parse_args(argv)
    binary = find_nats_server()
    print(f"nats-server v{'.'.join(map(str, server_version(binary)))}; {args.rounds} rounds per node pair, "
          f"burst {args.burst}, {'literal' if args.literal else 'wildcard'} check, R{args.replicas} stream"
          f"{', pipelined on one connection' if args.pipelined else ''}")
    async with EmbeddedCluster(3) as cluster:
        admin = await connect(cluster.urls[0])
        try:
            assert "error" not in await api(admin, "STREAM.CREATE.S", {**STREAM, "num_replicas": args.replicas})
            deadline = time.monotonic() + 10
            while not (leader := (await api(admin, "STREAM.INFO.S")).get("cluster", {}).get("leader")):
                assert time.monotonic() < deadline, "no stream leader"
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
        names = [server.name for server in cluster.servers]
        print(f"stream leader: node {names.index(leader)}\n")
        producers = [await connect(url, name=f"producer-{n}") for n, url in enumerate(cluster.urls)]
        workers = [await connect(url, name=f"worker-{n}") for n, url in enumerate(cluster.urls)]
        ncs = producers + workers
        try:
            for nc in ncs:  # each node takes publishes to the stream (its interest spreads over the routes)
                deadline = time.monotonic() + 10
                while True:
                    try:
                        if "error" not in await publish(nc, "kq.t.in.warm-up"):
                            break
                    except Exception:
                        pass
                    assert time.monotonic() < deadline, "a node does not take publishes"
                    await asyncio.sleep(0.1)
            pairs = [(p, w) for p in range(3) for w in range(3)]
            if args.pipelined:
                pairs = [(names.index(leader), names.index(leader))]
            print("| producer node | worker node | rounds | HAZARD | requests lost | before | refused |")
            print("|---|---|---|---|---|---|---|")
            totals: Counter[str] = Counter()
            for p, w in pairs:
                producer = workers[w] if args.pipelined else producers[p]
                outcomes: Counter[str] = Counter()
                lost = 0
                for n in range(args.rounds):
                    outcome, gone = await one_round(producer, workers[w], f"p{p}w{w}n{n}", args.burst, args.literal)
                    outcomes[outcome] += 1
                    lost += gone
                totals.update(outcomes)
                totals["lost"] += lost
                refused = ", ".join(f"{k.removeprefix('refused ')}: {v}" for k, v in sorted(outcomes.items())
                                    if k.startswith("refused")) or "0"
                print(f"| {p} | {w} | {args.rounds} | {outcomes['HAZARD']} | {lost} | {outcomes['before']} "
                      f"| {refused} |")
            rounds = args.rounds * len(pairs)
            print(f"\n{totals['HAZARD']} of {rounds} releases accepted after a request their check did not see; "
                  f"{totals['lost']} acked requests purged.")
        finally:
            for nc in ncs:
                await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
