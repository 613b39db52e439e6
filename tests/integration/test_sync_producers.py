"""Sync producers in forked processes (a pre-forking web server's workers): ``delay`` and every sync entry point
work in a child forked from a process that already used them, and never wait without a bound."""

from __future__ import annotations

import asyncio
import os
import select
import signal
from pathlib import Path

import pytest

import keyqueue
from keyqueue.jetstream.api import JetStreamApi


def _app(name: str, url: str) -> keyqueue.App:
    return keyqueue.App(name, url=url, set_as_default=False, autoload_plugins=False)


def _in_child(work: object) -> tuple[int, str]:
    """Fork; the child runs ``work()`` and writes what it returned (or raised) to a pipe. The
    parent reads it, waiting at most 30 s, and returns ``(exit status, what the child wrote)``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            answer = f"ok {work()}"  # type: ignore[operator]
            code = 0
        except BaseException as exc:
            answer, code = f"error {type(exc).__name__}: {exc}", 1
        os.write(write, answer.encode())
        os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not finish within 30 s: its sync call hangs")
        chunks = []
        while chunk := os.read(read, 4096):
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()
    finally:
        os.close(read)


async def _inbox_ids(app: keyqueue.App, queue: str) -> list[str]:
    api = JetStreamApi(await app.connection())
    info = await api.stream_info(f"KQ_{queue}_INBOX")
    found = []
    for seq in range(info["state"]["first_seq"], info["state"]["last_seq"] + 1):
        msg = await api.get_msg(f"KQ_{queue}_INBOX", seq=seq, direct=False)
        if msg is not None:
            found.append(msg.headers["Nats-Msg-Id"])
    return found


def test_delay_works_in_a_child_forked_after_the_parent_used_it(nats_url: str) -> None:
    app = _app("forked", nats_url)

    @app.task(key="{k}")
    async def note(k: str) -> str:
        return k

    try:
        first = note.delay(k="parent")  # the parent's portal thread and connection now exist
        code, said = _in_child(lambda: note.options(request_id="from-the-child").delay(k="child").request_id)
        assert (code, said) == (0, "ok from-the-child"), said
        again = note.delay(k="parent")  # the parent's own portal is untouched by the child
        ids = asyncio.run(_inbox_ids(_app("forked", nats_url), "forked"))
        assert ids == [first.request_id, "from-the-child", again.request_id]
    finally:
        asyncio.run(app.close())


def test_a_sync_call_is_bounded_and_says_what_did_not_finish(tmp_path: Path) -> None:
    # A server that accepts the connection and never answers: the enqueue waits for nothing forever
    # unless the sync call has a bound.
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    app = _app("bounded", f"nats://127.0.0.1:{silent.getsockname()[1]}")

    @app.task(key="{k}")
    async def note(k: str) -> str:
        return k

    try:
        with pytest.raises(keyqueue.SyncTimeout, match=r"note\.delay\(\) did not finish within 0\.5s") as caught:
            app.run_sync(lambda: note.enqueue(k="a"), bound=0.5, what="note.delay()")
        assert isinstance(caught.value, TimeoutError)
    finally:
        silent.close()
        asyncio.run(app.close())
