"""A queue's schedules stream: delayed requests and periodic schedules, kept by nats-server itself.

Stream ``KQ_<Q>_SCHEDULES`` (work-queue retention, ``allow_msg_schedules``; nats-server >= 2.12):

- ``kq.Q.at.<id>``: one delayed request, stored at once with ``Nats-Schedule: @at <due time>``;
  the request's own headers and body, its id in ``X-KQ-Delayed-Request-Id`` and ``Nats-Msg-Id``
  (a retried enqueue stores it once).
- ``kq.Q.periodic.<name>``: one periodic schedule (``@every``, cron, time zone: nats-server >= 2.14),
  with the request every tick enqueues.
- ``kq.Q.due.<key>``: where the server publishes a schedule's request when it fires. Nothing else
  reads these subjects than the ``movers`` consumer, whose workers move each due request into its
  key's inbox and give the key a token (``keyqueue.jetstream.due``).

The server fires a schedule only into a subject of the schedule's own stream, and refuses
``discard: new``, which the inbox uses for a per-key backlog cap; and a fired message reaches no
core subscriber: so schedules fire into a stream of their own, and a durable consumer moves them
(docs/decisions.md, "Delayed and periodic requests").
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from nats.aio.client import Client

from keyqueue.errors import (
    ConsumerNotFound,
    InvalidSchedule,
    JetStreamError,
    MessageNotFound,
    StreamNotFound,
    WrongLastSequence,
)
from keyqueue.jetstream.api import JetStreamApi, PubAck, parse_pub_ack
from keyqueue.jetstream.cron import at_pattern
from keyqueue.jetstream.subjects import QueueNames, request_id_token, validate_request_key
from keyqueue.wire.headers import MSG_ID

__all__ = [
    "DELAYED_REQUEST_ID",
    "MOVERS",
    "PERIODIC_VERSION",
    "SCHEDULES_VERSION",
    "PeriodicDefinition",
    "ScheduleNames",
    "ScheduleStore",
    "parse_time",
    "require_version",
]

NS: Final = 1_000_000_000

SCHEDULES_VERSION: Final = (2, 12, 0)
"""The first nats-server with message schedules (``@at``)."""
PERIODIC_VERSION: Final = (2, 14, 0)
"""The first nats-server with ``@every``, cron and time zones in message schedules."""

MOVERS: Final = "movers"
"""The durable consumer on the due subjects, shared by every worker of the queue."""

MOVERS_ACK_WAIT: Final = 10.0
"""Seconds a worker may take to move one due request before another worker moves it again."""

SCHEDULE: Final = "Nats-Schedule"
SCHEDULE_TARGET: Final = "Nats-Schedule-Target"
SCHEDULE_TIME_ZONE: Final = "Nats-Schedule-Time-Zone"
SCHEDULER: Final = "Nats-Scheduler"
"""On a fired message: the subject of the schedule that fired it."""
SCHEDULE_NEXT: Final = "Nats-Schedule-Next"
"""On a fired message: when its schedule fires next (RFC 3339), or ``purge`` for a one-shot."""

DELAYED_REQUEST_ID: Final = "X-KQ-Delayed-Request-Id"
"""A delayed request's id: the server drops ``Nats-Msg-Id`` from what a schedule fires."""
DUE: Final = "X-KQ-Due"
"""A delayed request's due time (RFC 3339, UTC), for whoever lists pending requests."""
PERIODIC: Final = "X-KQ-Periodic"
"""A periodic schedule's name, on its definition and on every request it fires."""


def require_version(nc: Client, minimum: tuple[int, int, int], what: str) -> None:
    """``InvalidSchedule`` naming the version needed unless the connected server is ``minimum`` or newer."""
    v = nc.connected_server_version
    have = (v.major, v.minor, v.patch)
    if have < minimum:
        raise InvalidSchedule(
            f"{what} need nats-server >= {'.'.join(map(str, minimum))} (JetStream message schedules); the server "
            f"at {nc.connected_url.netloc if nc.connected_url else '?'} is {'.'.join(map(str, have))}"
        )


@dataclass(frozen=True, slots=True)
class ScheduleNames:
    """The schedules stream's names for one queue."""

    queue: str

    @property
    def stream(self) -> str:
        return f"KQ_{self.queue}_SCHEDULES"

    @property
    def at_prefix(self) -> str:
        return f"kq.{self.queue}.at."

    @property
    def periodic_prefix(self) -> str:
        return f"kq.{self.queue}.periodic."

    @property
    def due_prefix(self) -> str:
        return f"kq.{self.queue}.due."

    def due(self, key: str) -> str:
        return self.due_prefix + key

    def periodic(self, name: str) -> str:
        return self.periodic_prefix + name


