"""``python -m bench.floor``: what a cold key's messages cost a Python worker with nothing else.

The key session's protocol (docs/architecture.md, "The key session") has a cold key's worker
send and read a fixed set of messages: the token pulled and delivered, the lease record's
compare-and-set and its reply, the first read (a batched direct get) and its two replies, the
token's ack (plain, with one double ack confirming a loop turn's batch), the release marker and
its reply, and the lease record's delete. This sends and reads exactly those messages for many
cold keys, from callbacks on the connection's read path (keyqueue's ``LeanParser`` and
``SyncDispatch``) with the commands appended to nats-py's pending buffer directly: no session
object, no task, future or timer per key, no processor, no lease keeping, no error handling. It
is not a worker anyone could run; it is the **floor** any key session on this protocol and this
client pays, which says how much of the worker's CPU per cold key is the session's and how much
the messages' own.

One embedded nats-server; in one run, each on its own queue with the same keys stored first and
timed from the first token to the last key done:

- raw JetStream fetch(200)+ack (``bench.raw``), the ceiling the ratios are taken against;
- the floor, in this process (its CPU is this process's over the drain);
- the core alone (``bench.worker``: a ``QueueWorker`` with a no-op processor, 128 slots);
- the product path (``keyqueue worker bench.user_app:app``, 128 slots, the default plugins: the
  cold row of ``bench.user_path``).

All three run on the same event loop (``--loop``; uvloop where it is installed, as ``keyqueue
worker``'s default).

Example: ``python -m bench.floor --keys 3000 --rounds 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.protocol.command import hpub_cmd, pub_cmd

from bench import raw
from bench.workloads import interleaved
from keyqueue.app.event_loop import LOOPS, run
from keyqueue.jetstream.api import STATUS, JetStreamApi
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.fastpub import header_block
from keyqueue.jetstream.kv import EXPECTED_LAST_SUBJECT_SEQUENCE as EXPECTED
from keyqueue.jetstream.mux import SyncDispatch
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.pull import PENDING_MESSAGES
from keyqueue.jetstream.queue_io import ROLLUP, TTL
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import headers as H

SLOTS = 128
"""Keys held at once, as the product path's and the core's workers (``--concurrency 128``)."""

NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Figures:
    rate: float
    """Keys a second, first token to last key done."""
    cpu_per_key: float
    """Microseconds of the worker's CPU (user + system) per key."""


class _Key:
    __slots__ = ("fence", "key", "last", "read_done", "reads", "token_reply")

    def __init__(self, key: str, token_reply: str) -> None:
        self.key = key
        self.token_reply = token_reply
        self.fence = 0
        self.last = 0
        self.reads = 0
        self.read_done = False


