"""A queue's streams and consumer: created when missing, checked or followed when they exist.

Each setting has one owner (docs/decisions.md, "Who owns each setting"):

- **keyqueue's layout**: the streams' subjects and retention, the token and lease streams'
  per-subject limits and discard policy, message TTLs, direct gets (which follow ``replicas``);
  the consumer's ack policy and unlimited deliveries. Every process checks it, and a difference is
  a :class:`~keyqueue.errors.TopologyMismatch`: one line naming a command that fixes it.
- **the queue's settings**: the lease (the consumer's ``ack_wait``), ``max_ack_pending``, the
  per-key backlog cap and a pinned queue's ``priority_timeout``. The process that creates the
  queue takes them from its :class:`QueueConfig`; after that the server's values apply, and they
  change in place: ``keyqueue configure`` (:meth:`Topology.configure`), or a worker given a lease
  (:meth:`Topology.ensure_worker`). A worker not given one follows the server's.
- **the workers' pull protocol**: the priority policy and group. Only workers check it; it changes
  with every worker stopped (``keyqueue recreate-consumer --app``).

Producers call :meth:`Topology.ensure`, which never looks at the consumer's settings.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

from keyqueue.errors import ConfigError, ConsumerNotFound, JetStreamError, StreamNotFound, TopologyMismatch
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames

log = logging.getLogger("keyqueue.topology")

NS: Final = 1_000_000_000
"""Nanoseconds per second: JetStream durations are integers in nanoseconds."""

PriorityPolicy = Literal["none", "overflow", "pinned_client", "prioritized"]

OWNERS: Final = 'docs/decisions.md, "Who owns each setting"'
"""Where the owner of every setting, and the fix for each difference, is written down."""


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """How one queue's streams and token consumer are configured.

    The layout fields (``replicas``, ``priority_policy``, ``priority_group``) must match the
    queue on the server. The queue's settings (``ack_wait``, ``max_ack_pending``,
    ``max_backlog_per_key``, ``priority_timeout``) are what a new queue starts with; on an
    existing queue the server's values apply, and ``keyqueue configure`` changes them.
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
        if self.max_backlog_per_key < 0:
            raise ConfigError(f"max_backlog_per_key must be 0 (unlimited) or more, got {self.max_backlog_per_key}")
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
        return {
            "name": n.inbox_stream,
            "subjects": [n.inbox_prefix + ">"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "duplicate_window": int(self.duplicate_window * NS),
            # Direct gets may be served by a lagging follower, which could hide a request at the
            # quiescence re-check: on replicated inboxes keyqueue reads from the leader.
            "allow_direct": self.replicas == 1,
            # A worker gives a key back with one write, a release marker (docs/architecture.md,
            # "Giving a key back"): a rollup that lives a second.
            "allow_rollup_hdrs": True,
            "allow_msg_ttl": True,
            **backlog_cap(self.max_backlog_per_key),
        }

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

    def work_config(self) -> dict[str, Any]:
        """Unkeyed requests: a work-queue stream, one subject per task (``kq.Q.work.<task>``); a
        request is removed by the ack of its run (or of its dead-letter copy)."""
        n = self.names
        return {
            "name": n.work_stream,
            "subjects": [n.work_prefix + ">"],
            "retention": "workqueue",
            "storage": "file",
            "num_replicas": self.replicas,
            "duplicate_window": int(self.duplicate_window * NS),
            "allow_direct": self.replicas == 1,
        }

    def work_consumer_config(self) -> dict[str, Any]:
        """The ``workers`` consumer of the work stream: each unkeyed request goes to one worker,
        which keeps it with ``+WPI`` while it runs; the queue's lease is its ``ack_wait``.
        Deliveries are unlimited: a request the server stopped delivering would stay stored and
        never run, so the worker dead-letters one that keeps coming back (``crash-loop``)."""
        return {
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


def backlog_cap(max_backlog_per_key: int) -> dict[str, Any]:
    """The inbox fields that make a per-key backlog cap (0: none): the server refuses one request
    too many for a key with 10077, which producers raise as ``BacklogFull``."""
    if max_backlog_per_key:
        return {"max_msgs_per_subject": max_backlog_per_key, "discard": "new", "discard_new_per_subject": True}
    return {"max_msgs_per_subject": -1, "discard": "old", "discard_new_per_subject": False}


class Change(NamedTuple):
    """One of a queue's settings as it was and as it is now (durations in seconds)."""

    setting: str
    before: float
    after: float

    def __str__(self) -> str:
        return f"{self.setting} {_shown(self.setting, self.before)} → {_shown(self.setting, self.after)}"


_DURATIONS: Final = frozenset({"ack_wait", "priority_timeout"})
"""Consumer fields that JetStream keeps in nanoseconds and keyqueue shows in seconds."""


def _shown(setting: str, value: float) -> str:
    if setting in _DURATIONS or setting == "duplicate_window":
        return f"{value:g}s"
    if setting == "max_backlog_per_key" and value <= 0:
        return "unlimited"
    return f"{value:g}"


# --- what is checked, and what a difference means ----------------------------------------------

_STREAM_LAYOUT: Final = ("subjects", "retention", "max_msgs_per_subject", "discard", "discard_new_per_subject",
                         "allow_msg_ttl")
"""Stream fields that are keyqueue's layout (but for the inbox's backlog cap, a setting)."""
_BACKLOG_CAP: Final = ("max_msgs_per_subject", "discard", "discard_new_per_subject")
_RELEASE_MARKERS: Final = ("allow_msg_ttl",)
"""Inbox fields a worker sets in place on an older queue (:meth:`Topology.allow_release_markers`)."""
_CONSUMER_LAYOUT: Final = ("ack_policy", "max_deliver")
_PULL_PROTOCOL: Final = ("priority_policy", "priority_groups")

_SERVER_DEFAULTS: Final[dict[str, Any]] = {
    "discard": "old", "retention": "limits", "max_msgs_per_subject": -1, "discard_new_per_subject": False,
    "allow_direct": False, "allow_msg_ttl": False, "priority_policy": "none", "max_deliver": -1,
}
"""What the server means when it leaves a field out of a config."""


def _differs(existing: dict[str, Any], wanted: dict[str, Any], field: str) -> tuple[Any, Any] | None:
    """``(on the server, here)`` if the field differs, else None."""
    if field not in wanted and field not in existing:
        return None
    have = existing.get(field, _SERVER_DEFAULTS.get(field))
    want = wanted.get(field, _SERVER_DEFAULTS.get(field))
    return None if have == want else (have, want)


class Topology:
    """Creates a queue's streams and consumer, checks their layout, and changes its settings."""

    def __init__(self, api: JetStreamApi, config: QueueConfig) -> None:
        self.api = api
        self.config = config

    # --- producers and workers -------------------------------------------------------------------

    async def ensure(self) -> None:
        """Create what is missing and check the streams' layout; an existing consumer is left as
        it is. What producers call: safe from every process, never failing on a consumer setting."""
        await self._ensure_streams()
        await self._consumer()

    async def ensure_worker(self, ack_wait: float | None = None) -> Change:
        """What a worker calls: :meth:`ensure`, then the consumer's layout and priority policy
        checked, and the queue's lease set to ``ack_wait`` in place when given and different
        (``None``: the server's lease is followed). Returns the lease before and after, in seconds.

        Changing the lease under a running fleet is safe: each worker holds its keys through lease
        records with its own lease as their TTL (docs/decisions.md, "Who owns each setting").
        """
        await self._ensure_streams()
        consumer = await self._consumer(ack_wait)
        self._check_consumer(consumer)
        before = consumer["ack_wait"] / NS
        if ack_wait is None or int(ack_wait * NS) == consumer["ack_wait"]:
            return Change("ack_wait", before, before)
        [change] = await self.configure(ack_wait=ack_wait)
        return change

    async def allow_release_markers(self) -> bool:
        """Whether the inbox takes release markers (``allow_rollup_hdrs`` and ``allow_msg_ttl``), set
        in place on an inbox made by an older keyqueue (both can be turned on, never off: a newer
        keyqueue's workers use them, an older one's never write them). False if the server refused,
        or if the queue has a per-key backlog cap (a marker would count toward it for its second): the
        workers then give keys back the older way, a purge then a re-check."""
        name = self.config.names.inbox_stream
        inbox = (await self.api.stream_info(name))["config"]
        if inbox.get("max_msgs_per_subject", -1) > 0:
            # A marker lives a second on the key's subject and counts toward a per-key backlog cap:
            # a key given back would refuse its next request (BacklogFull) for that second.
            log.info("queue %s: keys are given back with a purge and a re-check, not a release marker (the "
                     "queue has a per-key backlog cap)", self.config.name)
            return False
        if inbox.get("allow_rollup_hdrs") and inbox.get("allow_msg_ttl"):
            return True
        try:
            await self.api.request(f"STREAM.UPDATE.{name}", {**inbox, "allow_rollup_hdrs": True, "allow_msg_ttl": True})
        except JetStreamError as e:
            log.warning("queue %s: could not allow release markers on stream %s (%s); keys are given back with a "
                        "purge and a re-check instead", self.config.name, name, e)
            return False
        log.info("queue %s: stream %s now allows release markers (allow_rollup_hdrs, allow_msg_ttl)",
                 self.config.name, name)
        return True

    async def ensure_unkeyed(self, *, consumer: bool = False) -> float | None:
        """Create the queue's work stream (unkeyed requests) if it is missing, else check its
        layout; with ``consumer``, its consumer too (what a worker serving unkeyed tasks calls).
        Returns the consumer's lease (``ack_wait``, seconds) when asked for it.

        Separate from :meth:`ensure`: a queue gets this stream only once an unkeyed task uses it,
        so a queue created by an older keyqueue, or one without unkeyed tasks, is left as it is."""
        await self._ensure_stream(self.config.work_config(), _STREAM_LAYOUT)
        if not consumer:
            return None
        n = self.config.names
        wanted = self.config.work_consumer_config()
        try:
            existing = (await self.api.consumer_info(n.work_stream, n.consumer))["config"]
        except ConsumerNotFound:
            try:
                existing = (await self.api.add_consumer(n.work_stream, wanted))["config"]
            except JetStreamError as refused:
                existing = await self._created_meanwhile(self._work_consumer_config(), ConsumerNotFound, refused)
        entity = f"consumer {n.work_stream}/{n.consumer}"
        for field in _CONSUMER_LAYOUT:
            if (differs := _differs(existing, wanted, field)) is not None:
                raise TopologyMismatch(
                    entity, field, *differs,
                    f"that is keyqueue's layout, not a setting: with every worker of the queue stopped, delete it "
                    f"(`nats consumer rm {n.work_stream} {n.consumer}`; the requests stay) and a worker creates it "
                    f"again ({OWNERS})")
        return float(existing["ack_wait"]) / NS

    async def _configure_work_consumer(self, update: dict[str, Any]) -> None:
        """The work stream's consumer follows the queue's lease and ``max_ack_pending`` (when the
        queue has one: unkeyed tasks made it)."""
        n = self.config.names
        try:
            current = await self._work_consumer_config()
        except (ConsumerNotFound, StreamNotFound):
            return
        await self.api.request(f"CONSUMER.CREATE.{n.work_stream}.{n.consumer}",
                               {"stream_name": n.work_stream, "config": {**current, **update}, "action": "update"})

    async def _work_consumer_config(self) -> dict[str, Any]:
        n = self.config.names
        config: dict[str, Any] = (await self.api.consumer_info(n.work_stream, n.consumer))["config"]
        return config

    # --- the queue's settings --------------------------------------------------------------------

    async def configure(self, *, ack_wait: float | None = None, max_ack_pending: int | None = None,
                        max_backlog_per_key: int | None = None, duplicate_window: float | None = None) -> list[Change]:
        """Change the queue's settings on the server in place, on a live fleet; one ``Change``
        per setting given. ``StreamNotFound`` / ``ConsumerNotFound`` if the queue does not exist."""
        if ack_wait is not None and ack_wait < 1:
            raise ConfigError(f"ack_wait must be at least 1 second, got {ack_wait}")
        if max_ack_pending is not None and max_ack_pending < 1:
            raise ConfigError(f"max_ack_pending must be positive, got {max_ack_pending}")
        if max_backlog_per_key is not None and max_backlog_per_key < 0:
            raise ConfigError(f"max_backlog_per_key must be 0 (unlimited) or more, got {max_backlog_per_key}")
        if duplicate_window is not None and not duplicate_window >= 1:
            raise ConfigError(f"duplicate_window must be at least 1 second, got {duplicate_window}")
        n = self.config.names
        changes: list[Change] = []
        update: dict[str, Any] = {}
        if ack_wait is not None or max_ack_pending is not None:
            current = await self._consumer_config()
            if ack_wait is not None:
                changes.append(Change("ack_wait", current["ack_wait"] / NS, ack_wait))
                update["ack_wait"] = int(ack_wait * NS)
            if max_ack_pending is not None:
                changes.append(Change("max_ack_pending", current.get("max_ack_pending", -1), max_ack_pending))
                update["max_ack_pending"] = max_ack_pending
            await self.api.request(f"CONSUMER.CREATE.{n.token_stream}.{n.consumer}",
                                   {"stream_name": n.token_stream, "config": {**current, **update}, "action": "update"})
            await self._configure_work_consumer(update)
        if max_backlog_per_key is not None or duplicate_window is not None:
            inbox = (await self.api.stream_info(n.inbox_stream))["config"]
            inbox_update: dict[str, Any] = {}
            if max_backlog_per_key is not None:
                changes.append(Change("max_backlog_per_key", max(0, inbox.get("max_msgs_per_subject", -1)),
                                      max_backlog_per_key))
                inbox_update.update(backlog_cap(max_backlog_per_key))
            if duplicate_window is not None:
                # The window in which a repeated request id (Nats-Msg-Id) stores nothing new; the
                # server applies it to ids seen from now on.
                changes.append(Change("duplicate_window", inbox.get("duplicate_window", 0) / NS, duplicate_window))
                inbox_update["duplicate_window"] = int(duplicate_window * NS)
            await self.api.request(f"STREAM.UPDATE.{n.inbox_stream}", {**inbox, **inbox_update})
        return changes

    async def server_config(self) -> QueueConfig:
        """This queue's config with the settings and priority policy the server has."""
        consumer = await self._consumer_config()
        inbox = (await self.api.stream_info(self.config.names.inbox_stream))["config"]
        groups = consumer.get("priority_groups") or [self.config.priority_group]
        timeout = consumer.get("priority_timeout")
        return dataclasses.replace(
            self.config, ack_wait=consumer["ack_wait"] / NS, max_ack_pending=consumer["max_ack_pending"],
            max_backlog_per_key=max(0, inbox.get("max_msgs_per_subject", -1)),
            duplicate_window=inbox.get("duplicate_window", 0) / NS or self.config.duplicate_window,
            priority_policy=consumer.get("priority_policy", "none"), priority_group=groups[0],
            priority_timeout=timeout / NS if timeout else self.config.priority_timeout,
        )

    async def recreate_consumer(self, *, ack_wait: float | None = None) -> Change:
        """Delete and create the token consumer with this config's layout and priority policy
        (every worker of the queue must be stopped). The lease and ``max_ack_pending`` stay what
        the server had, unless ``ack_wait`` is given; returns the lease before and after."""
        n = self.config.names
        wanted = self.config.consumer_config()
        try:
            current = await self._consumer_config()
        except ConsumerNotFound:
            current = {}
        for kept in ("ack_wait", "max_ack_pending"):
            if kept in current:
                wanted[kept] = current[kept]
        if ack_wait is not None:
            wanted["ack_wait"] = int(ack_wait * NS)
        if current:
            await self.api.delete_consumer(n.token_stream, n.consumer)
        await self.api.add_consumer(n.token_stream, wanted)
        return Change("ack_wait", current.get("ack_wait", wanted["ack_wait"]) / NS, wanted["ack_wait"] / NS)

    # --- streams ---------------------------------------------------------------------------------

    async def _ensure_streams(self) -> None:
        config = self.config
        await self._ensure_stream(config.inbox_config(),
                                  tuple(f for f in _STREAM_LAYOUT if f not in _BACKLOG_CAP + _RELEASE_MARKERS))
        await self._ensure_stream(config.token_config(), _STREAM_LAYOUT)
        await self._ensure_stream(config.dlq_config(), _STREAM_LAYOUT)
        await self._ensure_lease_stream()

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
        self._check_stream(info["config"], self.config.lease_config(), _STREAM_LAYOUT)

    async def _ensure_stream(self, wanted: dict[str, Any], layout: tuple[str, ...]) -> None:
        try:
            info = await self.api.stream_info(wanted["name"])
        except StreamNotFound:
            try:
                await self.api.add_stream(wanted)
                return
            except JetStreamError as refused:
                # Another process may have created it first, with a setting of its own (a backlog cap).
                info = await self._created_meanwhile(self.api.stream_info(wanted["name"]), StreamNotFound, refused)
        self._check_stream(info["config"], wanted, layout)

    def _check_stream(self, existing: dict[str, Any], wanted: dict[str, Any], layout: tuple[str, ...]) -> None:
        name = wanted["name"]
        for field in layout:
            if (differs := _differs(existing, wanted, field)) is not None:
                raise TopologyMismatch(
                    f"stream {name}", field, *differs,
                    f"that is keyqueue's layout, not a setting, so keyqueue did not make this stream: with nothing "
                    f"using the queue, delete it (`nats stream rm {name}`, which deletes its messages) and keyqueue "
                    f"creates it again ({OWNERS})")
        if (differs := _differs(existing, wanted, "allow_direct")) is not None:
            replicas = existing.get("num_replicas", 1)
            raise TopologyMismatch(
                f"stream {name}", "allow_direct", *differs,
                f"direct gets follow the queue's replicas: the stream has {replicas}, this process's QueueConfig "
                f"has replicas={self.config.replicas}; configure the queue with replicas={replicas} ({OWNERS})")

    # --- the token consumer ----------------------------------------------------------------------

    async def _consumer_config(self) -> dict[str, Any]:
        n = self.config.names
        config: dict[str, Any] = (await self.api.consumer_info(n.token_stream, n.consumer))["config"]
        return config

    async def _consumer(self, ack_wait: float | None = None) -> dict[str, Any]:
        """The consumer's config on the server, created from this config (with ``ack_wait`` as
        its lease, if given) when it is missing."""
        n = self.config.names
        try:
            return await self._consumer_config()
        except ConsumerNotFound:
            wanted = self.config.consumer_config()
            if ack_wait is not None:
                wanted["ack_wait"] = int(ack_wait * NS)
            try:
                created: dict[str, Any] = (await self.api.add_consumer(n.token_stream, wanted))["config"]
                return created
            except JetStreamError as refused:
                # Another process may have created it first, with its own settings: the server's apply.
                return await self._created_meanwhile(self._consumer_config(), ConsumerNotFound, refused)

    @staticmethod
    async def _created_meanwhile(read: Awaitable[dict[str, Any]], missing: type[JetStreamError],
                                 refused: JetStreamError) -> dict[str, Any]:
        """What ``read`` finds after a create was refused; the refusal itself if nothing is there."""
        try:
            return await read
        except missing:
            raise refused from None

    def _check_consumer(self, existing: dict[str, Any]) -> None:
        n = self.config.names
        entity = f"consumer {n.token_stream}/{n.consumer}"
        wanted = self.config.consumer_config()
        for field in _CONSUMER_LAYOUT:
            if (differs := _differs(existing, wanted, field)) is not None:
                raise TopologyMismatch(
                    entity, field, *differs,
                    f"that is keyqueue's layout, not a setting: with every worker of the queue stopped, run "
                    f"`keyqueue recreate-consumer {n.queue}` (requests and the queue's settings are kept) ({OWNERS})")
        for field in _PULL_PROTOCOL:
            if (differs := _differs(existing, wanted, field)) is not None:
                raise TopologyMismatch(
                    entity, field, *differs,
                    f"workers pull by the queue's priority policy, so it changes with all of them stopped: stop "
                    f"them, run `keyqueue recreate-consumer {n.queue} --app MODULE:APP` with the app's new "
                    f"QueueConfig, then start them again; or configure this app like the queue ({OWNERS})")
