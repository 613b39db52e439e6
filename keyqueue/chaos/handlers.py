"""The handler shapes a chaos worker runs, the run log they write, and the requests that choose them.

Users write handlers of several shapes, and each keeps (or breaks) the one-holder promise in its
own way; the soak's workload runs every shape it is given (``--handlers``, :data:`HANDLERS`):

    async     an ``async def`` that awaits (``asyncio.sleep``) on the worker's event loop
    thread    a plain ``def`` in a thread, through ``Task.run`` as keyqueue's default processor runs
              a sync task (``keyqueue.tasks.invoke``)
    process   the same ``def`` in a child process of keyqueue's process pool
              (``keyqueue.app.process_pool``, what ``keyqueue worker --pool processes`` uses)
    gil       the ``def`` in a thread, holding the GIL in C code for 1.5x the lease before it
              works (:func:`hold_gil`): the event loop, its renewals and the loop watchdog all stop
    blocking  an ``async def`` that blocks its event loop (``time.sleep``) for 1.5x the lease
    bad-input requests the worker must refuse (:data:`BAD_INPUTS`), mixed in by the producer

A request's body is JSON ``{"tag": ..., "sleep": seconds, "shape": ...}``, with ``"block":
seconds`` on a request flagged to stall (``gil``, ``blocking``) or to be slow (``thread``,
``process``: its body sleeps that much longer): only the request's first run in the whole fleet
does (claimed with a marker file beside the log), so the key makes progress.

The sync shapes log their own ``enter`` and ``leave`` records from inside the thread or child
(with its ``pid``; ``"child": true`` from a pool child), and the worker logs ``reaped`` once the
pool has the child's answer or has killed and joined it: the checker counts a run until its body
really ended (:mod:`keyqueue.chaos.checker`).
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections.abc import Mapping
from typing import Any, Final

from keyqueue.app.application import App
from keyqueue.chaos.clock import TRUE_TIME
from keyqueue.core.processor import Request
from keyqueue.errors import MalformedBody, UnknownMessageType, UnsupportedVersion
from keyqueue.wire import headers as H
from keyqueue.wire.envelope import peek

__all__ = ["BAD_INPUTS", "FOREIGN_ACK_SID", "HANDLERS", "RUNNING", "SHAPES", "SLOW", "STALLING", "WORK_TYPE",
           "RunLog", "app", "bad_request", "foreign_subjects", "hold_gil", "read_work", "sync_fields", "sync_work",
           "work_headers"]

SHAPES: Final = ("async", "thread", "process", "gil", "blocking")
"""Handler shapes; ``async`` is the shape of a request when no running shape is chosen."""
RUNNING: Final = ("async", "thread", "process")
"""Shapes every request may take (drawn per request)."""
STALLING: Final = ("gil", "blocking")
"""Shapes only flagged requests take: their first run stalls the worker for 1.5x the lease."""
SLOW: Final = ("thread", "process")
"""Running shapes that flagged requests take too: their first run's body sleeps 1.5x the lease more
(the session renews meanwhile; a fault that costs the lease meets a body that cannot be cut off)."""
HANDLERS: Final = (*SHAPES, "bad-input")
"""What ``--handlers`` accepts (``all``: every one)."""
BAD_INPUTS: Final = ("malformed-body", "unknown-type", "bad-version", "long-inbox", "foreign-subject")
"""Bad input the producer mixes in: requests with a body that is not JSON, an unknown
``X-MESSAGE-TYPE``, an ``X-MESSAGE-VERSION`` newer than the worker reads, a 5 KiB ``X-Reply-Inbox``
(over nats-server's 4 KiB control line: a reply to it would close the connection); and
``foreign-subject``: what no NATS client library writes, sent over a bare connection
(:func:`foreign_subjects`)."""

WORK_TYPE: Final = "chaos.work"
"""The ``X-MESSAGE-TYPE`` of the soak's requests."""
WORK_VERSION: Final = 1
"""The only ``X-MESSAGE-VERSION`` a chaos worker reads."""
LONG_INBOX_BYTES: Final = 5 * 1024


class RunLog:
    """Appends JSON lines to the shared run log (one ``write`` per line: O_APPEND keeps lines whole)."""

    def __init__(self, path: str, worker: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.path = path
        self.worker = worker

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"w": self.worker, "kind": kind, "t": TRUE_TIME(), **fields}, default=str)
        os.write(self.fd, (line + "\n").encode())


# --- requests ------------------------------------------------------------------------------------


def work_headers(request_id: str) -> dict[str, str]:
    """The headers of a good request."""
    return {H.MSG_ID: request_id, H.CONTENT_TYPE: H.JSON, H.MESSAGE_TYPE: WORK_TYPE,
            H.MESSAGE_VERSION: str(WORK_VERSION)}


def bad_request(kind: str, request_id: str, tag: str) -> tuple[dict[str, str], bytes]:
    """Headers and body of a bad request of ``kind`` (:data:`BAD_INPUTS`)."""
    headers = work_headers(request_id)
    body = json.dumps({"tag": tag, "sleep": 0.0}).encode()
    if kind == "malformed-body":
        body = b'{"tag": "' + tag.encode() + b'", not json'
    elif kind == "unknown-type":
        headers[H.MESSAGE_TYPE] = "chaos.nonesuch"
    elif kind == "bad-version":
        headers[H.MESSAGE_VERSION] = str(WORK_VERSION + 98)
    elif kind == "long-inbox":
        headers[H.REPLY_INBOX] = "_INBOX." + "x" * (LONG_INBOX_BYTES - len("_INBOX."))
    else:
        requests = [k for k in BAD_INPUTS if k != "foreign-subject"]  # (not a request: foreign_subjects)
        raise ValueError(f"unknown bad request {kind!r}; choose from {', '.join(requests)}")
    return headers, body


