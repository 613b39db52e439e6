"""What the core needs from the I/O layer: the reads and writes of key sessions and the reconciler.

``KeyIO`` is every step a key session and its parts (``lock``, ``lease_keeper``, ``removals``,
``dead_lettering``, ``hand_back``, ``outage``) take on one queue's streams; ``ReconcilerIO`` is what
the reconciler takes. ``keyqueue.jetstream.queue_io.QueueIO`` is the one implementation over NATS
(the worker builds it and hands it to both); a unit test of the core's pure logic gives a fake that
mypy checks against the same protocol. Static types only: nothing here runs on the hot path.

The lease stream's part is :class:`~keyqueue.core.lock.RecordStore` (which includes the connection's
:class:`~keyqueue.core.outage.Link`), so a ``KeyIO`` is also what a ``KeyLock`` and ``ride_out`` take.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from keyqueue.core.lock import RecordStore

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from keyqueue.jetstream.api import StoredMsg
    from keyqueue.jetstream.pull import Token
    from keyqueue.jetstream.queue_io import Watch
    from keyqueue.jetstream.subjects import QueueNames


class KeyIO(RecordStore, Protocol):
    """Every per-key read and write of a key session, on one queue."""

    # --- the queue ---------------------------------------------------------------------------------

    @property
    def names(self) -> QueueNames:
        """The queue's streams and subjects."""

    @property
    def direct(self) -> bool:
        """The inbox answers direct gets (one server): :meth:`send_read` may be used."""

    @property
    def replicated(self) -> bool:
        """The streams are replicated: a double ack is answered before the token is removed."""

    @property
    def release_markers(self) -> bool:
        """The inbox takes release markers (:meth:`mark_released`); else a key is given back with a
        purge and a re-check."""

    # --- the key's requests ------------------------------------------------------------------------

    async def read(self, key: str, from_seq: int, limit: int) -> tuple[list[StoredMsg], bool]:
        """Up to ``limit`` of the key's requests from ``from_seq`` on; whether more remain after them."""

    async def send_read(self, key: str, from_seq: int, limit: int) -> asyncio.Future[list[Msg]]:
        """:meth:`read` sent now, its replies read by :meth:`read_reply` (only where :attr:`direct`)."""

    async def read_reply(self, key: str, sent: asyncio.Future[list[Msg]]) -> tuple[list[StoredMsg], bool]:
        """What a :meth:`send_read` found, as :meth:`read` returns it."""

    async def request_remains(self, key: str, from_seq: int) -> bool:
        """Whether the key's inbox holds a request at or after ``from_seq`` (the give-back's re-check)."""

    async def watch(self, key: str) -> Watch:
        """Watch the key's inbox subject for the next request that lands (once)."""

    async def delete(self, seq: int) -> None:
        """Remove one request by its inbox sequence (one already gone is fine)."""

    async def purge_soon(self, key: str, seq: int) -> asyncio.Future[list[Msg]]:
        """Send the removal of the key's requests through ``seq``; its reply is not awaited."""

    async def purge_through(self, key: str, seq: int) -> int:
        """Remove the key's requests through ``seq``; how many were removed."""

    async def settle(self, futures: list[asyncio.Future[list[Msg]]]) -> None:
        """Wait for removals sent by :meth:`purge_soon`; raise the first real error."""

    def confirmed(self, future: asyncio.Future[list[Msg]]) -> bool:
        """Whether a removal sent by :meth:`purge_soon` is done and succeeded, without waiting."""

    async def mark_released(self, key: str, last_seq: int, timeout: float | None = None) -> bool:
        """Store the key's release marker if its subject's last message is still ``last_seq``."""

    # --- outputs -----------------------------------------------------------------------------------

    async def dead_letter(self, key: str, msg: StoredMsg, headers: Mapping[str, str], *,
                          dedupe: str | None = None) -> None:
        """Copy a request to the DLQ with the headers saying why."""

    async def reply(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        """Answer a caller waiting on ``inbox``."""

    async def progress(self, key: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Publish on the key's progress subject."""

    async def add_head_runs(self, key: str, seq: int, *, runs: int = 0, killed: int = 0) -> tuple[int, int]:
        """Add to the crash-loop counts of the key's head request ``seq``; both counts."""

    # --- the token ---------------------------------------------------------------------------------

    async def keepalive(self, token: Token) -> None:
        """Tell the server the token's holder is still working."""

    async def nak(self, token: Token, delay: float = 0.0) -> None:
        """Hand the token back for redelivery, after ``delay`` seconds."""

    async def release_token(self, token: Token, timeout: float = 5.0) -> None:
        """Ack the token, returning once it is gone from the token stream."""

    async def delete_token(self, token: Token) -> None:
        """Remove the token's message by its sequence."""

    async def token_stored(self, token: Token) -> bool:
        """Whether ``token`` itself is still the key's stored token."""

    async def schedule(self, key: str) -> bool:
        """Publish the key's token; False if it already exists."""


class ReconcilerIO(RecordStore, Protocol):
    """What the reconciler reads and writes: the keys with requests or tokens, token publishes, and
    its role's lease record."""

    @property
    def names(self) -> QueueNames:
        """The queue's streams and subjects."""

    async def keys_with_requests(self) -> dict[str, int]:
        """Every key with stored requests, and how many."""

    async def keys_with_tokens(self) -> set[str]:
        """Every key with a stored token."""

    async def schedule(self, key: str) -> bool:
        """Publish the key's token; False if it already exists."""
