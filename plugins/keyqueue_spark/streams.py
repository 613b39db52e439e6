"""A queue's streams as the Spark plugin reads and writes them, on keyqueue's extension API.

Reading: :func:`stream_bounds` and :func:`read_range` (any stream, by sequence range),
:func:`decode_message` (lenient: a message that does not decode is a row with its reason).
Writing: :func:`request_message` and :func:`enqueue_many` (requests as keyqueue's task API
writes them), :func:`publish_events` (events in the format of :mod:`keyqueue.events`). Every
function is a coroutine meant to run inside ``asyncio.run`` on a Spark executor or driver:
nothing here outlives one call's event loop except the connection its caller closes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from nats.aio.msg import Msg

from keyqueue import QueueConfig
from keyqueue.errors import ConsumerNotFound, EnqueueError, KeyqueueError, StreamNotFound, WireError
from keyqueue.events import EVENT_HEADERS, events_stream, events_subject
from keyqueue.ext import (
    Client,
    Enqueued,
    JetStreamApi,
    OutgoingRequest,
    Publisher,
    QueueNames,
    Topology,
    connect,
    parse_pub_ack,
    validate_key,
)
from keyqueue.wire import CBOR, dumps, loads_map, new_request_id
from keyqueue.wire.headers import CONTENT_TYPE, DLQ_REQUEST_ID, MESSAGE_TYPE, MESSAGE_VERSION, MSG_ID

__all__ = [
    "DEFAULT_URL",
    "Decoded",
    "StoredMessage",
    "StreamBounds",
    "connect_to",
    "decode_message",
    "encode_fields",
    "enqueue_many",
    "ensure_queue",
    "key_of_subject",
    "publish_events",
    "read_range",
    "request_message",
    "stream_bounds",
    "stream_name",
]

DEFAULT_URL: Final = "nats://127.0.0.1:4222"
"""Where the plugin connects when neither the ``url`` option nor ``KEYQUEUE_URL`` says."""

_CONSUMER_IDLE_NS: Final = 60 * 1_000_000_000
"""A reader's ephemeral consumer is removed by the server after a minute unused (if we crash)."""

_STATUS: Final = "Status"


# --- names -----------------------------------------------------------------------------------------


def stream_name(queue: str, kind: str) -> str:
    """The stream of ``queue`` that ``kind`` (``events``, ``inbox`` or ``dlq``) names."""
    names = QueueNames(queue)
    streams = {"events": events_stream(queue), "inbox": names.inbox_stream, "dlq": names.dlq_stream}
    if kind not in streams:
        raise ValueError(f"stream kind {kind!r} is not one of {', '.join(streams)}")
    return streams[kind]


def key_of_subject(subject: str) -> str | None:
    """The key of a per-key subject ``kq.<queue>.<kind>.<key>``, or None for another subject."""
    parts = subject.split(".", 3)
    return parts[3] if len(parts) == 4 and parts[0] == "kq" else None


# --- connections and streams -----------------------------------------------------------------------


async def connect_to(url: str) -> Client:
    """A connection for one Spark task; raises keyqueue's ConnectionFailed with the fix."""
    return await connect(url, name="keyqueue-spark")


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """What a stream holds now: ``first_seq``..``last_seq`` (``messages`` of them not deleted)."""

    first_seq: int
    last_seq: int
    messages: int
    duplicate_window: float


