"""The lifecycle events contract: where a queue's events are stored and what each one holds.

Stream ``KQ_<queue>_EVENTS`` (limits retention: 7 days, 5 million events, oldest dropped first),
subjects ``kq.<queue>.events.<event>.<key>`` for an event of a key and ``kq.<queue>.events.<event>``
for a queue-wide one (``key`` null), so a key's stored history is one subject filter away
(:func:`key_events_filter`) and ``kq.<queue>.events.<event>.>`` selects one event of every key.
A message carries one event, several events of one key, or (one bulk enqueue's ``enqueued``
events) several events of several keys:

- one event: the headers of :data:`EVENT_HEADERS` (``X-CONTENT-TYPE: application/cbor``,
  ``X-MESSAGE-TYPE: KeyqueueEvent``, ``X-MESSAGE-VERSION: 1``) and a CBOR map body with every field
  of :data:`EVENT_FIELDS`, in that order, null where it does not apply; on the event's subject;
- several events of one key, in the order they happened (the built-in plugin sends a key's events
  this way, so that an event costs the server a fraction of a stored message): the headers of
  :data:`EVENT_BATCH_HEADERS` (``X-MESSAGE-TYPE: KeyqueueEventBatch``, version 1) on
  ``kq.<queue>.events.batch.<key>`` (:func:`event_batch_subject`), and a CBOR map body
  ``{"fields": [field names], "events": [[values, in the order of "fields"], ...]}``. A reader
  takes each event's fields by the names the batch lists (a field it does not list is null), so a
  field added to the contract later changes nothing for old readers;
- several events of several keys, in order, each with its own ``key``: the same batch, on
  ``kq.<queue>.events.batch`` (no key token). Only the ``enqueued`` events of one ``enqueue_many``
  call that spans several keys travel so (a bulk enqueue of a million keys stores a million
  requests and tokens, and some fifteen thousand event messages rather than a million more);
  a request enqueued with ``enqueue``, or with others of its own key only, has its ``enqueued``
  on its key's subjects as before.

Readers decode any of them with :func:`decode_events`. A key's history is still one subject filter
away (:func:`key_events_filter`: ``batch`` is one more event token), but for the ``enqueued``
events of bulk enqueues across keys (the history of runs needs none: a ``started`` event says how
long its request waited); a reader of one event name reads ``kq.<queue>.events.<event>.>`` *and*
the batches, of keys (``kq.<queue>.events.batch.>``) and across keys (``kq.<queue>.events.batch``),
and keeps the events of that name.

keyqueue's own events are :data:`EVENT_NAMES`; the built-in events plugin
(``keyqueue.builtins.events``) publishes them. A plugin with lifecycle steps of its own registers
their names with :func:`register_event_names` and publishes them with :func:`publish_event`;
readers of the stream (``keyqueue events tail``, the Spark plugin) take the names, the field
types and the stream's configuration from here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from keyqueue.errors import StreamNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.tasks.arguments import CANCELLED_BY
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.app.application import App

__all__ = [
    "BATCH",
    "EVENT_BATCH_HEADERS",
    "EVENT_BATCH_MESSAGE_TYPE",
    "EVENT_FIELDS",
    "EVENT_FIELD_NAMES",
    "EVENT_HEADERS",
    "EVENT_MESSAGE_TYPE",
    "EVENT_NAMES",
    "EVENT_VERSION",
    "MAX_AGE",
    "MAX_MSGS",
    "PUBLISHER",
    "SUPERSEDED_BY_CANCEL",
    "EventField",
    "FieldType",
    "decode_events",
    "ensure_events_stream",
    "event",
    "event_batch_body",
    "event_batch_subject",
    "event_names",
    "events_stream",
    "events_subject",
    "key_events_filter",
    "publish_event",
    "register_event_names",
    "stream_config",
    "superseded_reason",
]

FieldType = Literal["string", "double", "long"]
"""The type of an event field's non-null values: text, a float, an integer."""


class EventField(NamedTuple):
    """One body field of an event: its name, the type of its values, what it means."""

    name: str
    type: FieldType
    meaning: str


EVENT_NAMES: Final = (
    "enqueued", "acquired", "started", "succeeded", "retried", "dead_lettered", "superseded", "released",
    "cancelled", "expired",
    "workflow_started", "workflow_joined", "workflow_failed", "workflow_resumed", "workflow_done",
    "workflow_cancelled",
)
"""keyqueue's own values of the ``event`` field; plugins add theirs with :func:`register_event_names`."""

