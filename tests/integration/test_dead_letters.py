"""The DLQ against a real nats-server: every dead request gets its copy, and a replay always ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from click.testing import CliRunner

import keyqueue
from keyqueue.admin.dead_letters import (
    REPLAY_OF,
    TRACEBACK,
    DeadLetter,
    dead_letters,
    delete_dead_letters,
    get_dead_letter,
    replay,
    replay_request,
)
from keyqueue.cli import main
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, dumps, header_block_size
from keyqueue.wire import headers as H

NAMES = QueueNames("shop")


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[keyqueue.App]:
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False)
    try:
        yield app
    finally:
        await app.close()


def request_headers(task: str, request_id: str) -> dict[str, str]:
    return {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: task, H.MESSAGE_VERSION: "1", H.MSG_ID: request_id}


async def publish_raw(url: str, subject: str, header_lines: bytes, body: bytes) -> dict[str, Any]:
    """JetStream-publish a header block nats-py refuses to write (other clients write it, the server
    stores it); returns the publish acknowledgement."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    block = b"NATS/1.0\r\n" + header_lines + b"\r\n"
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\nSUB ack 1\r\n')
        writer.write(b"HPUB %s ack %d %d\r\n%s%s\r\n" % (subject.encode(), len(block), len(block) + len(body),
                                                        block, body))
        await writer.drain()
        while not (line := await asyncio.wait_for(reader.readline(), 10)).startswith(b"MSG "):
            assert not line.startswith(b"-ERR"), line
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
        size = int(line.split()[-1])
        ack: dict[str, Any] = json.loads((await reader.readexactly(size + 2))[:size])
    finally:
        writer.close()
        await writer.wait_closed()
    return ack