class Floor:
    """The cold key's messages for ``keys`` stored keys, from callbacks; :attr:`done` is set once
    every key is given back. What went wrong (a refused write, a read that found no request) is
    in :attr:`errors`."""

    def __init__(self, nc: Any, config: QueueConfig, keys: int) -> None:
        self.nc = nc
        self.names = config.names
        self.total = keys
        self.finished = 0
        self.requested = 0
        self.held: dict[str, _Key] = {}
        self.acks: list[_Key] = []
        self.done = asyncio.Event()
        self.errors: list[str] = []
        self.inbox = f"_FLOOR.{id(self):x}"
        self._flush_soon = False
        self._ack_soon = False
        self._seq = 0
        self._waiting: dict[str, tuple[str, Any]] = {}
        names = self.names
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{names.token_stream}.{names.consumer}"
        self.read_subject = f"$JS.API.DIRECT.GET.{names.inbox_stream}"
        self.delete_subject = f"$JS.API.STREAM.MSG.DELETE.{names.lease_stream}"
        acquire = header_block({EXPECTED: "0", TTL: "30"})  # the headers QueueIO.compare_and_set sends
        assert acquire is not None
        self.acquire_block = acquire

    async def start(self) -> None:
        replies = await self.nc.subscribe(f"{self.inbox}.>")
        SyncDispatch.install(replies, self._on_reply)
        tokens = await self.nc.subscribe(f"{self.inbox}-pull")
        SyncDispatch.install(tokens, self._on_token)
        self._pull()

    # --- sending: commands appended to the client's pending buffer, written once per loop turn ---

    def _send(self, cmd: bytes) -> None:
        nc = self.nc
        nc._pending.append(cmd)
        nc._pending_data_size += len(cmd)
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        nc = self.nc
        if nc._pending:
            nc._transport.writelines(nc._pending)
            nc._pending = []
            nc._pending_data_size = 0

    def _reply(self, what: str, about: Any) -> str:
        self._seq += 1
        reply = f"{self.inbox}.{self._seq:x}"
        self._waiting[reply] = (what, about)
        return reply

    def _pull(self) -> None:
        """Keep as many tokens asked for as there are free slots, in chunks of at least 4."""
        free = SLOTS - len(self.held) - self.requested
        left = self.total - self.finished - len(self.held) - self.requested
        batch = min(free, left)
        if batch <= 0 or batch < min(4, left):
            return
        self.requested += batch
        body = b'{"batch":%d,"expires":%d}' % (batch, NS)
        self._send(pub_cmd(self.next_subject, f"{self.inbox}-pull", body))

    # --- the key's steps ---

    def _on_token(self, msg: Any) -> None:
        if msg.headers and msg.headers.get(STATUS):  # 408: the pull expired; ask again for what it did not bring
            self.requested -= int(msg.headers.get(PENDING_MESSAGES, "0"))
            self._pull()
            return
        self.requested -= 1
        key = _Key(msg.subject[len(self.names.token_prefix):], msg.reply)
        self.held[key.key] = key
        record = b'{"worker":"floor","sent":%d}' % time.monotonic_ns()
        self._send(hpub_cmd(self.names.lease(key.key), self._reply("lease", key), self.acquire_block, record))
        read = b'{"seq":1,"batch":32,"next_by_subj":"%s"}' % self.names.inbox(key.key).encode()
        self._send(pub_cmd(self.read_subject, self._reply("read", key), read))

    def _on_reply(self, msg: Any) -> None:
        what, about = self._waiting.get(msg.subject, ("", None))
        if about is None:
            self.errors.append(f"a reply nobody waits for, on {msg.subject}")
            return
        if what == "read":
            status = msg.headers.get(STATUS) if msg.headers else None
            if status is None:  # a request; the batch ends with a status line (204 EOB)
                about.reads += 1
                about.last = int(msg.headers["Nats-Sequence"])
                return
            del self._waiting[msg.subject]
            about.read_done = True
            if about.reads != 1:
                self.errors.append(f"key {about.key}: {about.reads} requests read ({status})")
            self._ran(about)
            return
        del self._waiting[msg.subject]
        if what == "acks":  # every token of the batch is gone: the markers go
            for key in about:  # the headers QueueIO.mark_released sends
                block = header_block({ROLLUP: "sub", EXPECTED: str(key.last), TTL: "1", H.RELEASED: "1"})
                assert block is not None
                self._send(hpub_cmd(self.names.inbox(key.key), self._reply("marker", key), block, b""))
            return
        body = json.loads(msg.data)
        if "error" in body:
            self.errors.append(f"key {about.key}: {what}: {body['error']}")
            self._end(about)
        elif what == "lease":
            about.fence = int(body["seq"])
            self._ran(about)
        else:  # the marker is stored: the lease record goes, unanswered
            self._send(pub_cmd(self.delete_subject, "", b'{"seq":%d,"no_erase":true}' % about.fence))
            self._end(about)

    def _ran(self, key: _Key) -> None:
        """Once acquired and read, the request runs (a no-op here) and the token is acked with this
        turn's other keys: plain acks, then one double ack whose reply confirms them all."""
        if not (key.fence and key.read_done):
            return
        self.acks.append(key)
        if not self._ack_soon:
            self._ack_soon = True
            asyncio.get_running_loop().call_soon(self._send_acks)

    def _send_acks(self) -> None:
        self._ack_soon = False
        batch, self.acks = self.acks, []
        *plain, last = batch
        for key in plain:
            self._send(pub_cmd(key.token_reply, "", b"+ACK"))
        self._send(pub_cmd(last.token_reply, self._reply("acks", batch), b"+ACK"))

    def _end(self, key: _Key) -> None:
        del self.held[key.key]
        self.finished += 1
        if self.finished == self.total:
            self.done.set()
        self._pull()