async def stream_bounds(nc: Client, stream: str) -> StreamBounds:
    """The stream's current sequence range; raises StreamNotFound if it does not exist."""
    info = await JetStreamApi(nc).stream_info(stream)
    state = info.get("state", {})
    window = int(info.get("config", {}).get("duplicate_window", 0)) / 1e9
    return StreamBounds(int(state.get("first_seq", 0)), int(state.get("last_seq", 0)),
                        int(state.get("messages", 0)), window)


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message as a reader yields it."""

    seq: int
    subject: str
    headers: Mapping[str, str]
    data: bytes
    timestamp: datetime


async def read_range(nc: Client, stream: str, first: int, last: int, *, subject: str | None = None,
                     batch: int = 1000, timeout: float = 10.0) -> AsyncGenerator[list[StoredMessage], None]:
    """Every message of ``stream`` with ``first <= seq <= last``, in order, in lists of up to ``batch``.

    Reads through an ephemeral pull consumer with no acks (created here, deleted at the end,
    removed by the server a minute after a crash): one round trip per batch, whatever the
    stream's ``allow_direct``. Deleted and expired sequences are skipped.
    """
    if last < first:
        return
    api = JetStreamApi(nc)
    name = f"kqspark_{secrets.token_hex(8)}"
    config: dict[str, Any] = {
        "name": name,
        "deliver_policy": "by_start_sequence",
        "opt_start_seq": max(first, 1),
        "ack_policy": "none",
        "inactive_threshold": _CONSUMER_IDLE_NS,
        "mem_storage": True,
        "num_replicas": 1,
    }
    if subject:
        config["filter_subject"] = subject
    info = await api.request(f"CONSUMER.CREATE.{stream}.{name}",
                             {"stream_name": stream, "config": config, "action": "create"})
    pending = int(info.get("num_pending", 0))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        done = pending == 0
        while not done:
            want = min(batch, pending)
            request = json.dumps({"batch": want, "no_wait": True}).encode()
            await nc.publish(f"{api.prefix}.CONSUMER.MSG.NEXT.{stream}.{name}", request, reply=inbox)
            page: list[StoredMessage] = []
            while len(page) < want:
                msg: Msg = await sub.next_msg(timeout=timeout)
                status = msg.headers.get(_STATUS) if msg.headers else None
                if status is not None:
                    if status in ("404", "408"):  # nothing more right now
                        done = True
                        break
                    if status == "100":  # an idle heartbeat
                        continue
                    raise KeyqueueError(f"reading {stream}: the server answered {status} "
                                        f"{msg.headers.get('Description', '') if msg.headers else ''}")
                meta = msg.metadata
                seq = meta.sequence.stream
                if seq > last:
                    done = True
                    break
                page.append(StoredMessage(seq, msg.subject, dict(msg.headers or {}), msg.data,
                                          meta.timestamp.astimezone(UTC)))
                pending = meta.num_pending
                if pending == 0 or seq == last:
                    done = True
                    break
            if page:
                yield page
    finally:
        await sub.unsubscribe()
        try:
            await api.request(f"CONSUMER.DELETE.{stream}.{name}")
        except (ConsumerNotFound, KeyqueueError):
            pass  # it expires on its own


# --- decoding --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decoded:
    """The wire headers and body fields of a message, or why it could not be read."""

    message_type: str | None
    version: int | None
    request_id: str | None
    fields: dict[str, Any] | None
    error: str | None


def decode_message(headers: Mapping[str, str], data: bytes) -> Decoded:
    """Read a message's type, version and body fields; a message that does not decode is not an error.

    Lenient on purpose (a reader must show the DLQ's malformed messages, not fail on them): the
    reason lands in ``error`` and the fields are None.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    message_type = lower.get(MESSAGE_TYPE.lower())
    raw_version = lower.get(MESSAGE_VERSION.lower(), "")
    version = int(raw_version) if raw_version.isdigit() else None
    # A DLQ copy carries the request id in X-KQ-DLQ-Request-Id (its Nats-Msg-Id is its own).
    request_id = lower.get(DLQ_REQUEST_ID.lower()) or lower.get(MSG_ID.lower())
    content_type = lower.get(CONTENT_TYPE.lower(), "").split(";", 1)[0].strip().lower()
    if not content_type:
        return Decoded(message_type, version, request_id, None, f"no {CONTENT_TYPE} header")
    try:
        fields = loads_map(data, content_type)
    except WireError as e:
        return Decoded(message_type, version, request_id, None, f"{type(e).__name__}: {e}")
    return Decoded(message_type, version, request_id, fields, None)


# --- writing requests ------------------------------------------------------------------------------


def encode_fields(fields: Mapping[str, Any], content_type: str = CBOR) -> bytes:
    """A request body: the fields as a CBOR (or JSON) map; raises WireError unless they are plain values."""
    return dumps(dict(fields), content_type)


def request_message(key: str, task: str, version: int, body: bytes, request_id: str,
                    content_type: str = CBOR) -> OutgoingRequest:
    """A request of ``task`` for ``key`` as keyqueue's task API writes one (docs/architecture.md, "Wire format").

    ``body`` comes from :func:`encode_fields`. Raises InvalidKey for a bad key.
    """
    validate_key(key)
    headers = {CONTENT_TYPE: content_type, MESSAGE_TYPE: task, MESSAGE_VERSION: str(version),
               MSG_ID: request_id}
    return OutgoingRequest(key, headers, body, request_id)


async def ensure_queue(nc: Client, queue: str, *, create: bool = True,
                       duplicate_window: float | None = None) -> StreamBounds:
    """The queue's inbox bounds; create the queue's topology first if it has none and ``create``.

    An existing queue is used as it is (its workers own its configuration).
    """
    inbox = QueueNames(queue).inbox_stream
    try:
        return await stream_bounds(nc, inbox)
    except StreamNotFound:
        if not create:
            raise
    config = QueueConfig(queue) if duplicate_window is None else QueueConfig(queue, duplicate_window=duplicate_window)
    await Topology(JetStreamApi(nc), config).ensure()
    return await stream_bounds(nc, inbox)


async def enqueue_many(nc: Client, queue: str, requests: Sequence[OutgoingRequest]) -> list[Enqueued | EnqueueError]:
    """Store the requests in order with pipelined publishes, then schedule each key once."""
    return await Publisher(nc, QueueNames(queue)).enqueue_many(requests)


# --- lifecycle events ------------------------------------------------------------------------------


async def publish_events(nc: Client, queue: str, events: Iterable[Mapping[str, Any]], *,
                         window: int = 500) -> int:
    """Publish event bodies (``keyqueue.events.event``) acknowledged, ``window`` at a time; returns how many.

    For filling an events stream (``keyqueue.events.ensure_events_stream``) with a known
    history: tests, examples, imported history. A live app's events come from its events plugin.
    """

    async def one(event: Mapping[str, Any]) -> None:
        reply = await nc.request(events_subject(queue, str(event["event"])), dumps(dict(event), CBOR), timeout=10,
                                 headers={**EVENT_HEADERS, MSG_ID: new_request_id()})
        parse_pub_ack(reply)

    items = list(events)
    for start in range(0, len(items), window):
        await asyncio.gather(*(one(event) for event in items[start:start + window]))
    return len(items)