def schedules_config(queue: str, *, replicas: int = 1, duplicate_window: float = 120.0) -> dict[str, Any]:
    """The schedules stream: work-queue retention, so a moved (acknowledged) due request is gone,
    while schedules, which no consumer reads, stay until they fire or are removed."""
    n = ScheduleNames(queue)
    return {
        "name": n.stream,
        "subjects": [n.at_prefix + ">", n.periodic_prefix + ">", n.due_prefix + ">"],
        "retention": "workqueue",
        "storage": "file",
        "num_replicas": replicas,
        "allow_msg_schedules": True,
        "duplicate_window": int(duplicate_window * NS),
        # The mover that holds the one due request in flight reads the ones after it in one batch
        # (keyqueue.jetstream.due). Off when replicated, as on the queue's other streams.
        "allow_direct": replicas == 1,
    }


def movers_config(queue: str, replicas: int = 1) -> dict[str, Any]:
    """One due request in flight for the whole fleet: due requests join their keys' inboxes in
    the order they fell due, also when a mover dies and its request is moved again."""
    return {
        "durable_name": MOVERS,
        "filter_subject": ScheduleNames(queue).due_prefix + ">",
        "ack_policy": "explicit",
        "ack_wait": int(MOVERS_ACK_WAIT * NS),
        "max_deliver": -1,
        "max_ack_pending": 1,
        "deliver_policy": "all",
        "num_replicas": replicas,
    }


@dataclass(frozen=True, slots=True)
class PeriodicDefinition:
    """A periodic schedule as the server stores it (or as a worker wants it stored)."""

    name: str
    key: str
    pattern: str
    """The ``Nats-Schedule`` value: ``@every 60s``, a six-field cron expression or a name such as ``@daily``."""
    timezone: str | None
    headers: Mapping[str, str]
    """The request's own headers (content type, message type and version)."""
    body: bytes
    seq: int = 0
    """Its sequence in the schedules stream (0: not stored)."""
    stored: dt.datetime | None = None

    def same_as(self, other: PeriodicDefinition) -> bool:
        """Whether storing ``other`` would change nothing (so the running timer is left alone)."""
        return (self.key, self.pattern, self.timezone, dict(self.headers), self.body) == (
            other.key, other.pattern, other.timezone, dict(other.headers), other.body)


_OWN_HEADERS: Final = frozenset(h.lower() for h in (SCHEDULE, SCHEDULE_TARGET, SCHEDULE_TIME_ZONE, PERIODIC,
                                                    "Nats-Rollup", "Nats-Expected-Last-Subject-Sequence"))


