"""Releasing keys a gone worker still holds, so they move now rather than when its leases run out.

A worker that dies holds its keys until its lease records expire (``ack_wait``, 30 s by default)
and its tokens are redelivered. When its death is known (a supervisor saw its child exit, an
operator saw its host go down), :func:`release_keys` hands each of its keys on at once:

1. it reads the key's lease record (``kq.<queue>.lease.<key>``) and the holder it names;
2. it skips, unless ``force``, a key whose holder looks alive, judged per process (the record
   names the worker, its host and pid; one heartbeat record per worker name may be another
   process's, one that just stopped). The holder's own heartbeat (``keyqueue.admin.workers``,
   same name, host and pid) decides where there is one: live, or gone (stopped, or silent).
   Without one, the record does: renewed within a renewal interval means alive. Both
   are judged by the server's clock only (the record's and the heartbeat's timestamps against the
   server's time of the read), never the caller's. The keys of gone holders are released all the
   same; :class:`HolderAlive` then says which were skipped and why;
3. it deletes that record by its sequence (a record written since by anyone else is untouched);
4. it hands the holder's token back with a ``-NAK`` on the ack subject the record names: the
   server delivers it again at once, to a worker with a free slot, with its delivery count one up
   (so the next holder counts the request the dead one had in hand, as after any crash). A record
   that names no ack subject has the token removed by its sequence instead. If requests wait and
   no token is left, a fresh one is published.

Releasing a holder that is in fact alive lets a second worker start the key beside it (until its
next renewal finds the record gone and it stops): the fencing token is what then protects the
key's stores. That is why the check is the default and ``force`` is for when death is known.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from keyqueue.admin.inspection import parse_time
from keyqueue.admin.workers import queue_workers, server_time
from keyqueue.errors import KeyqueueError, StreamNotFound
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import headers as H

__all__ = ["HolderAlive", "Released", "Skipped", "describe", "release_keys"]


@dataclass(frozen=True)
class Skipped:
    """A key not released: its holder looks alive."""

    key: str
    worker: str | None
    pid: int | None
    why: str


class HolderAlive(KeyqueueError):
    """Some holders look alive: their keys were skipped (``skipped``), the others released
    (``released``). Release them with ``force`` only if you know they are gone."""

    def __init__(self, message: str, skipped: list[Skipped], released: list[Released]) -> None:
        super().__init__(message)
        self.skipped = skipped
        self.released = released


@dataclass(frozen=True)
class Released:
    """One key handed on: who held it, the record removed, and whether a fresh token was published."""

    key: str
    worker: str | None
    pid: int | None
    fence: int
    """The removed record's sequence."""
    waiting: bool
    """The key has requests waiting."""
    redelivered: bool
    """The holder's token was handed back for delivery at once."""
    rescheduled: bool
    """A fresh token was published (the holder's was gone, and requests wait)."""
    forced: bool
    """Released although the holder looked alive (``force``)."""


@dataclass(frozen=True)
class _Record:
    key: str
    msg: StoredMsg
    body: dict[str, Any]

    @property
    def worker(self) -> str | None:
        worker = self.body.get("worker")
        return worker if isinstance(worker, str) and worker else None

    @property
    def pid(self) -> int | None:
        pid = self.body.get("pid")
        return pid if isinstance(pid, int) else None

    @property
    def host(self) -> str | None:
        host = self.body.get("host")
        return host if isinstance(host, str) and host else None

    @property
    def holder(self) -> str:
        """``worker w1 (pid 4711 on host-a)``: the process the record names."""
        where = " ".join(p for p in (f"pid {self.pid}" if self.pid is not None else "",
                                     f"on {self.host}" if self.host else "") if p)
        return f"worker {self.worker or '(unnamed)'}" + (f" ({where})" if where else "")

    @property
    def ack(self) -> str | None:
        ack = self.body.get("ack")
        return ack if isinstance(ack, str) and ack.startswith("$JS.ACK.") else None

    @property
    def token_seq(self) -> int | None:
        seq = self.body.get("token")
        return seq if isinstance(seq, int) and seq > 0 else None


