"""Fuzzed requests against a live worker on a real nats-server: each header and the body of a
valid request mutated (over-long and malformed reply inboxes, bad message types and versions,
garbage CBOR and JSON, huge values), one request per key. Each must be done or dead-lettered with
a reason; no request may end the worker or close its connection; and a good key beside them keeps
running, its requests completing in order.

Hypothesis drives a sync test; the worker, its app and the producer live on one event loop in a
thread (``keyqueue.app.portal.Portal``), started once for all the examples.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyqueue
from keyqueue.app.portal import Portal
from keyqueue.app.worker import Worker
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.wire import CBOR, JSON, dumps
from keyqueue.wire import headers as H

NAMES = QueueNames("fuzz")
BOUND = 30.0
"""Seconds any one step may take before the test fails (a worker that stopped answering)."""


class Outcomes:
    """The worker's lifecycle hooks: each request's outcome, by key (one request per fuzzed key)."""

    def __init__(self) -> None:
        self.by_key: dict[str, tuple[str, str, str]] = {}
        self.changed: asyncio.Condition | None = None

    async def _record(self, key: str, outcome: tuple[str, str, str]) -> None:
        self.by_key.setdefault(key, outcome)
        assert self.changed is not None
        async with self.changed:
            self.changed.notify_all()

    @keyqueue.hookimpl
    async def keyqueue_request_succeeded(self, key: str) -> None:
        await self._record(key, ("succeeded", "", ""))

    @keyqueue.hookimpl
    async def keyqueue_request_superseded(self, key: str, superseded_by: str) -> None:
        await self._record(key, ("superseded", superseded_by, ""))

    @keyqueue.hookimpl
    async def keyqueue_request_dead_lettered(self, key: str, reason: str, error: str) -> None:
        await self._record(key, ("dead-lettered", reason, error))

    async def of(self, key: str) -> tuple[str, str, str]:
        assert self.changed is not None
        async with asyncio.timeout(BOUND), self.changed:
            await self.changed.wait_for(lambda: key in self.by_key)
        return self.by_key[key]


@dataclass
class Live:
    portal: Portal
    app: keyqueue.App
    worker: Worker
    outcomes: Outcomes
    step: Any
    good: list[int] = field(default_factory=list)
    keys: Iterator[int] = field(default_factory=itertools.count)

    def run(self, coro: Any) -> Any:
        return self.portal.run(coro, BOUND, "a step of the fuzz test")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = tmp_path_factory.mktemp("fuzz")
    server = EmbeddedServer(store_dir=folder / "store", log_file=folder / "nats-server.log")
    server.start_sync()
    portal = Portal()
    outcomes = Outcomes()
    app = keyqueue.App("fuzz", url=server.url, set_as_default=False, autoload_plugins=False, plugins=[outcomes],
                       result_ttl=60)  # results kept: a record whose subject holds the request id
    good: list[int] = []

    @app.task(key="{k}", max_attempts=2, backoff=0.01)
    async def step(k: str, n: int) -> int:
        if k == "good":
            good.append(n)
        return n

    async def start() -> Worker:
        outcomes.changed = asyncio.Condition()
        await step.enqueue(k="warm-up", n=0)  # creates the queue's streams
        worker = app.worker(concurrency=8, ack_wait=5)
        await worker.start()
        return worker

    worker = portal.run(start(), BOUND, "starting the worker")
    try:
        yield Live(portal, app, worker, outcomes, step, good)
    finally:
        portal.run(worker.stop(), BOUND, "stopping the worker")
        portal.run(app.close(), BOUND, "closing the app")
        portal.close()
        server.stop_sync()


# --- what a hostile producer writes ----------------------------------------------------------------

_VALUE_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n")
header_text = st.text(_VALUE_CHARS, max_size=64)
huge_text = st.integers(4_000, 9_000).map(lambda n: "x" * n)
reply_inboxes = st.one_of(
    huge_text.map(lambda x: "_INBOX." + x),                            # over the max control line
    st.sampled_from(["_INBOX..1", "_INBOX.1.", ".", "_INBOX.a b", "_INBOX.a\tb", "_INBOX.*", "_INBOX.>",
                     "_INBOX.\x00", "_INBOX.\x7f", " "]),
    header_text,
    st.just("_INBOX.nobody.listens"),                                 # valid: answered, to nobody
)
message_types = st.one_of(st.sampled_from(["", "nope", "step.result", "STEP"]), header_text, huge_text)
versions = st.one_of(st.sampled_from(["", "0", "-1", "2", "1.0", "99999999999999999999999", "x"]), header_text)
content_types = st.one_of(st.sampled_from(["", JSON, "application/xml", CBOR + "; charset=x"]), header_text)
request_ids = st.one_of(huge_text, header_text.filter(bool))
expiries = st.one_of(st.sampled_from(["", "yesterday", "2000-01-01T00:00:00+00:00", "9999-12-31T23:59:59"]),
                     header_text)
bodies = st.one_of(
    st.binary(max_size=256),                                          # garbage
    st.just(b"\xa1\x61k"),                                            # CBOR cut short
    st.just(b'{"k": "x", "n": 1}'),                                   # JSON under a CBOR content type
    st.just(dumps({"k": "x"}, CBOR)),                                 # a field missing
    st.just(dumps({"k": "x", "n": "one"}, CBOR)),                     # a field of the wrong type
    st.just(dumps({"k": "x", "n": 1, "extra": True}, CBOR)),          # a field too many
    st.integers(64_000, 300_000).map(lambda n: dumps({"k": "x", "n": "9" * n}, CBOR)),  # huge
    st.just(dumps([1, 2, 3], CBOR)),                                  # not a mapping
)
MUTABLE = {H.REPLY_INBOX: reply_inboxes, H.MESSAGE_TYPE: message_types, H.MESSAGE_VERSION: versions,
           H.CONTENT_TYPE: content_types, H.MSG_ID: request_ids, H.EXPIRES: expiries,
           H.TRACEPARENT: header_text}


@st.composite
def hostile(draw: st.DrawFn) -> tuple[dict[str, str], bytes | None]:
    """Headers of a valid request with at least one mutated, dropped or added; maybe another body."""
    mutated = draw(st.sets(st.sampled_from(sorted(MUTABLE)), min_size=1, max_size=3))
    headers = {name: draw(MUTABLE[name]) for name in mutated}
    dropped = draw(st.sets(st.sampled_from([H.CONTENT_TYPE, H.MESSAGE_TYPE, H.MESSAGE_VERSION]), max_size=1))
    headers.update({name: "" for name in dropped})
    body = draw(st.one_of(st.none(), bodies))
    return headers, body


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=hostile())
def test_no_fuzzed_request_stops_the_worker_and_a_good_key_keeps_running(
    live: Live, request: tuple[dict[str, str], bytes | None]
) -> None:
    mutated, body = request
    n = next(live.keys)
    key = f"bad{n}"
    request_id = f"fuzz-{n}"
    headers = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: "step", H.MESSAGE_VERSION: "1", H.MSG_ID: request_id}
    for name, value in mutated.items():
        if value:
            headers[name] = value
        else:
            headers.pop(name, None)
    if mutated.get(H.MSG_ID):
        headers[H.MSG_ID] = f"{mutated[H.MSG_ID]}{n}"  # mutated, yet not a duplicate of an earlier example
    data = body if body is not None else dumps({"k": key, "n": n}, CBOR)

    async def example() -> None:
        nc = await live.app.connection()
        stored = await Publisher(nc, NAMES).enqueue(OutgoingRequest(key, headers, data, headers.get(H.MSG_ID, "")))
        assert not stored.duplicate
        outcome, reason, error = await live.outcomes.of(key)
        if outcome == "dead-lettered":
            assert reason and error, (headers, outcome, reason, error)
        # A good key beside them: its request of this example runs, after all of its earlier ones.
        assert await live.step.options(timeout=BOUND).call(k="good", n=n) == n
        assert live.good == sorted(live.good) and live.good[-1] == n
        assert not nc.is_closed and nc.last_error is None, nc.last_error
        assert live.worker._runner is not None and not live.worker._runner.done()

    live.run(example())