class ScheduleStore:
    """A queue's schedules stream: create it, store delayed requests and periodic schedules, read them."""

    def __init__(self, nc: Client, queue: str, *, replicas: int = 1, duplicate_window: float = 120.0,
                 timeout: float = 5.0) -> None:
        self.nc = nc
        self.names = ScheduleNames(queue)
        self.queue_names = QueueNames(queue)
        self.api = JetStreamApi(nc, timeout=timeout)
        self.timeout = timeout
        self.replicas = replicas
        self.duplicate_window = duplicate_window
        self.max_age: float | None = None
        """Seconds a delayed request can wait: the shorter max age of the schedules and inbox streams
        (None: no limit)."""

    async def ensure(self) -> None:
        """Create the stream when missing and learn how long it (and the inbox) keep messages."""
        require_version(self.nc, SCHEDULES_VERSION, "delayed and periodic requests")
        wanted = schedules_config(self.names.queue, replicas=self.replicas, duplicate_window=self.duplicate_window)
        config = await self.api.stream_or_create(wanted)
        if not config.get("allow_msg_schedules") or config.get("retention") != "workqueue":
            raise InvalidSchedule(f"stream {self.names.stream} exists without allow_msg_schedules and work-queue "
                                  "retention: it is not keyqueue's; delete it and keyqueue creates it again")
        ages = [config.get("max_age", 0)]
        try:
            ages.append((await self.api.stream_info(self.queue_names.inbox_stream))["config"].get("max_age", 0))
        except StreamNotFound:
            pass
        limited = [a / NS for a in ages if a]
        self.max_age = min(limited) if limited else None

    async def ensure_movers(self) -> None:
        """The ``movers`` consumer, created when missing (workers call this)."""
        try:
            await self.api.consumer_info(self.names.stream, MOVERS)
        except ConsumerNotFound:
            try:
                await self.api.add_consumer(self.names.stream, movers_config(self.names.queue, self.replicas))
            except JetStreamError:
                await self.api.consumer_info(self.names.stream, MOVERS)  # created meanwhile, or the real error

    # --- delayed requests --------------------------------------------------------------------------

    def check_due(self, due: dt.datetime, now: dt.datetime) -> None:
        """``InvalidSchedule`` if the streams would drop a request due then before it falls due."""
        if self.max_age is not None and (due - now).total_seconds() >= self.max_age:
            raise InvalidSchedule(
                f"a request due at {due.isoformat()} would be dropped first: the queue's streams keep messages "
                f"for {self.max_age:g}s")

    async def delay(self, key: str, request_id: str, headers: Mapping[str, str], body: bytes,
                    due: dt.datetime, *, msg_id: str | None = None) -> PubAck:
        """Store a request that the server moves to ``kq.Q.due.<key>`` at ``due``; a request id seen in
        the duplicate window stores nothing (``duplicate``). ``msg_id`` deduplicates on another id
        (a due request delayed again)."""
        validate_request_key(key)
        own = {k: v for k, v in headers.items() if k.lower() != MSG_ID.lower()}
        schedule_headers = {
            **own,
            MSG_ID: msg_id or request_id,
            DELAYED_REQUEST_ID: request_id,
            DUE: due.astimezone(dt.UTC).isoformat(),
            SCHEDULE: at_pattern(due),
            SCHEDULE_TARGET: self.names.due(key),
        }
        # One subject per delayed request: a schedule's subject holds one schedule (a roll-up).
        subject = self.names.at_prefix + request_id_token(request_id)
        msg = await self.api._request(subject, body, self.timeout, schedule_headers)
        return parse_pub_ack(msg)

    # --- periodic schedules -------------------------------------------------------------------------

    async def periodic(self) -> dict[str, PeriodicDefinition]:
        """Every periodic schedule stored for the queue, by name."""
        subjects = await self.api.subjects(self.names.stream, self.names.periodic_prefix + ">")
        found: dict[str, PeriodicDefinition] = {}
        for subject in sorted(subjects):
            definition = await self._read_periodic(subject)
            if definition is not None:
                found[definition.name] = definition
        return found

    async def _read_periodic(self, subject: str) -> PeriodicDefinition | None:
        try:
            body = await self.api.request(f"STREAM.MSG.GET.{self.names.stream}", {"last_by_subj": subject})
        except MessageNotFound:
            return None
        message = body["message"]
        headers = _headers(message.get("hdrs"))
        lower = {k.lower(): v for k, v in headers.items()}
        target = lower.get(SCHEDULE_TARGET.lower(), "")
        if not target.startswith(self.names.due_prefix) or SCHEDULE.lower() not in lower:
            return None
        data = base64.b64decode(message["data"]) if message.get("data") else b""
        stored = parse_time(message["time"]) if message.get("time") else None
        return PeriodicDefinition(
            name=subject[len(self.names.periodic_prefix):], key=target[len(self.names.due_prefix):],
            pattern=lower[SCHEDULE.lower()], timezone=lower.get(SCHEDULE_TIME_ZONE.lower()),
            headers={k: v for k, v in headers.items() if k.lower() not in _OWN_HEADERS},
            body=data, seq=int(message["seq"]), stored=stored,
        )

    async def put_periodic(self, wanted: PeriodicDefinition) -> bool:
        """Make the server's schedule ``wanted.name`` be ``wanted``; False if it already was.

        Safe with many workers at once: each write expects the sequence it read, so of two workers
        that both find it missing or different one stores it and the other, refused, reads it again
        and finds it as wanted. An equal schedule is not written again, which would restart its timer.
        """
        require_version(self.nc, PERIODIC_VERSION, "periodic schedules")
        subject = self.names.periodic(wanted.name)
        pause = 0.01
        for _ in range(10):
            current = await self._read_periodic(subject)
            if current is not None and current.same_as(wanted):
                return False
            headers = {
                **wanted.headers,
                PERIODIC: wanted.name,
                SCHEDULE: wanted.pattern,
                SCHEDULE_TARGET: self.names.due(wanted.key),
                "Nats-Expected-Last-Subject-Sequence": str(current.seq if current is not None else 0),
            }
            if wanted.timezone is not None:
                headers[SCHEDULE_TIME_ZONE] = wanted.timezone
            try:
                parse_pub_ack(await self.api._request(subject, wanted.body, self.timeout, headers))
                return True
            except WrongLastSequence:
                # Another worker wrote it meanwhile (on a replicated stream its write may still be in
                # flight, 10164): compare again after a pause.
                await asyncio.sleep(pause)
                pause = min(0.5, pause * 2)
                continue
        raise JetStreamError(f"periodic schedule {wanted.name!r} kept changing while it was being stored")

    async def remove_periodic(self, name: str) -> bool:
        """Remove the periodic schedule ``name``; False if there was none."""
        body = await self.api.request(f"STREAM.PURGE.{self.names.stream}", {"filter": self.names.periodic(name)})
        return int(body.get("purged", 0)) > 0

    async def pending_delays(self) -> int:
        """How many delayed requests wait for their due time."""
        return sum((await self.api.subjects(self.names.stream, self.names.at_prefix + ">")).values())


def _headers(raw: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if not raw:
        return headers
    for line in base64.b64decode(raw).decode(errors="replace").split("\r\n")[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
    return headers



def parse_time(text: str) -> dt.datetime:
    """A JetStream timestamp (RFC 3339 with up to nanoseconds) as an aware datetime, to the microsecond."""
    text = text.strip().replace("Z", "+00:00")
    base, sep, rest = text.partition(".")
    if sep:
        # Only the fraction's digits: the zone after it (+00:00) has digits too.
        digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
        text = f"{base}.{digits[:6].ljust(6, '0')}{rest[len(digits):]}"
    return dt.datetime.fromisoformat(text)
