"""keyqueue's wire format: headers, versioned message types, CBOR/JSON codecs, upgrade chains.

Publishing::

    encoded = encode(ReviewV2(repo="r", branch="main"), reply_inbox=inbox, max_payload=nc.max_payload)
    await js.publish(subject, encoded.body, headers=encoded.headers)

Receiving::

    msg = decode(raw.headers, raw.data, registry)   # the latest version of the type

Header names and reply/dead-letter header values live in ``keyqueue.wire.headers``.

This package's ``__all__`` and ``keyqueue.wire.headers`` are public, for plugins too (they are
among ``keyqueue.ext.PUBLIC_MODULES``); its other modules are how it is built.
"""

from __future__ import annotations

from keyqueue.wire import headers
from keyqueue.wire.codec import ALLOWED_CBOR_TAGS, CONTENT_TYPES, check_plain, dumps, loads, loads_map
from keyqueue.wire.envelope import (
    Encoded,
    Envelope,
    decode,
    decode_envelope_fields,
    encode,
    header_block_size,
    peek,
)
from keyqueue.wire.fields import from_fields, to_fields
from keyqueue.wire.headers import CBOR, JSON, header_safe
from keyqueue.wire.message import Message, Registry, new_request_id

__all__ = [
    "ALLOWED_CBOR_TAGS",
    "CBOR",
    "CONTENT_TYPES",
    "JSON",
    "Encoded",
    "Envelope",
    "Message",
    "Registry",
    "check_plain",
    "decode",
    "decode_envelope_fields",
    "dumps",
    "encode",
    "from_fields",
    "header_block_size",
    "header_safe",
    "headers",
    "loads",
    "loads_map",
    "new_request_id",
    "peek",
    "to_fields",
]
