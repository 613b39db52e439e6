"""keyqueue's extension API: the machinery under ``import keyqueue`` that plugins may build on.

``import keyqueue`` is what an application needs: tasks, workers, processors, errors. A plugin
that does more (serves a queue of its own to clients of its own, keeps state in a key-value
bucket, reads a queue's streams, enqueues prepared requests in bulk) needs some of the layers
below. The names here are those layers' supported surface::

    from keyqueue.ext import JetStreamApi, QueueNames, Topology, connect

    nc = await connect("nats://127.0.0.1:4222", name="my-plugin")
    await Topology(JetStreamApi(nc), keyqueue.QueueConfig("reports")).ensure()
    info = await JetStreamApi(nc).stream_info(QueueNames("reports").inbox_stream)

The connection
    :func:`connect` (keyqueue's connection settings and typed errors), :class:`Client` (nats-py's
    client, which ``connect`` returns).
JetStream
    :class:`JetStreamApi` (the ``$JS.API`` calls, errors typed by ``keyqueue.errors``),
    :func:`parse_pub_ack` / :class:`PubAck` (a publish's acknowledgement).
A queue's layout
    :class:`QueueNames` (its streams, consumer and subjects), :func:`validate_key`,
    :func:`validate_queue_name`, :class:`Topology` (creates or checks a ``keyqueue.QueueConfig``).
Enqueueing prepared requests
    :class:`Publisher` (store, then schedule; ``enqueue_many`` pipelines a batch),
    :class:`OutgoingRequest` (headers and body already encoded), :class:`Enqueued` (the receipt).
A key-value bucket with revision-checked writes
    :class:`KeyValue`, :class:`KvEntry`.
Applications by name
    :func:`load_app` (``MODULE:APP``, as ``keyqueue worker`` takes it, for a plugin's commands).

A plugin imports keyqueue through :data:`PUBLIC_MODULES` only: ``keyqueue``, this module,
``keyqueue.events`` (the lifecycle events contract), ``keyqueue.errors`` and ``keyqueue.wire``
(the wire format: messages and codecs; header names in ``keyqueue.wire.headers``). Every other
module under ``keyqueue`` is private and may change between releases; keyqueue's own plugins
are held to this by a test.
"""

from __future__ import annotations

from typing import Final

from nats.aio.client import Client

from keyqueue.app.loading import load_app
from keyqueue.jetstream.api import JetStreamApi, PubAck, parse_pub_ack
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.kv import KeyValue, KvEntry
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames, validate_key, validate_queue_name
from keyqueue.jetstream.topology import Topology

__all__ = [
    "PUBLIC_MODULES",
    "Client",
    "Enqueued",
    "JetStreamApi",
    "KeyValue",
    "KvEntry",
    "OutgoingRequest",
    "PubAck",
    "Publisher",
    "QueueNames",
    "Topology",
    "connect",
    "load_app",
    "parse_pub_ack",
    "validate_key",
    "validate_queue_name",
]

PUBLIC_MODULES: Final = (
    "keyqueue", "keyqueue.errors", "keyqueue.events", "keyqueue.ext", "keyqueue.wire", "keyqueue.wire.headers",
)
"""The modules of keyqueue a plugin may import; the rest are keyqueue's own."""