async def _stored(url: str, queue: str, keys: int) -> tuple[Any, QueueConfig]:
    nc = await connect(url, name=f"bench-floor-{queue}")
    config = QueueConfig(queue)
    await Topology(JetStreamApi(nc), config).ensure_worker()
    results = await Publisher(nc, config.names, timeout=10).enqueue_many(interleaved(keys, 1, "f"))
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} requests not stored, first: {failed[0]!r}")
    return nc, config


async def floor(url: str, queue: str, keys: int) -> Figures:
    """The floor on ``keys`` stored cold keys: its rate and this process's CPU per key."""
    nc, config = await _stored(url, queue, keys)
    try:
        work = Floor(nc, config, keys)
        cpu, wall = time.process_time(), time.monotonic()
        await work.start()
        await asyncio.wait_for(work.done.wait(), timeout=max(60.0, keys / 50))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        if work.errors:
            raise RuntimeError(f"the floor: {len(work.errors)} errors, first: {work.errors[0]}")
        info = await JetStreamApi(nc).stream_info(config.names.token_stream)
        if info["state"]["messages"]:
            raise RuntimeError(f"the floor left {info['state']['messages']} tokens")
    finally:
        await nc.close()
    return Figures(keys / wall, cpu / keys * 1e6)


async def main(args: argparse.Namespace) -> None:
    from bench.user_path import core_cold, measure

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        async with EmbeddedServer(store_dir=scratch / "store", log_file=scratch / "log") as server:
            assert server.pid is not None
            rows: list[tuple[Figures, Figures, Figures]] = []
            print(f"cold keys, {args.keys:,} x 1, stored first; keys/s (x raw fetch+ack), worker CPU per key",
                  flush=True)
            print(f"{'round':>5} {'raw fetch+ack':>14} {'floor':>24} {'core alone':>24} {'product path':>24} "
                  f"{'core/floor':>11} {'product/floor':>14}", flush=True)
            for n in range(1, args.rounds + 1):
                ceiling = (await raw.measure(server.url, args.raw)).fetch_ack
                low = await floor(server.url, f"floor{n}", args.keys)
                core = Figures(*await core_cold(server.url, server.monitoring_url, server.pid, args.keys, scratch,
                                                queue=f"core{n}", loop=args.loop))
                rates = await measure(server.url, 0, 0, args.keys, end_to_end=False, loop=args.loop)
                product = Figures(rates.cold, rates.cold_cpu_us)
                rows.append((low, core, product))
                cells = " ".join(f"{f.rate:>7,.0f} ({f.rate / ceiling:.2f}x) {f.cpu_per_key:>6,.0f} us"
                                 for f in (low, core, product))
                print(f"{n:>5} {ceiling:>10,.0f}/s {cells} {core.cpu_per_key / low.cpu_per_key:>10.2f}x "
                      f"{product.cpu_per_key / low.cpu_per_key:>13.2f}x", flush=True)
            if len(rows) > 1:
                def median(i: int) -> float:
                    return statistics.median(r[i].cpu_per_key for r in rows)

                print(f"medians of the CPU per key: floor {median(0):,.0f} us, core alone {median(1):,.0f} us, "
                      f"product path {median(2):,.0f} us")


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.splitlines()[0],
                                     epilog="Example: python -m bench.floor --keys 3000 --rounds 3")
    parser.add_argument("--keys", type=int, default=3000, help="cold keys per run, one request each (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of the four, in turns (default 3)")
    parser.add_argument("--raw", type=int, default=10_000, help="messages of the raw fetch+ack (default 10000)")
    parser.add_argument("--loop", choices=LOOPS, default="auto",
                        help="the event loop of all three (default auto: uvloop where installed)")
    args = parser.parse_args(argv)
    run(main(args), args.loop)


if __name__ == "__main__":
    cli(sys.argv[1:])
