"""``keyqueue watch`` and ``keyqueue events tail`` as a user runs them, against a real nats-server."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from click.testing import CliRunner
from nats.aio.client import Client

from keyqueue.cli import main
from keyqueue.events import ensure_events_stream, event, events_subject, register_event_names
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig, Topology
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H

KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))
NAMES = QueueNames("shop")


def environment(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    return {**env, "KEYQUEUE_URL": url, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
async def shop(nats_url: str) -> AsyncIterator[Client]:
    """A connection to a server that has queue ``shop``."""
    nc = await nats.connect(nats_url)
    try:
        await Topology(JetStreamApi(nc), QueueConfig("shop")).ensure()
        yield nc
    finally:
        await nc.close()


class Follower:
    """``keyqueue ARGS`` in a subprocess, started once its banner says it is subscribed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str, *args: str) -> Follower:
        proc = await asyncio.create_subprocess_exec(KEYQUEUE, *args, env=environment(url),
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stderr is not None
        banner = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert banner.startswith(("watching", "tailing")), banner + (await proc.stderr.read()).decode()
        return cls(proc)

    async def finish(self) -> tuple[int, list[str]]:
        """Wait for the command to end by itself; its exit code and its stdout lines."""
        out, err = await asyncio.wait_for(self.proc.communicate(), 30)
        assert self.proc.returncode is not None, err
        return self.proc.returncode, out.decode().splitlines()


async def test_events_tail_count_prints_exactly_that_many_of_a_burst(shop: Client, nats_url: str) -> None:
    tail = await Follower.start(nats_url, "events", "tail", "shop", "--count", "3")
    # One burst: the events arrive in one read, as a busy worker's do.
    for n in range(40):
        body = event("enqueued", 1_700_000_000 + n, "shop", key=f"k{n}", request_id=f"r{n}")
        await shop.publish(events_subject("shop", "enqueued"), dumps(body, CBOR), headers={H.CONTENT_TYPE: CBOR})
    await shop.flush()
    code, lines = await tail.finish()
    assert code == 0
    assert [line.split()[1:3] for line in lines] == [["enqueued", "k0"], ["enqueued", "k1"], ["enqueued", "k2"]]


async def test_watch_takes_nats_and_shell_wildcards(shop: Client, nats_url: str) -> None:
    async def progress(*keys: str) -> None:
        for key in keys:
            await shop.publish(NAMES.progress(key), dumps({"at": key}, CBOR), headers={H.CONTENT_TYPE: CBOR})
        await shop.flush()

    shell = await Follower.start(nats_url, "watch", "shop", "acc*", "--count", "2")
    await progress("other", "acc.1", "acc1", "xacc", "accounts")
    code, lines = await shell.finish()
    assert code == 0 and [line.split()[1] for line in lines] == ["acc1", "accounts"]

    tokens = await Follower.start(nats_url, "watch", "shop", "acc.*", "--count", "1")
    await progress("acc1", "acc.1.2", "acc.7")
    code, lines = await tokens.finish()
    assert code == 0 and [line.split()[1] for line in lines] == ["acc.7"]

    rest = await Follower.start(nats_url, "watch", "shop", ">", "--count", "2")
    await progress("o1", "w1.cs9")
    code, lines = await rest.finish()
    assert code == 0 and [line.split()[1] for line in lines] == ["o1", "w1.cs9"]


@pytest.mark.parametrize(("pattern", "problem"), [
    ("acc.>.x", "'>' may only be the last token"),
    ("acc>", "'>' may not be part of a token"),
    ("acc..1", "it has an empty token (leading, trailing or doubled '.')"),
    ("a b", "' ' may not be part of a token"),
])
def test_watch_refuses_a_bad_pattern_with_one_line_saying_which_wildcards_work(
        pattern: str, problem: str) -> None:
    result = CliRunner().invoke(main, ["watch", "shop", pattern, "--url", "nats://127.0.0.1:1"])
    assert result.exit_code == 1, result.output
    assert result.output == (f"Error: key pattern {pattern!r} is not valid: {problem}; '*' as a whole token matches "
                             "one token (orders.*), '>' as the last token matches the rest (orders.>, or > for every "
                             "key), and '*', '?', '[...]' inside a token match within it (acc*)\n")


@pytest.mark.parametrize("args", [["watch", "nosuch", "o1"], ["events", "tail", "nosuch"]])
def test_an_unknown_queue_is_refused_at_once_naming_the_queues(args: list[str], shop: Client, nats_url: str) -> None:
    # The old commands waited silently: --timeout makes them end (and fail this test) instead of hanging.
    result = CliRunner().invoke(main, [*args, "--timeout", "5", "--url", nats_url])
    assert result.exit_code == 1, result.output
    assert result.output == ("Error: queue 'nosuch' does not exist on this server; queues: shop "
                             "(check the name, and --url or KEYQUEUE_URL)\n")


def test_an_unknown_event_name_is_refused_naming_the_known_ones(shop: Client, nats_url: str) -> None:
    register_event_names("kq_test_step")  # as a plugin does when it is imported

    async def publish_elsewhere() -> None:
        # An event a plugin installed elsewhere published: the stream holds it, so it is known too.
        nc = await nats.connect(nats_url)
        try:
            await ensure_events_stream(nc, "shop")
            await nc.jetstream().publish(events_subject("shop", "elsewhere_step"), b"")
        finally:
            await nc.close()

    asyncio.run(publish_elsewhere())

    def tail(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["events", "tail", "shop", *args, "--timeout", "0.1", "--url", nats_url])
        return result.exit_code, result.output

    code, output = tail("-e", "started", "-e", "strated")
    assert code == 1, output
    assert output.count("\n") == 1 and output.startswith("Error: unknown event 'strated'; the events of queue shop "
                                                         "are: enqueued, acquired, started, ")
    assert output.rstrip().endswith(", kq_test_step, elsewhere_step")
    for name in ("kq_test_step", "elsewhere_step"):
        assert tail("-e", name) == (0, "tailing events of shop (Ctrl-C to stop)\n")