async def release_keys(api: JetStreamApi, queue: str, *, key: str | None = None, worker: str | None = None,
                       pid: int | None = None, force: bool = False) -> list[Released]:
    """Release ``key``, or every key held by ``worker`` (and, if given, its process ``pid``), in
    ``queue``; returns what was released (a key held by nobody is not in it). Unless ``force``, a
    key whose holder looks alive is skipped; if any was, :class:`HolderAlive` is raised once the
    others are released, with both lists."""
    if (key is None) == (worker is None):
        raise KeyqueueError("release one key, or the keys of one worker: give a key or a worker, not both")
    names = QueueNames(queue)
    records = await _lease_records(api, names, key)
    chosen = [r for r in records if key is not None or (r.worker == worker and (pid is None or r.pid == pid))]
    if not chosen:
        return []
    alive = {} if force else await _alive(api, queue, names, chosen)
    publisher = Publisher(api.nc, names, timeout=api.timeout, outage_wait=0.0)
    released = list(await asyncio.gather(*(_release(api, names, publisher, r, forced=force)
                                           for r in chosen if r.key not in alive)))
    if alive:
        skipped = [Skipped(r.key, r.worker, r.pid, alive[r.key]) for r in chosen if r.key in alive]
        who = ", ".join(f"{s.key} ({s.why})" for s in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        done = f"; released the other {len(released)}" if released else ""
        raise HolderAlive(f"the holder of {len(skipped)} key(s) looks alive: {who}; skipped{done}. Stop that "
                          "worker first, or release with --force if you know it is gone (a live holder would run "
                          "beside the next one)", skipped, released)
    return released


async def _lease_records(api: JetStreamApi, names: QueueNames, key: str | None) -> list[_Record]:
    try:
        if key is not None:
            subjects = [names.lease(key)]
        else:
            subjects = list(await api.subjects(names.lease_stream, names.lease_prefix + ">"))
        msgs = await asyncio.gather(*(api.get_msg(names.lease_stream, last_by_subject=s, direct=False)
                                      for s in subjects))
    except StreamNotFound:
        return []
    found = []
    for subject, msg in zip(subjects, msgs, strict=True):
        if msg is None:
            continue
        try:
            body = json.loads(msg.data)
        except ValueError:
            body = {}
        found.append(_Record(names.key_of(subject), msg, body if isinstance(body, dict) else {}))
    return found


async def _alive(api: JetStreamApi, queue: str, names: QueueNames, records: list[_Record]) -> dict[str, str]:
    """Key -> why its holder looks alive, for the holders that do (judged by the server's clock)."""
    now = await server_time(api, names.lease_stream)
    workers = {w.name: w for w in await queue_workers(api, queue, now=now)}
    alive: dict[str, str] = {}
    for record in records:
        registered = workers.get(record.worker or "")
        # The heartbeat speaks for the record's holder only if it is the same process: one record per
        # worker name is kept, and another process of that name may have written it (one that just stopped).
        own = (registered is not None and record.pid is not None and registered.record.pid == record.pid
               and record.host is not None and registered.record.host == record.host)
        if own and registered is not None:
            if registered.live:
                alive[record.key] = f"worker {record.worker}'s heartbeat is live"
            continue  # that very process's heartbeat says: live, or gone (stopped, or silent)
        renewed = parse_time(record.msg.timestamp)
        ttl = record.body.get("ttl")
        interval = float(ttl) / 3 + 1.0 if isinstance(ttl, int | float) and ttl > 0 else 11.0
        if renewed is not None and now - renewed.timestamp() <= interval:
            other = ""
            if registered is not None and not own:
                state = "live" if registered.live else registered.gone_because
                other = (f"; the heartbeat of that name is another process's (pid {registered.record.pid} on "
                         f"{registered.record.host}, {state})")
            alive[record.key] = (f"{record.holder} renewed its lease record {now - renewed.timestamp():.1f}s "
                                 f"ago{other}")
    return alive


async def _release(api: JetStreamApi, names: QueueNames, publisher: Publisher, record: _Record, *,
                   forced: bool) -> Released:
    await _delete(api, names.lease_stream, record.msg.seq)
    redelivered = False
    if record.ack is not None:
        await api.nc.publish(record.ack, b"-NAK")
        await api.nc.flush(timeout=max(1, int(api.timeout)))
        redelivered = True
    elif record.token_seq is not None:
        await _delete(api, names.token_stream, record.token_seq)
    head = await api.get_msg(names.inbox_stream, seq=1, next_by_subject=names.inbox(record.key), direct=False)
    if head is not None and H.is_release_marker(head.headers):  # a former holder's, before any request
        head = await api.get_msg(names.inbox_stream, seq=head.seq + 1, next_by_subject=names.inbox(record.key),
                                 direct=False)
    waiting = head is not None
    # Refused (10077) while the handed-back token is there: then it is what schedules the key.
    rescheduled = waiting and await publisher.schedule(record.key)
    return Released(record.key, record.worker, record.pid, record.msg.seq, waiting, redelivered, rescheduled,
                    forced)


async def _delete(api: JetStreamApi, stream: str, seq: int) -> None:
    await api.delete_msg(stream, seq)  # one already gone is fine


def describe(released: Released) -> str:
    """One line for a released key: ``order-17 (held by w1 pid 4711, record 812): requests waiting, rescheduled``."""
    who = f"held by {released.worker or 'an unnamed worker'}" + (f" pid {released.pid}" if released.pid else "")
    if not released.waiting:
        then = "no requests waiting"
    elif released.redelivered and not released.rescheduled:
        then = "requests waiting, its token handed to the next worker"
    elif released.rescheduled:
        then = "requests waiting, rescheduled with a new token"
    else:
        then = "requests waiting, already scheduled"
    return f"{released.key} ({who}, record {released.fence}{', forced' if released.forced else ''}): {then}"