EVENT_FIELDS: Final = (
    EventField("event", "string", "the event's name: one of EVENT_NAMES or a name a plugin registered"),
    EventField("ts", "double", "when it happened, Unix seconds"),
    EventField("queue", "string", "the queue"),
    EventField("key", "string", "the key, or null for queue-wide events"),
    EventField("request_id", "string", "the request's Nats-Msg-Id, or null"),
    EventField("task", "string", "the task (X-MESSAGE-TYPE of the request), or null"),
    EventField("worker", "string", "the worker's name, or null"),
    EventField("attempt", "long", "1 for the first run of a request, 2 for its first retry, ...; or null"),
    EventField("wait", "double", "on started: seconds from enqueue to handler start; else null"),
    EventField("run", "double", "on succeeded/dead_lettered: handler seconds; on a plugin's step: its seconds; "
                                "else null"),
    EventField("reason", "string", "DLQ reason, retry error, superseded/merged or cancelled reason; or null"),
    EventField("triggers", "long", "on a plugin's step that serves several requests at once: how many; else null"),
    EventField("run_id", "string", "the id of a plugin's step, or of the workflow of a workflow_* event; or null"),
    EventField("fence", "long", "on acquired: the holder's fencing number (the sequence of its lease record, "
                                "strictly increasing per key); else null"),
    EventField("delay", "double", "on retried: seconds until the next attempt (the backoff); else null"),
)
"""The body fields of a ``KeyqueueEvent`` v1, in body order. Every field is nullable."""

EVENT_FIELD_NAMES: Final = tuple(field.name for field in EVENT_FIELDS)
"""The names of :data:`EVENT_FIELDS`, in body order."""

EVENT_MESSAGE_TYPE: Final = "KeyqueueEvent"
"""``X-MESSAGE-TYPE`` of every lifecycle event."""

EVENT_VERSION: Final = 1
"""``X-MESSAGE-VERSION`` of the events described here."""

EVENT_HEADERS: Final[Mapping[str, str]] = {
    H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: EVENT_MESSAGE_TYPE, H.MESSAGE_VERSION: str(EVENT_VERSION),
}
"""The headers every event is published with (a publisher adds its own ``Nats-Msg-Id`` if it wants one)."""

EVENT_BATCH_MESSAGE_TYPE: Final = "KeyqueueEventBatch"
"""``X-MESSAGE-TYPE`` of a message that carries several events of one key."""

EVENT_BATCH_HEADERS: Final[Mapping[str, str]] = {
    H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: EVENT_BATCH_MESSAGE_TYPE, H.MESSAGE_VERSION: "1",
}
"""The headers of a batch of events."""

BATCH: Final = "batch"
"""The subject token of a batch of events (``kq.<queue>.events.batch.<key>``); no event takes this name."""

MAX_AGE: Final = 7 * 24 * 3600.0
"""Seconds an event is kept."""

MAX_MSGS: Final = 5_000_000
"""Events the stream of one queue keeps (oldest dropped first): about 1 GiB at ~200 bytes an event.

A count rather than ``max_bytes``: nats-server reserves a stream's ``max_bytes`` against the
JetStream storage limit up front, so 1 GiB per queue would soon leave no room to create the
queues' own streams (the embedded server's store is 4 GB)."""

PUBLISHER: Final = "keyqueue.builtins.events"
"""The name of the built-in plugin that publishes events; unregistering it turns an app's events off."""

_EVENT_NAME: Final = re.compile(r"[a-z][a-z0-9_]*")

_registered: dict[str, None] = {}
"""Event names plugins registered, in registration order (process-wide, like the streams they describe)."""


# --- names -----------------------------------------------------------------------------------------


def superseded_reason(superseded_by: str) -> str:
    """The ``reason`` of a ``superseded`` event: ``superseded by <the request id that superseded it>``."""
    return f"superseded by {superseded_by}"


SUPERSEDED_BY_CANCEL: Final = superseded_reason(CANCELLED_BY)
"""The ``reason`` of the ``superseded`` event of a request cancelled before it started. Its
``cancelled`` event comes first and says so: a report counts it once, as a cancel."""


def register_event_names(*names: str) -> None:
    """Add lifecycle event names of a plugin's own, e.g. ``register_event_names("dvu_started")``.

    Call it when the plugin's module is imported. A name is a lower-case subject token
    (``[a-z][a-z0-9_]*``) and must not be one of keyqueue's own (``ValueError``); registering a
    name again does nothing.
    """
    for name in names:
        if not _EVENT_NAME.fullmatch(name):
            raise ValueError(f"event name {name!r} is not a lower-case subject token ([a-z][a-z0-9_]*)")
        if name in EVENT_NAMES or name == BATCH:
            raise ValueError(f"event name {name!r} is keyqueue's own")
    _registered.update(dict.fromkeys(names))


def event_names() -> tuple[str, ...]:
    """Every value the ``event`` field may take now: :data:`EVENT_NAMES`, then the registered names."""
    return (*EVENT_NAMES, *_registered)


def events_stream(queue: str) -> str:
    """``KQ_<queue>_EVENTS``; raises ``ConfigError`` for a name that cannot be a queue's."""
    QueueNames(queue)
    return f"KQ_{queue}_EVENTS"


def events_subject(queue: str, event: str, key: str | None = None) -> str:
    """``kq.<queue>.events.<event>.<key>``, or ``kq.<queue>.events.<event>`` for a queue-wide event."""
    return f"kq.{queue}.events.{event}" if key is None else f"kq.{queue}.events.{event}.{key}"