FOREIGN_ACK_SID: Final = 1
"""The subscription id :func:`foreign_subjects` opens for the foreign token's PubAck."""


def foreign_subjects(queue: str, n: int) -> tuple[bytes, str]:
    """Protocol lines a publisher other than keyqueue can send on a queue's subjects, none of them
    UTF-8 where a client library reads text, and the key a worker sees for its token.

    A core message on the cancel subject every worker subscribes to, a request with a reply subject
    that is not UTF-8, a header block whose status line is not UTF-8, and a token stored in the
    token stream on a subject that is not UTF-8 (``kq.<queue>.tok.\\xff\\xfe<n>``): it is delivered to
    a worker, which reads its key with ``\\xNN`` escapes, finds no request and gives the key back.
    Each once dropped the connection of every worker that read it. The token asks for its PubAck
    (subscription :data:`FOREIGN_ACK_SID`): a stream with no leader drops it without a word."""
    raw_key = b"\xff\xfe" + str(n).encode()
    status = b"NATS/1.0 \xff\xfe\xfd\r\n\r\n"
    prefix = f"kq.{queue}.".encode()
    ack = b"_INBOX.foreign." + str(n).encode()
    lines = (b"PUB " + prefix + b"cancel." + raw_key + b" 0\r\n\r\n"
             + b"PUB " + prefix + b"ask.foreign-" + str(n).encode() + b" _INBOX.\xff" + raw_key + b" 0\r\n\r\n"
             + b"HPUB " + prefix + b"ask.foreign-" + str(n).encode() + b" %d %d\r\n%s\r\n" % (
                 len(status), len(status), status)
             + b"SUB " + ack + b" %d\r\n" % FOREIGN_ACK_SID
             + b"PUB " + prefix + b"tok." + raw_key + b" " + ack + b" 0\r\n\r\n")
    return lines, raw_key.decode(errors="backslashreplace")


def read_work(request: Request) -> dict[str, Any]:
    """A request's work, or the ``WireError`` that dead-letters it (as keyqueue's task processor does)."""
    envelope = peek(request.headers)
    if envelope.message_type != WORK_TYPE:
        raise UnknownMessageType(envelope.message_type, (WORK_TYPE,))
    if envelope.version > WORK_VERSION:
        raise UnsupportedVersion(WORK_TYPE, envelope.version, WORK_VERSION)
    try:
        work = json.loads(request.data)
    except ValueError as e:
        raise MalformedBody(f"{WORK_TYPE}: the body is not JSON ({e})") from None
    if not isinstance(work, dict) or not isinstance(work.get("tag"), str) or work.get("shape", "async") not in SHAPES:
        raise MalformedBody(f"{WORK_TYPE}: the body needs a text tag and a shape of {', '.join(SHAPES)}")
    return work


# --- the sync handler ----------------------------------------------------------------------------

app = App("chaos", autoload_plugins=False, set_as_default=False)
"""The app whose sync task the ``thread``, ``gil`` and ``process`` shapes run (a pool child imports
it as ``keyqueue.chaos.handlers:app``)."""

_LOGS: dict[tuple[str, str], RunLog] = {}


@app.task(key="{key}", name="chaos.sync")
def sync_work(log: str, w: str, key: str, tag: str, shape: str, sleep: float, hold: float = 0.0) -> None:
    """The body of a sync run: ``enter``, hold the GIL ``hold`` seconds (``blocked`` ..
    ``unblocked``), sleep, ``leave`` (never logged when the process dies first: its death ends the run)."""
    run_log = _LOGS.get((log, w)) or _LOGS.setdefault((log, w), RunLog(log, w))
    child = shape == "process"
    run_log.write("enter", key=key, tag=tag, shape=shape, pid=os.getpid(), child=child)
    try:
        if hold:
            run_log.write("blocked", key=key, tag=tag, seconds=hold, gil=True)
            hold_gil(hold)
            run_log.write("unblocked", key=key, tag=tag)
        time.sleep(sleep)
    finally:
        run_log.write("leave", key=key, tag=tag, pid=os.getpid(), child=child)


def hold_gil(seconds: float) -> None:
    """Stay in one C call for ``seconds`` without releasing the GIL, as ``sum(range(n))``, a big
    ``json.loads`` or a backtracking regex do while they compute: libc's ``usleep`` called through
    ``ctypes.PyDLL``, which keeps the GIL. Unlike a computation it takes exactly as long whatever the
    machine's load, and no core."""
    ctypes.PyDLL(None).usleep(ctypes.c_uint(int(seconds * 1_000_000)))


def sync_fields(log: str, w: str, key: str, work: Mapping[str, Any], shape: str, stall: float) -> dict[str, Any]:
    """The arguments of :func:`sync_work` for one run; ``stall``: seconds this run holds the GIL
    (``gil``) or sleeps longer (``thread``, ``process``)."""
    sleep = float(work.get("sleep", 0.0)) + (stall if shape in SLOW else 0.0)
    return {"log": log, "w": w, "key": key, "tag": str(work["tag"]), "shape": shape, "sleep": sleep,
            "hold": stall if shape == "gil" else 0.0}
