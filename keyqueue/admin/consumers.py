"""A queue's token consumer, operated from outside a worker: moving the pin of a pinned queue.

On a ``pinned_client`` queue the server delivers every token to one pinned worker per priority
group; ``unpin`` makes it drop that pin, so the next delivery pins a worker afresh (to move the
load off a worker about to be stopped, say). ``keyqueue unpin`` prints what it did.
"""

from __future__ import annotations

from keyqueue.errors import ConfigError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

__all__ = ["unpin"]


async def unpin(api: JetStreamApi, queue: str) -> list[str]:
    """Drop the pinned worker of each priority group of ``queue``; returns the groups.

    Raises ``StreamNotFound`` if the queue does not exist, ``ConsumerNotFound`` if its token
    consumer does not, and ``ConfigError`` if its priority policy is not ``pinned_client``.
    """
    names = QueueNames(queue)
    config = (await api.consumer_info(names.token_stream, names.consumer)).get("config") or {}
    groups: list[str] = list(config.get("priority_groups") or [])
    if config.get("priority_policy") != "pinned_client" or not groups:
        raise ConfigError(f"queue {queue!r} is not a pinned_client queue; nothing to unpin")
    for group in groups:
        await api.unpin(names.token_stream, names.consumer, group)
    return groups
