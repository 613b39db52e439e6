"""Everything the Rebaser uses from keyqueue, in one place.

The Rebaser is a plugin and should use only keyqueue's public API (``import keyqueue``). Where
that API does not yet offer what it needs, it uses the core seams below, each marked with what
is missing; every other Rebaser module imports keyqueue through this one, so moving a name to
the public API is a change to this file alone.
"""

from __future__ import annotations

# --- the public API ----------------------------------------------------------------------------
from keyqueue import (
    App,
    BaseProcessor,
    ConfigError,
    InvalidKey,
    KeyProcessor,
    KeyqueueError,
    KeyqueueTimeout,
    LeaseLost,
    QueueConfig,
    Reject,
    Reply,
    Request,
    RequestContext,
    RetryPolicy,
    SessionContext,
    WireError,
    Worker,
    WrongLastSequence,
)
from keyqueue import hookimpl as keyqueue_hookimpl

# Lifecycle events of a processor's own (the DVU's), in keyqueue's events stream.
from keyqueue.builtins.events import publish_event
from keyqueue.jetstream.api import JetStreamApi

# --- core seams the public API does not cover yet ----------------------------------------------
# The connection's type: keyqueue has no public name for it (App.connection() returns it).
from keyqueue.jetstream.connect import (  # type: ignore[attr-defined]
    Client,
    connect,
)

# A revision-checked KV bucket (the snapshot store): not exported by keyqueue yet.
from keyqueue.jetstream.kv import KeyValue, KvEntry

# Enqueueing a message with extra headers and a reply inbox that gets two answers (the response,
# then the DVU's), and pipelined bulk enqueue of messages: App.enqueue_message / call_message
# take neither headers, a content type, nor a batch.
from keyqueue.jetstream.publish import Enqueued, OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import validate_key
from keyqueue.jetstream.topology import Topology

# The wire format is a documented sub-package (versioned messages for processors' own queues).
from keyqueue.wire import CBOR, JSON, Message, Registry, decode, encode, from_fields, loads_map, peek
from keyqueue.wire import headers as wire_headers

__all__ = [
    "CBOR",
    "JSON",
    "App",
    "BaseProcessor",
    "Client",
    "ConfigError",
    "Enqueued",
    "InvalidKey",
    "JetStreamApi",
    "KeyProcessor",
    "KeyValue",
    "KeyqueueError",
    "KeyqueueTimeout",
    "KvEntry",
    "LeaseLost",
    "Message",
    "OutgoingRequest",
    "Publisher",
    "QueueConfig",
    "Registry",
    "Reject",
    "Reply",
    "Request",
    "RequestContext",
    "RetryPolicy",
    "SessionContext",
    "Topology",
    "WireError",
    "Worker",
    "WrongLastSequence",
    "connect",
    "decode",
    "encode",
    "from_fields",
    "keyqueue_hookimpl",
    "loads_map",
    "peek",
    "publish_event",
    "validate_key",
    "wire_headers",
]
