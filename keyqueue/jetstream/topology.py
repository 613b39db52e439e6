"""A queue's streams and consumer, created idempotently and verified against what exists.

keyqueue never updates an existing stream or consumer: if one differs in a field keyqueue
depends on, :class:`~keyqueue.errors.TopologyMismatch` names the field and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from keyqueue.errors import ConfigError, ConsumerNotFound, JetStreamError, StreamNotFound, TopologyMismatch
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

NS: Final = 1_000_000_000
"""Nanoseconds per second: JetStream durations are integers in nanoseconds."""

PriorityPolicy = Literal["none", "overflow", "pinned_client", "prioritized"]


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """How one queue's streams and token consumer are configured.

    Every worker and producer of a queue must agree on these values: they are checked against
    the server on first use.
    """

    name: str
    ack_wait: float = 30.0
    """Seconds a key stays held without a keepalive before the server redelivers its token."""
    max_ack_pending: int = 10_000
    """How many keys the whole fleet may hold at once (the server's default of 1000 is a silent cap)."""
    duplicate_window: float = 120.0
    """Seconds during which a repeated request id (Nats-Msg-Id) is recognised as a duplicate."""
    max_backlog_per_key: int = 0
    """Pending requests allowed per key; 0 is unlimited. A full backlog is a producer error."""
    dlq_max_age: float = 30 * 24 * 3600.0
    """Seconds dead-lettered requests are kept."""
    replicas: int = 1
    """Stream replicas (3 on a cluster for fault tolerance)."""
    priority_group: str = "workers"
    """Name of the ADR-42 priority group when ``priority_policy`` is not ``none``."""
    priority_policy: PriorityPolicy = "none"
    priority_timeout: float = 10.0
    """Seconds a pinned worker may go silent before the pin moves (``pinned_client`` only)."""

    def __post_init__(self) -> None:
        QueueNames(self.name)
        if self.ack_wait < 1:
            raise ConfigError(f"ack_wait must be at least 1 second, got {self.ack_wait}")
        if self.max_ack_pending < 1:
            raise ConfigError(f"max_ack_pending must be positive, got {self.max_ack_pending}")
        if self.priority_policy not in ("none", "overflow", "pinned_client", "prioritized"):
            raise ConfigError(
                f"priority_policy {self.priority_policy!r} is not one of "
                "none, overflow, pinned_client, prioritized"
            )

    @property
    def names(self) -> QueueNames:
        return QueueNames(self.name)

    # --- wanted server configs -------------------------------------------------------------------

    def inbox_config(self) -> dict[str, Any]:
        n = self.names
        config: dict[str, Any] = {
            "name": n.inbox_stream,
            "subjects": [n.inbox_prefix + ">"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "duplicate_window": int(self.duplicate_window * NS),
            # Direct gets may be served by a lagging follower, which could hide a request at the
            # quiescence re-check: on replicated inboxes keyqueue reads from the leader.
            "allow_direct": self.replicas == 1,
            "discard": "old",
        }
        if self.max_backlog_per_key:
            config.update(max_msgs_per_subject=self.max_backlog_per_key, discard="new",
                          discard_new_per_subject=True)
        return config

    def token_config(self) -> dict[str, Any]:
        n = self.names
        return {
            "name": n.token_stream,
            "subjects": [n.token_prefix + ">"],
            "retention": "workqueue",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_msgs_per_subject": 1,
            "discard": "new",
            "discard_new_per_subject": True,
            "duplicate_window": 0,
        }

    def dlq_config(self) -> dict[str, Any]:
        n = self.names
        return {
            "name": n.dlq_stream,
            "subjects": [n.dlq_prefix + ">"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_age": int(self.dlq_max_age * NS),
            "duplicate_window": int(self.duplicate_window * NS),
            "allow_direct": self.replicas == 1,
        }

    def lease_config(self, first_seq: int = 1) -> dict[str, Any]:
        """Per-key lease records: one message per subject, each with its own TTL (the lease).

        A record is written only with ``Nats-Expected-Last-Subject-Sequence``, so the server
        decides who holds a key (docs/architecture.md, "Fencing"). ``first_seq`` lets a queue that
        already ran with token-based fencing tokens continue above them.
        """
        n = self.names
        return {
            "name": n.lease_stream,
            "subjects": [n.lease_prefix + ">", n.head_prefix + ">", n.role_prefix + ">"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_msgs_per_subject": 1,
            "discard": "old",
            "allow_msg_ttl": True,
            "allow_direct": self.replicas == 1,
            "first_seq": max(1, first_seq),
        }

    def consumer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "durable_name": self.names.consumer,
            "ack_policy": "explicit",
            "ack_wait": int(self.ack_wait * NS),
            "max_deliver": -1,
            "max_ack_pending": self.max_ack_pending,
            "deliver_policy": "all",
            "replay_policy": "instant",
            "max_waiting": 512,
            "num_replicas": self.replicas,
        }
        if self.priority_policy != "none":
            config["priority_groups"] = [self.priority_group]
            config["priority_policy"] = self.priority_policy
            if self.priority_policy == "pinned_client":
                config["priority_timeout"] = int(self.priority_timeout * NS)
        return config


# Fields compared on an existing stream/consumer; others (limits the server fills in) are not ours.
_STREAM_FIELDS: Final = ("subjects", "retention", "max_msgs_per_subject", "discard",
                         "discard_new_per_subject", "allow_direct", "allow_msg_ttl")
_CONSUMER_FIELDS: Final = ("ack_policy", "ack_wait", "max_deliver", "max_ack_pending",
                           "priority_groups", "priority_policy", "priority_timeout")


def _verify(entity: str, existing: dict[str, Any], wanted: dict[str, Any], fields: tuple[str, ...],
            hint: str) -> None:
    defaults: dict[str, Any] = {"discard": "old", "retention": "limits", "max_msgs_per_subject": -1,
                                "discard_new_per_subject": False,
                                "allow_direct": False, "allow_msg_ttl": False, "priority_policy": "none",
                                "max_deliver": -1}
    for field in fields:
        if field not in wanted and field not in existing:
            continue
        want = wanted.get(field, defaults.get(field))
        have = existing.get(field, defaults.get(field))
        if field == "priority_timeout" and wanted.get("priority_policy") != "pinned_client":
            continue
        if want != have:
            raise TopologyMismatch(entity, field, have, want, hint)


class Topology:
    """Creates or verifies a queue's streams and consumer."""

    def __init__(self, api: JetStreamApi, config: QueueConfig) -> None:
        self.api = api
        self.config = config

    async def ensure(self) -> None:
        """Create what is missing; verify what exists. Safe to call from every process."""
        for wanted in (self.config.inbox_config(), self.config.token_config(), self.config.dlq_config()):
            await self._ensure_stream(wanted)
        await self._ensure_lease_stream()
        await self._ensure_consumer()

    async def _ensure_lease_stream(self) -> None:
        n = self.config.names
        try:
            info = await self.api.stream_info(n.lease_stream)
        except StreamNotFound:
            # Lease sequences are fencing tokens: start past every token sequence, so they keep
            # increasing on a queue whose processors stored token-based fencing tokens before.
            try:
                tokens = await self.api.stream_info(n.token_stream)
                first = int(tokens.get("state", {}).get("last_seq", 0)) + 1
            except StreamNotFound:
                first = 1
            try:
                await self.api.add_stream(self.config.lease_config(first))
                return
            except JetStreamError:
                # Another process created it first (with a first_seq read a moment apart).
                info = await self.api.stream_info(n.lease_stream)
        hint = (f"keyqueue will not change an existing stream; delete it (nats stream rm {n.lease_stream}) "
                "while no worker runs")
        _verify(f"stream {n.lease_stream}", info["config"], self.config.lease_config(), _STREAM_FIELDS, hint)

    async def _ensure_stream(self, wanted: dict[str, Any]) -> None:
        name = wanted["name"]
        try:
            info = await self.api.stream_info(name)
        except StreamNotFound:
            await self.api.add_stream(wanted)
            return
        hint = (f"keyqueue will not change an existing stream; delete it (nats stream rm {name}) "
                "or configure the queue to match")
        _verify(f"stream {name}", info["config"], wanted, _STREAM_FIELDS, hint)

    async def _ensure_consumer(self) -> None:
        n = self.config.names
        wanted = self.config.consumer_config()
        try:
            info = await self.api.consumer_info(n.token_stream, n.consumer)
        except ConsumerNotFound:
            await self.api.add_consumer(n.token_stream, wanted)
            return
        hint = ("the server cannot change this in place: stop every worker of the queue, then "
                f"recreate the consumer with `keyqueue recreate-consumer {self.config.name}`")
        _verify(f"consumer {n.token_stream}/{n.consumer}", info["config"], wanted, _CONSUMER_FIELDS, hint)

    async def recreate_consumer(self) -> None:
        """Delete and create the token consumer (to change its priority policy, say)."""
        n = self.config.names
        try:
            await self.api.delete_consumer(n.token_stream, n.consumer)
        except ConsumerNotFound:
            pass
        await self.api.add_consumer(n.token_stream, self.config.consumer_config())