async def test_a_request_near_max_payload_with_a_long_error_lands_in_the_dlq_cut_to_fit(
    app: keyqueue.App,
) -> None:
    @app.task(key="{k}", max_attempts=1)
    async def ingest(k: str, blob: str) -> None:
        raise ValueError("this error message is long: " + "e" * 1000)

    @app.task(key="{k}")
    async def echo(k: str) -> str:
        return k

    nc = await app.connection()
    await echo.enqueue(k="warm-up")  # creates the queue's streams
    headers = request_headers("ingest", "big-1")
    room = nc.max_payload - header_block_size(headers) - len(dumps({"k": "k", "blob": ""}, CBOR))
    body = dumps({"k": "k", "blob": "b" * (room - 64)}, CBOR)
    assert nc.max_payload - 64 <= header_block_size(headers) + len(body) < nc.max_payload  # the request fits
    await Publisher(nc, NAMES).enqueue(OutgoingRequest("k", headers, body, "big-1"))
    async with app.worker():
        assert await echo.options(timeout=15).call(k="k") == "k"  # behind it on the same key
    [letter] = await dead_letters(JetStreamApi(nc), "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_type) == ("big-1", "max-attempts", "ValueError")
    assert letter.error_message.startswith("this error message is long: eee")
    assert letter.truncated_from == len(body) and body.startswith(letter.data) and len(letter.data) > room // 2
    assert header_block_size(letter.headers) + len(letter.data) <= nc.max_payload
    assert letter.headers[H.MESSAGE_TYPE] == "ingest"
    skipped: list[DeadLetter] = []
    assert await replay(JetStreamApi(nc), Publisher(nc, NAMES), "shop", on_skipped=skipped.append) == 0
    assert [d.seq for d in skipped] == [letter.seq]  # a cut body is not replayed: it stays in the DLQ
    assert [d.seq for d in await dead_letters(JetStreamApi(nc), "shop")] == [letter.seq]


async def test_a_request_with_a_header_nats_py_refuses_lands_in_the_dlq_with_the_header_escaped(
    app: keyqueue.App, nats_url: str
) -> None:
    @app.task(key="{k}")
    async def check(k: str, ok: bool) -> bool:
        if not ok:
            raise keyqueue.Reject("not ok")
        return ok

    nc = await app.connection()
    await check.enqueue(k="warm-up", ok=True)  # creates the queue's streams
    lines = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode())
                     for name, value in request_headers("check", "odd-1").items())
    ack = await publish_raw(nats_url, NAMES.inbox("k"), lines + b"X-Odd(name): kept\r\n",
                            dumps({"k": "k", "ok": False}, CBOR))
    assert ack["stream"] == NAMES.inbox_stream
    await Publisher(nc, NAMES).schedule("k")
    async with app.worker():
        assert await check.options(timeout=15).call(k="k", ok=True) is True  # behind it on the same key
    [letter] = await dead_letters(JetStreamApi(nc), "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_message) == ("odd-1", "rejected", "not ok")
    assert json.loads(letter.headers[H.DLQ_ESCAPED_HEADERS]) == {"X-Odd(name)": "kept"}
    assert letter.body() == {"k": "k", "ok": False}


async def test_a_copy_the_dlq_refuses_is_stored_minimal_and_the_key_goes_on(app: keyqueue.App) -> None:
    @app.task(key="{k}")
    async def check(k: str, note: str) -> str:
        if note:
            raise keyqueue.Reject("notes are not accepted")
        return k

    nc = await app.connection()
    await check.enqueue(k="warm-up", note="")  # creates the queue's streams
    api = JetStreamApi(nc)
    config = (await api.stream_info(NAMES.dlq_stream))["config"]
    await api.request(f"STREAM.UPDATE.{NAMES.dlq_stream}", {**config, "max_msg_size": 2048})
    await check.options(request_id="long-note").enqueue(k="k", note="n" * 4096)
    async with app.worker():
        assert await check.options(timeout=15).call(k="k", note="") == "k"  # behind it on the same key
    [letter] = await dead_letters(api, "shop", key="k")
    assert (letter.request_id, letter.reason, letter.error_message) == ("long-note", "rejected",
                                                                        "notes are not accepted")
    assert letter.data == b"" and letter.truncated_from is not None and letter.truncated_from > 4096
    assert H.MESSAGE_TYPE not in letter.headers  # only keyqueue's own headers


async def test_two_requests_with_one_request_id_both_land_in_the_dlq_and_replay_under_it(
    app: keyqueue.App,
) -> None:
    app.configure_queue(keyqueue.QueueConfig("shop", duplicate_window=0.5))

    @app.task(key="{k}", max_attempts=1)
    async def fail(k: str, n: int) -> None:
        raise ValueError(f"fail {n}")

    @app.task(key="{k}")
    async def echo(k: str) -> str:
        return k

    same = fail.options(request_id="same")
    await same.enqueue(k="k", n=1)
    # Enqueued again once the inbox has forgotten the id: no event says so, only its window passing
    # (the server drops ids on a timer, so up to about twice the window).
    for _ in range(100):
        if not (await same.enqueue(k="k", n=2)).duplicate:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the inbox still knew the request id 5 s after its 0.5 s duplicate window")
    async with app.worker():
        assert await echo.options(timeout=15).call(k="k") == "k"  # both are dead-lettered by now
    nc = await app.connection()
    api = JetStreamApi(nc)
    letters = await dead_letters(api, "shop")
    assert [(d.request_id, d.error_message) for d in letters] == [("same", "fail 1"), ("same", "fail 2")]
    assert (await get_dead_letter(api, "shop", letters[1].seq)).request_id == "same"  # what `dlq show` prints
    assert await replay(api, Publisher(nc, NAMES), "shop") == 2
    inbox = [m async for page in api.pages(NAMES.inbox_stream, NAMES.inbox("k")) for m in page
             if not H.is_release_marker(m.headers)]  # (the key's last holder left its marker)
    assert [(m.headers[H.MSG_ID], m.headers[REPLAY_OF]) for m in inbox] == [
        (f"same.replay-{letters[0].seq}", "same"), (f"same.replay-{letters[1].seq}", "same")]


async def test_a_replay_ends_at_the_last_dead_request_there_when_it_began(app: keyqueue.App) -> None:
    @app.task(key="{k}", max_attempts=1)
    async def fail(k: str) -> None:
        raise ValueError("still failing")

    nc = await app.connection()
    await fail.enqueue(k="warm-up")  # creates the queue's streams
    arrivals = await nc.subscribe(NAMES.dlq_prefix + ">")
    replayed: list[str] = []

    class DeadAgainAtOnce(Publisher):
        """Returns only once the running worker has dead-lettered the replayed request again."""

        async def enqueue(self, request: OutgoingRequest) -> Enqueued:
            replayed.append(request.request_id)
            assert len(replayed) <= 4, f"replayed a request dead-lettered during the replay: {replayed}"
            stored = await super().enqueue(request)
            await arrivals.next_msg(timeout=10)
            return stored

    async with app.worker():
        for key in ("a", "b", "c"):
            await fail.enqueue(k=key)
        for _ in range(4):
            await arrivals.next_msg(timeout=10)
        api = JetStreamApi(nc)
        assert await asyncio.wait_for(replay(api, DeadAgainAtOnce(nc, NAMES), "shop"), 30) == 4
    letters = await dead_letters(api, "shop")
    assert [d.seq for d in letters] == [5, 6, 7, 8]  # the four replays, dead again, wait for the next replay
    assert all(d.request_id.startswith(d.headers[REPLAY_OF] + ".replay-") for d in letters)


# --- the dlq commands, as a user runs them ----------------------------------------------------------


async def cli(url: str, *args: str, answer: str | None = None) -> tuple[int, str]:
    """``keyqueue ARGS --url URL`` (in a thread: the command runs its own event loop); exit code and stdout."""
    result = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--url", url], input=answer)
    return result.exit_code, result.stdout


async def dead(app: keyqueue.App, *requests: tuple[str, int]) -> list[int]:
    """Run ``(key, n)`` requests of a task that always fails once each; their DLQ sequences, in order."""

    @app.task(key="{k}", max_attempts=1, name="fail")
    async def fail(k: str, n: int) -> None:
        raise ValueError(f"fail {n}")

    nc = await app.connection()
    await fail.options(request_id="warm-up").enqueue(k="warm-up", n=0)  # creates the queue's streams
    arrivals = await nc.subscribe(NAMES.dlq_prefix + ">")
    async with app.worker():
        await arrivals.next_msg(timeout=10)  # the warm-up's
        for k, n in requests:  # one at a time: keys run in parallel, and the DLQ order is the point
            await fail.options(request_id=f"{k}-{n}").enqueue(k=k, n=n)
            await arrivals.next_msg(timeout=10)
    await arrivals.unsubscribe()
    letters = await dead_letters(JetStreamApi(nc), "shop")
    assert letters[0].key == "warm-up"
    await delete_dead_letters(JetStreamApi(nc), "shop", [letters[0].seq])
    return [d.seq for d in letters[1:]]


async def dlq_seqs(app: keyqueue.App) -> list[int]:
    return [d.seq for d in await dead_letters(JetStreamApi(await app.connection()), "shop")]


async def test_dlq_delete_and_purge_remove_dead_requests(app: keyqueue.App, nats_url: str) -> None:
    s1, s2, s3 = await dead(app, ("a", 1), ("a", 2), ("b", 3))

    assert await cli(nats_url, "dlq", "delete", "shop", str(s1), "999") == (1, "")
    result = await asyncio.to_thread(CliRunner().invoke, main, ["dlq", "delete", "shop", "999", "--url", nats_url])
    assert result.output == "Error: queue shop has no dead request at sequence 999; nothing was changed\n"
    assert await dlq_seqs(app) == [s1, s2, s3]
    assert await cli(nats_url, "dlq", "delete", "shop", str(s1)) == (0, "deleted 1 dead request(s) from queue shop\n")
    assert await dlq_seqs(app) == [s2, s3]

    code, out = await cli(nats_url, "dlq", "purge", "shop", "--key", "a", answer="n\n")
    assert code == 1 and out.startswith("Remove 1 dead request(s) from queue shop (key a)? ")
    assert await dlq_seqs(app) == [s2, s3]
    code, out = await cli(nats_url, "dlq", "purge", "shop", "--key", "a", answer="y\n")
    assert code == 0 and out.endswith("\nremoved 1 dead request(s) from queue shop (key a)\n")
    assert await dlq_seqs(app) == [s3]
    assert await cli(nats_url, "dlq", "purge", "shop", "--yes") == (0, "removed 1 dead request(s) from queue shop\n")
    assert await cli(nats_url, "dlq", "purge", "shop", "--yes") == (0, "no dead requests in queue shop\n")


async def test_dlq_replay_takes_chosen_sequences_in_order_and_a_dry_run_changes_nothing(
    app: keyqueue.App, nats_url: str
) -> None:
    s1, s2, s3 = await dead(app, ("a", 1), ("b", 2), ("c", 3))
    api = JetStreamApi(await app.connection())

    code, out = await cli(nats_url, "dlq", "replay", "shop", "--dry-run")
    assert code == 0
    assert out.splitlines() == [
        "SEQ  KEY  TASK  REPLAYED AS",
        f"{s1:<3}  a    fail  a-1.replay-{s1}",
        f"{s2:<3}  b    fail  b-2.replay-{s2}",
        f"{s3:<3}  c    fail  c-3.replay-{s3}",
        "would replay 3 request(s); nothing was changed (--dry-run)",
    ]
    assert await dlq_seqs(app) == [s1, s2, s3]
    inbox_before = int((await api.stream_info(NAMES.inbox_stream))["state"]["last_seq"])

    assert (await cli(nats_url, "dlq", "replay", "shop", "--seq", "999", "--seq", str(s1)))[0] == 1
    assert await dlq_seqs(app) == [s1, s2, s3]  # one missing: nothing replayed

    assert await cli(nats_url, "dlq", "replay", "shop", "--seq", str(s3), "--seq", str(s1)) == (
        0, "replayed 2 request(s)\n")
    assert await dlq_seqs(app) == [s2]
    stored = []
    seq = inbox_before + 1
    while (msg := await api.get_msg(NAMES.inbox_stream, seq=seq, next_by_subject=NAMES.inbox_prefix + ">")) is not None:
        stored.append(msg.headers[H.MSG_ID])
        seq = msg.seq + 1
    assert stored == [f"a-1.replay-{s1}", f"c-3.replay-{s3}"]  # oldest first, whatever order they were named in


async def test_dlq_show_is_readable_with_the_traceback_when_there_is_one_and_json_on_request(
    app: keyqueue.App, nats_url: str
) -> None:
    [seq] = await dead(app, ("a", 1))
    code, out = await cli(nats_url, "dlq", "show", "shop", str(seq))
    assert code == 0
    lines = out.splitlines()
    assert lines[:2] == [f"seq:           {seq}", "key:           a"]
    assert "task:          fail (version 1)" in lines and "request id:    a-1" in lines
    assert "reason:        max-attempts" in lines and "attempts:      1" in lines
    assert "error:         ValueError: fail 1" in lines
    # The worker recorded where the task failed.
    shown = lines[lines.index("traceback:") + 1:]
    assert shown[0] == "  Traceback (most recent call last):" and shown[-1] == "  ValueError: fail 1"
    assert any("in fail" in line for line in shown), shown
    assert lines[lines.index("arguments:"):][:5] == ["arguments:", "  {", '    "k": "a",', '    "n": 1', "  }"]

    # Whatever X-KQ-DLQ-Traceback carries is shown line by line.
    nc = await app.connection()
    letter = await get_dead_letter(JetStreamApi(nc), "shop", seq)
    trace = 'Traceback (most recent call last):\n  File "shop.py", line 3, in fail\nValueError: fail 1\n'
    headers = {**letter.headers, H.MSG_ID: "with-traceback", TRACEBACK: json.dumps(trace)}
    with_trace = (await nc.jetstream().publish(NAMES.dlq("a"), letter.data, headers=headers)).seq
    code, out = await cli(nats_url, "dlq", "show", "shop", str(with_trace))
    assert code == 0 and out.splitlines()[-4:] == [
        "traceback:", "  Traceback (most recent call last):", '    File "shop.py", line 3, in fail',
        "  ValueError: fail 1"]

    code, out = await cli(nats_url, "dlq", "show", "shop", str(with_trace), "--json")
    shown = json.loads(out)
    assert code == 0 and {k: shown[k] for k in ("seq", "key", "request_id", "task", "version", "attempts", "arguments",
                                                 "error_type", "error_message", "traceback")} == {
        "seq": with_trace, "key": "a", "request_id": "a-1", "task": "fail", "version": 1, "attempts": 1,
        "arguments": {"k": "a", "n": 1}, "error_type": "ValueError", "error_message": "fail 1", "traceback": trace}
    assert isinstance(shown["original_seq"], int) and shown["headers"][H.DLQ_REASON] == "max-attempts"


async def test_dlq_list_says_when_the_limit_hides_some_and_speaks_json(app: keyqueue.App, nats_url: str) -> None:
    s1, s2, _ = await dead(app, ("a", 1), ("a", 2), ("b", 3))
    code, out = await cli(nats_url, "dlq", "list", "shop", "--limit", "2")
    assert code == 0 and out.splitlines()[-1] == "... and 1 more; --limit to see them" and len(out.splitlines()) == 4
    code, out = await cli(nats_url, "dlq", "list", "shop", "--key", "a", "--limit", "1")
    assert code == 0 and out.splitlines()[-1] == "... and 1 more; --limit to see them"
    code, out = await cli(nats_url, "dlq", "list", "shop")
    assert code == 0 and "more" not in out and len(out.splitlines()) == 4

    code, out = await cli(nats_url, "dlq", "list", "shop", "--limit", "2", "--json")
    listed = json.loads(out)
    assert code == 0 and (listed["queue"], listed["key"], listed["total"]) == ("shop", None, 3)
    first = listed["dead_letters"][0]
    assert [d["seq"] for d in listed["dead_letters"]] == [s1, s2]
    assert sorted(first) == ["attempts", "dead_lettered_at", "error_message", "error_type", "key", "original_seq",
                             "reason", "request_id", "seq", "task", "truncated_from", "version"]
    assert (first["attempts"], first["version"], first["truncated_from"]) == (1, 1, None)
    assert isinstance(first["original_seq"], int)
    code, out = await cli(nats_url, "dlq", "list", "shop", "--key", "zzz", "--json")
    assert json.loads(out) == {"queue": "shop", "key": "zzz", "total": 0, "dead_letters": []}


async def test_a_replayed_request_that_dies_again_is_replayed_under_its_id_with_the_suffix_replaced(
    app: keyqueue.App, nats_url: str
) -> None:
    [first] = await dead(app, ("a", 1))
    nc = await app.connection()
    api = JetStreamApi(nc)
    arrivals = await nc.subscribe(NAMES.dlq_prefix + ">")
    assert await cli(nats_url, "dlq", "replay", "shop") == (0, "replayed 1 request(s)\n")
    async with app.worker():  # the replayed request fails again
        await arrivals.next_msg(timeout=10)
    [again] = await dead_letters(api, "shop")
    assert again.request_id == f"a-1.replay-{first}"

    # A replay interrupted after storing it and before removing it from the DLQ...
    assert not (await Publisher(nc, NAMES).enqueue(replay_request(again))).duplicate
    # ...run again, stores it once.
    assert await cli(nats_url, "dlq", "replay", "shop") == (0, "replayed 1 request(s)\n")
    stored_a = [m async for page in api.pages(NAMES.inbox_stream, NAMES.inbox("a")) for m in page
                if not H.is_release_marker(m.headers)]
    assert len(stored_a) == 1
    stored = await api.get_msg(NAMES.inbox_stream, last_by_subject=NAMES.inbox("a"))
    assert stored is not None and stored.headers[H.MSG_ID] == f"a-1.replay-{again.seq}"
    assert stored.headers[REPLAY_OF] == f"a-1.replay-{first}"
