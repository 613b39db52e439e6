"""Periodic requests declared in code, kept by nats-server, and the workers' side of schedules.

::

    app.periodic("nightly-report", report, cron="0 2 * * *", timezone="Europe/Oslo", kwargs={"kind": "daily"})
    app.periodic("heartbeat", ping, every=30)

There is no beat process. A declaration is a ``Periodic``; every worker that starts makes the
server's periodic schedules of its queues match the app's (``ScheduleKeeper.start``): a missing
or different one is stored, one the app no longer declares is removed, and an equal one is left
alone, so a restart does not restart its timer. Many workers starting at once agree through
compare-and-set writes (``ScheduleStore.put_periodic``). The server fires each schedule once per
tick whatever the number of workers; a worker's ``DueMover`` turns the tick into one request.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import InvalidSchedule
from keyqueue.jetstream.cron import (
    cron_pattern,
    every_pattern,
    every_seconds,
    next_cron,
    next_every,
    parse_every,
    zone,
)
from keyqueue.jetstream.due import DueMover
from keyqueue.jetstream.schedules import (
    PERIODIC_VERSION,
    SCHEDULES_VERSION,
    PeriodicDefinition,
    ScheduleStore,
    require_version,
)
from keyqueue.tasks.task import BatchTask
from keyqueue.wire import CBOR, dumps
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.client import Client

    from keyqueue.jetstream.topology import QueueConfig
    from keyqueue.tasks.task import AnyTask

__all__ = ["Periodic", "ScheduleKeeper", "make_periodic"]

log = logging.getLogger("keyqueue.schedules")

_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True)
class Periodic:
    """A periodic schedule declared with ``App.periodic``: every tick enqueues one request of ``task``."""

    name: str
    task: AnyTask
    key: str
    pattern: str
    """What the server is given: ``@every 30s``, a six-field cron expression, or a name such as ``@daily``."""
    timezone: str
    """The IANA time zone a cron expression is read in (``UTC`` for ``every``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    body: bytes = b""

    @property
    def queue(self) -> str:
        return self.task.queue

    @property
    def every(self) -> float | None:
        """The interval in seconds, for an ``every`` schedule."""
        return every_seconds(self.pattern)

    def definition(self) -> PeriodicDefinition:
        """The schedule as the server stores it."""
        headers = {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: self.task.name, H.MESSAGE_VERSION: str(self.task.spec.version)}
        return PeriodicDefinition(self.name, self.key, self.pattern, None if self.timezone == "UTC" else self.timezone,
                                  headers, self.body)

    def next_after(self, after: dt.datetime, since: dt.datetime) -> dt.datetime:
        """When it fires next after ``after``, for a schedule stored at ``since`` (an ``every``
        counts from there, a cron expression from the clock)."""
        every = self.every
        if every is not None:
            return next_every(every, since, after)
        fire = next_cron(self.pattern, zone(self.timezone), after)
        assert fire is not None  # checked when declared
        return fire.astimezone(dt.UTC)


def make_periodic(name: str, task: AnyTask, *, cron: str | None, every: float | dt.timedelta | None,
                  timezone: str, kwargs: Mapping[str, Any] | None) -> Periodic:
    """A checked ``Periodic`` (``InvalidSchedule`` for a bad schedule; the task's own errors for bad kwargs)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidSchedule(f"periodic schedule name {name!r} must be 1-128 letters, digits, '-' or '_'")
    if (cron is None) == (every is None):
        raise InvalidSchedule(f"periodic {name}: give cron= or every=, not both or neither")
    zone(timezone)
    if cron is not None:
        pattern = cron_pattern(cron)
    else:
        assert every is not None
        if timezone != "UTC":
            raise InvalidSchedule(f"periodic {name}: timezone= applies to cron= only (nats-server reads every= "
                                  "as an interval, in no time zone)")
        pattern = every_pattern(parse_every(every))
    arguments = dict(kwargs or {})
    if isinstance(task, BatchTask):
        key, fields = task.fields_for((arguments,), {})
    else:
        key, fields = task.fields_for((), arguments)
    return Periodic(name, task, key, pattern, timezone, arguments, dumps(fields, CBOR))


class ScheduleKeeper:
    """A worker's part of its queues' schedules: the periodic ones made to match the app's when it
    starts, and a ``DueMover`` per queue while it runs."""

    def __init__(self, nc: Client, configs: Sequence[QueueConfig], periodic: Sequence[Periodic],
                 worker: str) -> None:
        self.nc = nc
        self.configs = list(configs)
        self.periodic = list(periodic)
        self.worker = worker
        self.movers: dict[str, DueMover] = {}

    async def start(self) -> None:
        """Create each queue's schedules stream and ``movers`` consumer, and sync the periodic
        schedules. On a server without message schedules, a worker with no periodic schedule to
        keep serves its queues without (nothing can be delayed there); with one it fails, naming
        the version needed."""
        if self.periodic:
            require_version(self.nc, PERIODIC_VERSION, "periodic schedules")
        v = self.nc.connected_server_version
        if (v.major, v.minor, v.patch) < SCHEDULES_VERSION:
            log.info("worker %s: nats-server %s has no message schedules: delayed requests are off", self.worker,
                     ".".join(map(str, (v.major, v.minor, v.patch))))
            return
        for config in self.configs:
            store = ScheduleStore(self.nc, config.name, replicas=config.replicas,
                                  duplicate_window=config.duplicate_window)
            await store.ensure()
            await store.ensure_movers()
            await self._sync(store, [p for p in self.periodic if p.queue == config.name])
            self.movers[config.name] = DueMover(self.nc, config.name)

    async def _sync(self, store: ScheduleStore, declared: Sequence[Periodic]) -> None:
        wanted = {p.name: p.definition() for p in declared}
        on_server = await store.periodic()
        for name, definition in wanted.items():
            if await store.put_periodic(definition):
                log.info("worker %s: periodic schedule %s of queue %s stored (%s%s)", self.worker, name,
                         store.names.queue, definition.pattern,
                         f" in {definition.timezone}" if definition.timezone else "")
        for name in sorted(set(on_server) - set(wanted)):
            if await store.remove_periodic(name):
                log.info("worker %s: periodic schedule %s of queue %s removed: the app no longer declares it",
                         self.worker, name, store.names.queue)

    async def run(self) -> None:
        """Move due requests until :meth:`stop`."""
        if not self.movers:
            return
        async with asyncio.TaskGroup() as group:
            for queue, mover in self.movers.items():
                group.create_task(mover.run(), name=f"keyqueue-due:{queue}")

    def stop(self) -> None:
        for mover in self.movers.values():
            mover.stop()
