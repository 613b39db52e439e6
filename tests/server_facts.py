"""Raw JetStream calls for the tests that state what nats-server does (``test_*_facts.py``): the
server's own answers as JSON, with no keyqueue code between the test and the server."""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client


async def api(nc: Client, subject: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """``$JS.API.<subject>``'s answer."""
    reply = await nc.request(f"$JS.API.{subject}", json.dumps(payload).encode() if payload else b"", timeout=5)
    result: dict[str, Any] = json.loads(reply.data)
    return result


async def publish(nc: Client, subject: str, headers: dict[str, str] | None = None,
                  body: bytes = b"") -> dict[str, Any]:
    """A publish's PubAck (``seq``) or its error (``error``: ``err_code``, ``description``)."""
    reply = await nc.request(subject, body, timeout=5, headers=headers)
    result: dict[str, Any] = json.loads(reply.data)
    return result