def event_batch_subject(queue: str, key: str | None) -> str:
    """``kq.<queue>.events.batch.<key>``: where a batch of ``key``'s events is stored; with ``key``
    None, ``kq.<queue>.events.batch``: where a batch of events of several keys is (one
    ``enqueue_many`` call's ``enqueued`` events)."""
    return f"kq.{queue}.events.{BATCH}" if key is None else f"kq.{queue}.events.{BATCH}.{key}"


def key_events_filter(queue: str, key: str) -> str:
    """The subject filter of every stored event of ``key``: ``kq.<queue>.events.*.<key>``."""
    return f"kq.{queue}.events.*.{key}"


# --- bodies ----------------------------------------------------------------------------------------


def event(name: str, ts: float, queue: str, **fields: Any) -> dict[str, Any]:
    """An event body with every field of the contract (unset ones null).

    Raises ``ValueError`` for a field not in :data:`EVENT_FIELDS` or a name not in :func:`event_names`.
    """
    unknown = set(fields) - set(EVENT_FIELD_NAMES)
    if unknown:
        raise ValueError(f"not event fields: {', '.join(sorted(unknown))}")
    if name not in EVENT_NAMES and name not in _registered:
        raise ValueError(f"{name!r} is not one of {', '.join(event_names())}")
    body: dict[str, Any] = dict.fromkeys(EVENT_FIELD_NAMES)
    body.update(fields, event=name, ts=float(ts), queue=queue)
    return body


async def publish_event(app: App, name: str, queue: str, key: str | None = None, *, ts: float | None = None,
                        **fields: Any) -> None:
    """Publish one event of ``queue`` through ``app``'s events plugin (nothing if its events are off).

    For plugins with lifecycle steps of their own (names registered with
    :func:`register_event_names`). ``fields`` are event fields (``ValueError`` for others, as
    :func:`event` says); ``ts`` defaults to now. Best effort, like every event.
    """
    body = event(name, time.time() if ts is None else ts, queue, key=key, **fields)
    publisher = app.plugins.get_plugin(PUBLISHER)
    if publisher is not None:
        await publisher.publish(app, body)


def event_batch_body(rows: list[list[Any]]) -> dict[str, Any]:
    """The body of a batch of events: ``rows`` are event bodies' values in :data:`EVENT_FIELD_NAMES` order."""
    return {"fields": list(EVENT_FIELD_NAMES), "events": rows}


def decode_events(headers: Mapping[str, str] | None, data: bytes) -> list[dict[str, Any]]:
    """The events one message of an events stream carries, in order, each a map of every field of
    :data:`EVENT_FIELDS` (and any other the batch names): one for a ``KeyqueueEvent``, several for a
    ``KeyqueueEventBatch``, none for a message that is neither or does not decode."""
    headers = headers or {}
    try:
        body = loads(data, headers.get(H.CONTENT_TYPE, CBOR))
    except WireError:
        return []
    if not isinstance(body, dict):
        return []
    if headers.get(H.MESSAGE_TYPE) != EVENT_BATCH_MESSAGE_TYPE:
        return [body] if isinstance(body.get("event"), str) else []
    names, rows = body.get("fields"), body.get("events")
    if not isinstance(names, list) or not isinstance(rows, list):
        return []
    events = []
    for row in rows:
        if isinstance(row, list):
            fields: dict[str, Any] = dict.fromkeys(EVENT_FIELD_NAMES)
            fields.update(zip(names, row, strict=False))
            if isinstance(fields.get("event"), str):
                events.append(fields)
    return events


# --- the stream ------------------------------------------------------------------------------------


def stream_config(queue: str, *, max_age: float = MAX_AGE, max_msgs: int = MAX_MSGS,
                  max_bytes: int | None = None) -> dict[str, Any]:
    """The events stream's configuration (limits retention, file storage, oldest discarded).

    ``max_bytes`` is left out unless given: the server reserves it up front (see :data:`MAX_MSGS`).
    """
    config: dict[str, Any] = {
        "name": events_stream(queue), "subjects": [events_subject(queue, ">")], "retention": "limits",
        "storage": "file", "num_replicas": 1, "max_age": int(max_age * 1e9), "max_msgs": max_msgs,
        "allow_direct": True, "discard": "old",
    }
    if max_bytes is not None:
        config["max_bytes"] = max_bytes
    return config


async def ensure_events_stream(nc: Client, queue: str, *, max_age: float = MAX_AGE, max_msgs: int = MAX_MSGS,
                               max_bytes: int | None = None) -> None:
    """Create ``KQ_<queue>_EVENTS`` if it does not exist (an existing one is used as it is)."""
    api = JetStreamApi(nc)
    try:
        await api.stream_info(events_stream(queue))
    except StreamNotFound:
        await api.add_stream(stream_config(queue, max_age=max_age, max_msgs=max_msgs, max_bytes=max_bytes))
