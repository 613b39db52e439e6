"""``python -m bench.r3_purge_failover``: does an answered purge survive a SIGKILL of the stream's leader?

A 3-node embedded cluster (``EmbeddedCluster``), R3 file streams with ``allow_direct``. Each trial
creates fresh streams, puts 200 messages on one subject of each (``<stream>.in.k``, one awaited
publish at a time), purges below a sequence (``$JS.API.STREAM.PURGE`` with ``filter`` and ``seq``,
as keyqueue does), SIGKILLs one node (the *victim*, node ``trial % 3``) and reads what is left once
each stream has a leader again. The victim is restarted before the next trial (but see
``--restart-at-once`` below). One kill per trial serves every variant, each on its own stream
(leaders are moved with a preferred stepdown):

1. ``seq``     leader on the victim; one purge below 101, its reply awaited; then the kill.
2. ``pipe``    leader on the victim; 10 purges below 11, 21, .., 101 sent together, all answered.
3. ``mid``     leader on the victim; purges below 11..51 sent together and answered, then those
               below 61..101 sent and the victim killed at once: before the client flushed them,
               once they reached the client's server, or 0.5, 1 or 2 ms after that (by turns):
               they are in flight at the kill. Their replies are awaited until 1.5 s after the
               new leader shows. (Not "send 10, kill at the 5th reply": the leader answers a
               pipeline in a burst, so the other 5 replies would mostly be in already.)
4. leaderless reads: from the kill until a stream's new leader shows, both survivors are asked
   every 0.1 s for the first message on the subject (``$JS.API.DIRECT.GET`` with
   ``next_by_subj`` from seq 1), by a client connected to that node (its replica answers).
   On a stream set up moments before (``--age 0``) the followers may not serve direct gets yet:
   then both survivors answer 503 (no responders) for the first ~1.5 s after the kill.
5. ``idle``    leader on the victim, nothing purged before the kill; purges below 51 (at the kill)
               and below 61 (2 s later, if still leaderless) are sent while it has no leader.
6. ``del``     leader on the victim; 20 per-sequence deletes of seqs 1..20
               (``$JS.API.STREAM.MSG.DELETE`` with ``no_erase``) sent together, all answered.
C. ``ctrl``    leader on another node, the victim is a follower; 10 pipelined purges as in 2.

``--restart-at-once``: the victim is restarted as soon as the SIGKILL has been reaped (its
``start()`` is called at once; the kill left its store locked for it), within the trial, as the
chaos soak's ``leader-kill-9`` fault does, so the restarted node may be elected again. A new
leader is then any leader elected after the kill (``leader_since``), the victim included. Each
node, the restarted one too, is read by direct get through a client of its own, and each node's
own replica of every stream is read from its ``/jsz`` (first seq, message count: what that node
stores, whoever answers the direct get). The reads are made at election, settled (1.5 s later)
and *late*, 10 s after the restart (or at once after the settled reads if those come later).
From the restart until the late reads, every 0.1 s, the restarted node is also asked by direct get
through its client, and every node's ``/jsz`` is read: the *rejoin* reads. With the flag each trial has a second
step, after the first one's node is back:

L. ``lagfollow`` / ``lagdel``  a lagging follower. Fresh streams, leader on node ``trial % 3``
   (the victim); the follower ``(trial + 1) % 3`` is SIGKILLed and restarted at once, then the
   leader, which kept its quorum with the third node, answers 10 pipelined purges as in 2.
   (``lagfollow``) and 20 pipelined deletes as in 6. (``lagdel``), sent while the follower is
   restarting (``at launch``: right after its process is launched; ``on reconnect``: once a
   client of the follower's has reconnected to it, i.e. it listens again; by turns). Once all
   are answered the leader is SIGKILLed and restarted at once; the follower that lagged, the
   third node or the restarted leader becomes leader. The main client is on the third node (or
   on the leader with ``--client-on victim``). Read as in the first step.

The main client is connected to a survivor (``--client-on victim`` connects it to the victim, so
its connection drops at the kill as well). After a stream's new leader shows in ``STREAM.INFO``
(polled every 0.1 s), it is read at once (*at election*) and again 1.5 s later (*settled*): the first
message on the subject via ``STREAM.MSG.GET`` (leader) and via a direct get on each survivor, and
the subject's count from ``STREAM.INFO`` with ``subjects_filter``.

How to read the output: *answered* is the highest purge point (``seq``) whose reply said success;
every message below it must be gone (for deletes: every answered seq must be gone, and
*answered* is the lowest seq that need not be). ``lost`` counts streams whose settled first message is
below that point (an answered purge undone); ``stale`` counts reads below it (at election, or while
leaderless). ``beyond`` counts streams purged past the answered point (a purge applied although its
reply never came). Election times run from the kill to the new leader's ``leader_since`` (server
clock, same machine); a read counts as leaderless if it was answered before that. With
``--restart-at-once`` a further table splits reads by where they were made (leader, each node's
direct get, each node's own replica) and when (settled, late, rejoin), and every undone purge or
delete is listed with its trial's sequence of events.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import nats
import nats.errors
from nats.aio.client import Client, Server

from keyqueue.jetstream.api import stored_seconds
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import find_nats_server, server_version

MESSAGES: Final = 200
POINTS: Final = tuple(range(11, 102, 10))
"""The pipelined purges' points: below 11, 21, .., 101."""
DELETED: Final = tuple(range(1, 21))
"""The pipelined deletes' sequences."""
POLL: Final = 0.1
"""Seconds between polls (leader, leaderless reads)."""
LEADER_POLL: Final = 0.1
"""Seconds to wait for ``STREAM.INFO`` while polling for the new leader (only the leader answers)."""
KILL_MODES: Final = ("unflushed", "flushed", "+0.5 ms", "+1 ms", "+2 ms")
"""When the victim is killed after the in-flight purges of variant 3 are sent: before the client
has flushed them, once flushed (they reached the client's server), or that long after the flush."""
LAG_MODES: Final = ("at launch", "on reconnect")
"""When step L sends its purges and deletes after restarting the follower: right after its process
is launched, or once a client of the follower's has reconnected to it."""
READ_TIMEOUT: Final = 0.5
SETTLE: Final = 1.5
"""Seconds after the last new leader shows before the settled reads (and before in-flight purges
still unanswered are given up)."""
LATE: Final = 10.0
"""With ``--restart-at-once``: seconds after the victim's restart until the late reads."""
RESTART_TIMEOUT: Final = 60.0
"""Seconds a restarted node has to become ready (``/healthz``: caught up) before the run fails."""
VICTIM_LED: Final = ("seq", "pipe", "mid", "idle", "del")
VARIANTS: Final = (*VICTIM_LED, "ctrl")
LAG_VARIANTS: Final = ("lagfollow", "lagdel")
"""Step L's streams (only with ``--restart-at-once``), both led by the victim."""
DELETES: Final = ("del", "lagdel")
"""The variants whose requests are per-sequence deletes, not purges."""
TITLES: Final = {
    "seq": "1 sequential purge <101, kill",
    "pipe": "2 10 pipelined purges, kill",
    "mid": "3 kill with purges in flight",
    "idle": "5 purges sent while leaderless",
    "del": "6 20 pipelined deletes 1..20, kill",
    "ctrl": "C follower killed (pipelined)",
    "lagfollow": "L follower restarted, 10 purges, kill",
    "lagdel": "L follower restarted, 20 deletes, kill",
}

Read = int | str
"""A read's outcome: the first stored sequence on the subject, ``0`` for none (404), or an error."""
Store = tuple[int, int] | str
"""A node's own replica of a stream by its ``/jsz``: (first seq, messages), or why not."""


@dataclass
class Reply:
    """A purge (or delete) request and what came of it (times in seconds from the kill)."""

    point: int
    """Purge below this sequence (a delete: delete this sequence)."""
    sent: float = 0.0
    at: float | None = None
    purged: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.purged is not None


@dataclass
class Reads:
    """What one round of reads of a stream showed."""

    leader: Read = "-"
    """The first message on the subject by ``STREAM.MSG.GET`` (the leader answers)."""
    replicas: dict[str, Read] = field(default_factory=dict)
    """The first message by direct get, per node asked (a client connected to that node)."""
    count: Read = "-"
    """The subject's message count (``STREAM.INFO`` with ``subjects_filter``)."""
    leader_name: str = "-"
    """The leader named by that ``STREAM.INFO``."""
    stores: dict[str, Store] = field(default_factory=dict)
    """Each node's own replica by its ``/jsz`` (with ``--restart-at-once``; settled and late reads)."""
    at: float = 0.0
    """Seconds from the kill when the round was sent."""

    def firsts(self) -> list[int]:
        return [r for r in (self.leader, *self.replicas.values()) if isinstance(r, int)]


@dataclass
class StreamRun:
    """One variant's stream in one trial."""

    variant: str
    stream: str
    subject: str
    leader: str = ""
    purges: list[Reply] = field(default_factory=list)
    """Its purges, or for ``DELETES`` its deletes."""
    leaderless: list[tuple[float, str, Read]] = field(default_factory=list)
    """Direct gets while leaderless: (seconds from the kill, survivor, outcome)."""
    election: float | None = None
    """Seconds from the kill until ``STREAM.INFO`` named a new leader (as the client saw it)."""
    elected: float | None = None
    """Seconds from the kill to the new leader's ``leader_since`` (the server's clock: same machine)."""
    new_leader: str | None = None
    at_election: Reads = field(default_factory=Reads)
    leader_reads: list[tuple[float, Read]] = field(default_factory=list)
    """``STREAM.MSG.GET`` replies (only a leader answers) to reads sent every 20 ms from the kill
    until the new leader shows: (seconds from the kill, outcome)."""
    settled: Reads = field(default_factory=Reads)
    late: Reads | None = None
    """With ``--restart-at-once``: the reads 10 s after the restart."""
    rejoin: list[tuple[float, Read]] = field(default_factory=list)
    """With ``--restart-at-once``: direct gets through a client of the restarted victim, every 0.1 s
    from its restart until the late reads (seconds from the kill, outcome)."""
    rejoin_stores: list[tuple[float, str, Store]] = field(default_factory=list)
    """Each node's own replica by its ``/jsz``, as often (a restarted node once it serves ``/jsz``
    again): (seconds from the kill, node, replica)."""

    @property
    def deletes(self) -> bool:
        return self.variant in DELETES

    def gone(self, before_kill: bool = False) -> frozenset[int]:
        """The sequences an answer said are gone (answered before the kill only, if asked)."""
        done = [p.point for p in self.purges if p.ok and (not before_kill or (p.at is not None and p.at < 0))]
        return frozenset(done) if self.deletes else frozenset(range(1, max(done, default=1)))

    @property
    def answered(self) -> int:
        """The lowest sequence no answer says is gone (for purges: the highest point answered with
        success; 1: none, nothing must be gone)."""
        gone = self.gone()
        return next(seq for seq in itertools.count(1) if seq not in gone)

    @property
    def answered_before_kill(self) -> int:
        gone = self.gone(before_kill=True)
        return next(seq for seq in itertools.count(1) if seq not in gone)

    def undone(self, reads: Reads) -> bool:
        """Whether ``reads`` show a message an answer said is gone (first message or count)."""
        gone = self.gone()
        too_many = isinstance(reads.count, int) and reads.count > MESSAGES - len(gone)
        return too_many or any(first in gone for first in reads.firsts())

    def lost(self) -> bool:
        return self.undone(self.settled)

    def lost_late(self) -> bool:
        return self.late is not None and self.undone(self.late)

    def undone_at_leader(self, reads: Reads) -> bool:
        """``undone`` by the leader's answers alone (``STREAM.MSG.GET`` and the count)."""
        gone = self.gone()
        too_many = isinstance(reads.count, int) and reads.count > MESSAGES - len(gone)
        return too_many or (isinstance(reads.leader, int) and reads.leader in gone)

    def stale_replicas(self, reads: Reads) -> list[str]:
        """The nodes whose direct get showed a message an answer said is gone."""
        gone = self.gone()
        return [node for node, r in reads.replicas.items() if isinstance(r, int) and r in gone]

    def stale_store(self, store: Store, before_kill: bool = False) -> bool:
        """Whether a node's own replica still holds a message an answer said is gone."""
        if not isinstance(store, tuple):
            return False
        gone = self.gone(before_kill)
        first, messages = store
        return first in gone or messages > MESSAGES - len(gone)

    def behind(self, reads: Reads) -> list[str]:
        """The nodes whose own replica (``/jsz``) still holds a message an answer said is gone."""
        return [node for node, store in reads.stores.items() if self.stale_store(store)]

    def stale_at_election(self) -> bool:
        firsts = [*self.at_election.firsts(), *(r for _, r in self.leader_reads if isinstance(r, int))]
        gone = self.gone(before_kill=True)
        return any(first in gone for first in firsts)

    def leaderless_reads(self) -> list[tuple[float, str, Read]]:
        """The direct gets answered (or failed) before the new leader took over."""
        end = self.elected if self.elected is not None else self.election
        return [read for read in self.leaderless if end is None or read[0] < end]

    def stale_leaderless(self) -> bool:
        gone = self.gone(before_kill=True)
        return any(isinstance(r, int) and r in gone for _, _, r in self.leaderless_reads())

    def stale_rejoin(self) -> list[tuple[float, Read]]:
        """The rejoin direct gets that showed a message answered gone before the kill."""
        gone = self.gone(before_kill=True)
        return [(at, r) for at, r in self.rejoin if isinstance(r, int) and r in gone]

    def stale_rejoin_stores(self, node: str | None = None) -> list[tuple[float, str, Store]]:
        """The nodes' (or ``node``'s) own replicas each time one held a message answered gone before the kill."""
        return [(at, name, store) for at, name, store in self.rejoin_stores
                if (node is None or name == node) and self.stale_store(store, before_kill=True)]

    def beyond(self) -> bool:
        firsts = self.settled.firsts()
        return bool(firsts) and min(firsts) > self.answered


@dataclass
class Revival:
    """A node SIGKILLed and restarted at once (``--restart-at-once``); times are monotonic."""

    index: int
    node: str
    old_url: str
    """Its monitoring URL before the kill (the new process picks a new port)."""
    killed: float
    launched: float = 0.0
    """When its new process was launched."""
    ready: float | None = None
    """When ``start()`` returned: ``/healthz`` says it is caught up, and JetStream answers."""


@dataclass
class Trial:
    kind: str
    """``main`` (the first step) or ``lagfollow`` (step L)."""
    victim: str
    client_on: str
    meta_leader: str
    kill_mode: str
    """Step 1's kill mode (variant 3), or step L's lag mode."""
    runs: dict[str, StreamRun]
    t_kill: float = 0.0
    """The (leader's) kill, monotonic."""
    revivals: list[Revival] = field(default_factory=list)
    """The nodes restarted within the trial: step L's follower first, then the victim."""
    number: int = 0

    def since_kill(self, moment: float | None) -> str:
        return "-" if moment is None else f"{moment - self.t_kill:+.2f}"


# --- requests ----------------------------------------------------------------------------------


async def quiet(_: Exception) -> None:
    """nats-py logs every connection error with a traceback unless given an error callback."""


async def connect(urls: list[str], *, reconnect: bool = True) -> Client:
    """A client on the first of ``urls`` (in order), reconnecting to the others if it drops."""
    return await nats.connect(servers=urls, dont_randomize=True, allow_reconnect=reconnect, error_cb=quiet,
                              reconnect_time_wait=0.1, max_reconnect_attempts=-1, connect_timeout=2)


async def connect_pinned(url: str, reconnected: asyncio.Event | None = None) -> Client:
    """A client of one node that, should it drop, reconnects to that node only, every 0.1 s (left
    to itself, nats-py would also try the servers the cluster advertised, and read another node's
    replica); ``reconnected`` is set once it has reconnected."""

    def home(pool: list[Server], _: dict[str, Any]) -> tuple[Server | None, float]:
        return next((server for server in pool if server.uri.netloc == netloc), None), POLL

    async def on_reconnect() -> None:
        if reconnected is not None:
            reconnected.set()

    netloc = urllib.parse.urlparse(url).netloc
    return await nats.connect(servers=[url], allow_reconnect=True, error_cb=quiet, reconnected_cb=on_reconnect,
                              reconnect_to_server_handler=home, max_reconnect_attempts=-1, connect_timeout=2)


async def api(nc: Client, subject: str, payload: dict[str, Any] | None = None,
              timeout: float = 5.0) -> dict[str, Any]:
    """A ``$JS.API`` reply's JSON (an error reply too); raises on timeout or no responders."""
    data = json.dumps(payload).encode() if payload is not None else b""
    msg = await nc.request(f"$JS.API.{subject}", data, timeout=timeout)
    body: dict[str, Any] = json.loads(msg.data)
    return body


def failure(exc: BaseException) -> str:
    if isinstance(exc, nats.errors.NoRespondersError):
        return "503"
    if isinstance(exc, (TimeoutError, nats.errors.TimeoutError)):
        return "timeout"
    return type(exc).__name__


async def stream_info(nc: Client, stream: str, subject: str | None = None,
                      timeout: float = READ_TIMEOUT) -> dict[str, Any] | None:
    """The stream's info, or None if nobody answered (in a cluster: it has no leader)."""
    try:
        body = await api(nc, f"STREAM.INFO.{stream}", {"subjects_filter": subject} if subject else None, timeout)
    except (TimeoutError, nats.errors.Error):
        return None
    return None if "error" in body else body


async def purge(nc: Client, run: StreamRun, reply: Reply, timeout: float) -> None:
    """Purge the run's subject below ``reply.point`` (for ``DELETES``: delete seq ``reply.point``,
    ``no_erase``), filling ``reply`` in (monotonic times; see ``relative``)."""
    reply.sent = time.monotonic()
    payload: dict[str, Any]
    if run.deletes:
        subject, payload = f"STREAM.MSG.DELETE.{run.stream}", {"seq": reply.point, "no_erase": True}
    else:
        subject, payload = f"STREAM.PURGE.{run.stream}", {"filter": run.subject, "seq": reply.point}
    try:
        body = await api(nc, subject, payload, timeout)
        reply.at = time.monotonic()
        if body.get("success"):
            reply.purged = int(body.get("purged", 1))  # a delete's reply has no count: it removed one
        else:
            reply.error = str(body.get("error", {}).get("description", body))
    except (TimeoutError, nats.errors.Error) as exc:
        reply.error = failure(exc)


def relative(reply: Reply, t_kill: float) -> None:
    """Make ``reply``'s times relative to the kill; one still pending becomes "no reply"."""
    reply.sent -= t_kill
    if reply.at is not None:
        reply.at -= t_kill
    elif reply.error is None:
        reply.error = "no reply"


async def first_direct(nc: Client, stream: str, subject: str) -> Read:
    """The first message on ``subject`` by direct get from seq 1 (the client's server's replica)."""
    payload = json.dumps({"next_by_subj": subject, "seq": 1}).encode()
    try:
        msg = await nc.request(f"$JS.API.DIRECT.GET.{stream}", payload, timeout=READ_TIMEOUT)
    except (TimeoutError, nats.errors.Error) as exc:
        return failure(exc)
    headers = msg.headers or {}
    status = headers.get("Status")
    if status == "404":
        return 0
    return f"status {status}" if status else int(headers["Nats-Sequence"])


async def first_by_leader(nc: Client, stream: str, subject: str) -> Read:
    """The first message on ``subject`` by ``STREAM.MSG.GET`` (answered by the leader only)."""
    try:
        body = await api(nc, f"STREAM.MSG.GET.{stream}", {"next_by_subj": subject, "seq": 1}, READ_TIMEOUT)
    except (TimeoutError, nats.errors.Error) as exc:
        return failure(exc)
    if "error" in body:
        return 0 if body["error"].get("err_code") == 10037 else str(body["error"].get("description"))
    return int(body["message"]["seq"])


async def read_all(nc: Client, probes: dict[str, Client], run: StreamRun) -> Reads:
    at = time.monotonic()
    leader, info, *replicas = await asyncio.gather(
        first_by_leader(nc, run.stream, run.subject),
        stream_info(nc, run.stream, run.subject),
        *(first_direct(probe, run.stream, run.subject) for probe in probes.values()))
    count: Read = "timeout"
    leader_name = "-"
    if info is not None:
        count = int((info["state"].get("subjects") or {}).get(run.subject, 0))
        leader_name = str(info.get("cluster", {}).get("leader") or "-")
    return Reads(leader, dict(zip(probes, replicas, strict=True)), count, leader_name, at=at)


def replica_stores(urls: Mapping[str, str | None], streams: list[str]) -> dict[str, dict[str, Store]]:
    """Each node's own replica of ``streams`` by its ``/jsz`` (blocking: run it in a thread).
    ``urls``: each node's monitoring URL, None while it has none (down, or restarting)."""
    stores: dict[str, dict[str, Store]] = {}
    for node, url in urls.items():
        if url is None:
            stores[node] = dict.fromkeys(streams, "down")
            continue
        try:
            with urllib.request.urlopen(f"{url}/jsz?streams=true", timeout=2) as page:
                body = json.load(page)
        except (OSError, ValueError) as exc:
            stores[node] = dict.fromkeys(streams, type(exc).__name__)
            continue
        found = {detail["name"]: detail.get("state", {}) for account in body.get("account_details") or []
                 for detail in account.get("stream_detail") or []}
        stores[node] = {stream: (int(found[stream].get("first_seq", 0)), int(found[stream].get("messages", 0)))
                        if stream in found else "missing" for stream in streams}
    return stores


def monitoring_urls(cluster: EmbeddedCluster, names: list[str], restarting: Mapping[int, str]) -> dict[str, str | None]:
    """Each node's monitoring URL; None while it is down or ``restarting`` (index -> the URL it had
    before its kill: the new one is known once the new process has written its ports file)."""
    urls: dict[str, str | None] = {}
    for index, server in enumerate(cluster.servers):
        url = server.monitoring_url if server.running else None
        urls[names[index]] = None if url is None or url == restarting.get(index) else url
    return urls


async def read_round(nc: Client, probes: dict[str, Client], runs: list[StreamRun],
                     urls: Mapping[str, str | None] | None) -> list[Reads]:
    """``read_all`` of every run, and with ``urls`` each node's own replica of them."""
    reads = await asyncio.gather(*(read_all(nc, probes, run) for run in runs))
    if urls is not None:
        stores = await asyncio.to_thread(replica_stores, urls, [run.stream for run in runs])
        for run, read in zip(runs, reads, strict=True):
            read.stores = {node: of_node[run.stream] for node, of_node in stores.items()}
    return list(reads)


def meta_leader(cluster: EmbeddedCluster, alive: list[int]) -> str:
    """The meta leader's name, from a live server's /jsz."""
    for index in alive:
        try:
            with urllib.request.urlopen(f"{cluster.servers[index].monitoring_url}/jsz", timeout=2) as page:
                return str(json.load(page).get("meta_cluster", {}).get("leader", "?"))
        except OSError:
            continue
    return "?"


# --- setting a trial up ------------------------------------------------------------------------


async def create(nc: Client, run: StreamRun, deadline: float) -> None:
    """Create the R3 stream, retrying while the restarted node is not yet back in the cluster."""
    config = {"name": run.stream, "subjects": [f"{run.subject.split('.')[0]}.>"], "num_replicas": 3,
              "allow_direct": True, "storage": "file"}
    while True:
        try:
            body = await api(nc, f"STREAM.CREATE.{run.stream}", config)
            if "error" not in body:
                return
            problem = str(body["error"])
        except (TimeoutError, nats.errors.Error) as exc:
            problem = failure(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot create {run.stream}: {problem}")
        await asyncio.sleep(0.2)


async def place_leader(nc: Client, run: StreamRun, want: str, deadline: float) -> None:
    """Wait for the stream's leader and move it to ``want`` (a stepdown with a preferred peer)."""
    while True:
        info = await stream_info(nc, run.stream)
        leader = (info or {}).get("cluster", {}).get("leader")
        if leader == want:
            run.leader = want
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run.stream}: leader {leader}, could not move it to {want}")
        if leader:
            await api(nc, f"STREAM.LEADER.STEPDOWN.{run.stream}", {"placement": {"preferred": want}})
        await asyncio.sleep(POLL)


async def wait_current(nc: Client, run: StreamRun, deadline: float) -> None:
    """Wait until both followers of the stream are current."""
    while True:
        info = await stream_info(nc, run.stream)
        replicas = (info or {}).get("cluster", {}).get("replicas") or []
        if len(replicas) == 2 and all(r.get("current") for r in replicas):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run.stream}: replicas not current: {replicas}")
        await asyncio.sleep(POLL)


async def publish(nc: Client, run: StreamRun) -> None:
    """Publish the stream's messages one at a time, each awaited (a 503 right after a leader
    move, which stored nothing, is retried)."""
    for n in range(MESSAGES):
        for _ in range(50):
            try:
                ack = json.loads((await nc.request(run.subject, b"%d" % n, timeout=5)).data)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        if ack.get("seq") != n + 1:
            raise RuntimeError(f"{run.stream}: publish {n} stored as {ack}")


async def set_up(nc: Client, runs: dict[str, StreamRun], leaders: Mapping[str, str], age: float) -> None:
    """Create the runs' streams, move each one's leader to ``leaders[variant]``, publish, wait
    until every replica is current, then ``age`` seconds."""
    deadline = time.monotonic() + 60
    await asyncio.gather(*(create(nc, run, deadline) for run in runs.values()))
    await asyncio.gather(*(place_leader(nc, run, leaders[v], deadline) for v, run in runs.items()))
    await asyncio.gather(*(publish(nc, run) for run in runs.values()))
    await asyncio.gather(*(wait_current(nc, run, deadline) for run in runs.values()))
    await asyncio.sleep(age)


def send(nc: Client, run: StreamRun, points: tuple[int, ...], wait: float) -> list[asyncio.Task[None]]:
    """Send the run's purges below ``points`` (deletes of them) together, as tasks."""
    replies = [Reply(point) for point in points]
    run.purges += replies
    return [asyncio.create_task(purge(nc, run, reply, wait)) for reply in replies]


# --- one trial ---------------------------------------------------------------------------------


async def revive(cluster: EmbeddedCluster, index: int, name: str, killed: float) -> tuple[Revival, asyncio.Task[None]]:
    """Restart node ``index`` at once after its kill (``killed``: when it was reaped); returns once
    its process is launched, with a task that ends when it is ready."""
    server = cluster.servers[index]
    revival = Revival(index, name, server.monitoring_url, killed)

    async def start() -> None:
        await server.start(RESTART_TIMEOUT)  # the kill left the store locked for this start
        revival.ready = time.monotonic()

    task = asyncio.create_task(start())
    await asyncio.sleep(0)  # the task runs up to its first await: the process is launched
    revival.launched = time.monotonic()
    return revival, task


async def await_leader(nc: Client, probes: dict[str, Client], run: StreamRun, victim: str,
                       kill: tuple[float, float], timeout: float) -> None:
    """Poll until the stream has a new leader, then read it at once: one other than ``victim``, or
    (``--restart-at-once``) the restarted victim if elected after the kill. ``kill``: the kill's
    monotonic and wall-clock times."""
    t_kill, wall_kill = kill
    while time.monotonic() - t_kill < timeout:
        info = await stream_info(nc, run.stream, timeout=LEADER_POLL)
        cluster = (info or {}).get("cluster", {})
        since = stored_seconds(cluster.get("leader_since", ""))
        if cluster.get("leader") and (cluster["leader"] != victim or (since is not None and since > wall_kill)):
            run.election, run.new_leader = time.monotonic() - t_kill, cluster["leader"]
            run.at_election = await read_all(nc, probes, run)
            run.elected = since - wall_kill if since is not None else None
            return
        if info is not None:
            await asyncio.sleep(POLL)


async def watch_leaderless(probes: dict[str, Client], runs: list[StreamRun], t_kill: float) -> None:
    """Direct gets on every survivor for each stream until its new leader shows (cancelled at the end)."""
    while True:
        waiting = [run for run in runs if run.election is None]
        if not waiting:
            return
        asked = [(run, name, first_direct(probe, run.stream, run.subject))
                 for run in waiting for name, probe in probes.items()]
        results = await asyncio.gather(*(read for _, _, read in asked))
        at = time.monotonic() - t_kill
        for (run, name, _), result in zip(asked, results, strict=True):
            if run.election is None or at < run.election:
                run.leaderless.append((at, name, result))
        await asyncio.sleep(POLL)


async def watch_rejoin(cluster: EmbeddedCluster, names: list[str], restarting: Mapping[int, str], probe: Client,
                       runs: list[StreamRun], t_kill: float) -> None:
    """Every 0.1 s until cancelled (at the late reads): a direct get through the restarted victim's
    client (``probe``) for every stream, and every node's own replicas by its ``/jsz`` (a node
    ``restarting`` once it serves one again; see ``monitoring_urls``)."""
    streams = [run.stream for run in runs]
    while True:
        reads = await asyncio.gather(*(first_direct(probe, run.stream, run.subject) for run in runs))
        at = time.monotonic() - t_kill
        for run, result in zip(runs, reads, strict=True):
            run.rejoin.append((at, result))
        urls = {node: url for node, url in monitoring_urls(cluster, names, restarting).items() if url is not None}
        stores = await asyncio.to_thread(replica_stores, urls, streams)
        at = time.monotonic() - t_kill
        for node, of_node in stores.items():
            for run in runs:
                run.rejoin_stores.append((at, node, of_node[run.stream]))
        await asyncio.sleep(POLL)


async def watch_first_leader_reads(nc: Client, run: StreamRun, t_kill: float) -> None:
    """Send ``STREAM.MSG.GET`` every 20 ms (not waiting for replies) until the new leader shows,
    to catch the new leader's very first answers."""

    async def read() -> None:
        result = await first_by_leader(nc, run.stream, run.subject)
        if result != "timeout":
            run.leader_reads.append((time.monotonic() - t_kill, result))

    reads: set[asyncio.Task[None]] = set()
    try:
        while run.election is None:
            task = asyncio.create_task(read())
            reads.add(task)
            task.add_done_callback(reads.discard)
            await asyncio.sleep(0.02)
        await asyncio.gather(*reads)
    finally:
        for task in reads:
            task.cancel()


async def purge_when_leaderless(nc: Client, run: StreamRun, wait: float) -> None:
    """Purge below 51 now and below 61 two seconds later if the stream still has no leader."""
    first = Reply(51)
    run.purges.append(first)
    task = asyncio.create_task(purge(nc, run, first, wait))
    try:
        await asyncio.sleep(2.0)
        if run.election is None:
            second = Reply(61)
            run.purges.append(second)
            await purge(nc, run, second, wait)
        await task
    finally:
        task.cancel()


@dataclass
class Aftermath:
    """What follows a kill: where to read, and what is still under way."""

    cluster: EmbeddedCluster
    names: list[str]
    victim: int
    nc: Client
    probes: dict[str, Client]
    """A client per node to read (the survivors; with ``--restart-at-once`` every node)."""
    kill: tuple[float, float]
    """The kill's monotonic and wall-clock times."""
    pending: list[asyncio.Task[None]]
    """Requests still under way: given up ``SETTLE`` seconds after the last new leader shows."""
    restarts: list[tuple[Revival, asyncio.Task[None]]] = field(default_factory=list)
    """The nodes restarted within the trial (``--restart-at-once``), the victim last."""


async def observe(after: Aftermath, runs: dict[str, StreamRun], wait: float) -> None:
    """From the kill to the settled (and late) reads: await every stream's new leader while reading
    the leaderless ones, then read."""
    t_kill, _ = after.kill
    victim = after.names[after.victim]
    survivors = {name: probe for name, probe in after.probes.items() if name != victim}
    led = [run for v, run in runs.items() if v != "ctrl"]
    watcher = asyncio.create_task(watch_leaderless(survivors, led, t_kill))
    fast_reads = [asyncio.create_task(watch_first_leader_reads(after.nc, run, t_kill)) for run in led]
    rejoin = None
    restarting = {revival.index: revival.old_url for revival, _ in after.restarts}
    if after.restarts:
        rejoin = asyncio.create_task(watch_rejoin(after.cluster, after.names, restarting, after.probes[victim],
                                                  list(runs.values()), t_kill))
    try:
        await asyncio.gather(*(await_leader(after.nc, after.probes, run, victim, after.kill, wait)
                               for run in runs.values()))
        watcher.cancel()
        await asyncio.gather(*fast_reads)
        if after.pending:
            await asyncio.wait(after.pending, timeout=SETTLE)
        else:
            await asyncio.sleep(SETTLE)
        for task in after.pending:
            task.cancel()  # the purges still unanswered are given up: "no reply"
        await asyncio.gather(*after.pending, watcher, return_exceptions=True)
        urls = monitoring_urls(after.cluster, after.names, restarting) if after.restarts else None
        for run, reads in zip(runs.values(), await read_round(after.nc, after.probes, list(runs.values()), urls),
                              strict=True):
            run.settled = reads
        if after.restarts:
            victim_revival, _ = after.restarts[-1]
            await asyncio.sleep(max(0.0, victim_revival.launched + LATE - time.monotonic()))
            urls = monitoring_urls(after.cluster, after.names, restarting)
            for run, reads in zip(runs.values(), await read_round(after.nc, after.probes, list(runs.values()), urls),
                                  strict=True):
                run.late = reads
        for run in runs.values():
            for reads in (run.at_election, run.settled, *([run.late] if run.late else [])):
                reads.at -= t_kill
    finally:
        for task in [watcher, *after.pending, *([rejoin] if rejoin else [])]:
            task.cancel()
        await asyncio.gather(watcher, *after.pending, *([rejoin] if rejoin else []), return_exceptions=True)
    await asyncio.gather(*(task for _, task in after.restarts))  # raises if a node did not come back
    for run in runs.values():
        for reply in run.purges:
            relative(reply, t_kill)


async def run_trial(cluster: EmbeddedCluster, trial: int, args: argparse.Namespace) -> Trial:
    """One kill: set up every variant's stream, purge, kill the victim, read; the victim stays down
    (with ``--restart-at-once``: is restarted at once, and is back when this returns)."""
    names = [server.name or f"n{i}" for i, server in enumerate(cluster.servers)]
    victim = trial % 3
    survivors = [i for i in range(3) if i != victim]
    order = [*survivors, victim] if args.client_on == "survivor" else [victim, *survivors]
    nc = await connect([cluster.servers[i].url for i in order])
    readers = range(3) if args.restart_at_once else survivors
    probes = {names[i]: await (connect_pinned(cluster.servers[i].url) if args.restart_at_once
                               else connect([cluster.servers[i].url], reconnect=False)) for i in readers}
    runs = {v: StreamRun(v, f"PF{trial}{v.upper()}", f"pf{trial}{v}.in.k") for v in VARIANTS}
    try:
        await set_up(nc, runs, {v: names[victim if v in VICTIM_LED else survivors[0]] for v in runs}, args.age)
        meta = await asyncio.to_thread(meta_leader, cluster, [*survivors, victim])

        await asyncio.gather(*send(nc, runs["seq"], (101,), args.wait), *send(nc, runs["pipe"], POINTS, args.wait),
                             *send(nc, runs["ctrl"], POINTS, args.wait), *send(nc, runs["mid"], POINTS[:5], args.wait),
                             *send(nc, runs["del"], DELETED, args.wait))
        in_flight = send(nc, runs["mid"], POINTS[5:], args.wait)
        kill_mode = KILL_MODES[trial % len(KILL_MODES)]
        await asyncio.sleep(0)  # the requests are written to the client's buffer
        if kill_mode != "unflushed":
            await nc.flush()  # ... and have reached the client's server
        if kill_mode.startswith("+"):
            await asyncio.sleep(float(kill_mode.split()[0]) / 1000)
        t_kill, wall_kill = time.monotonic(), time.time()
        cluster.kill(victim)
        restarts = [await revive(cluster, victim, names[victim], time.monotonic())] if args.restart_at_once else []

        leaderless_purges = asyncio.create_task(purge_when_leaderless(nc, runs["idle"], args.wait))
        after = Aftermath(cluster, names, victim, nc, probes, (t_kill, wall_kill), [*in_flight, leaderless_purges],
                          restarts)
        await observe(after, runs, args.wait)
        await delete_streams(nc, list(runs.values()))
        return Trial("main", names[victim], args.client_on, meta, kill_mode, runs, t_kill,
                     [revival for revival, _ in restarts], trial)
    finally:
        for probe in probes.values():
            await probe.close()
        await nc.close()


async def run_lagfollow(cluster: EmbeddedCluster, trial: int, args: argparse.Namespace) -> Trial:
    """Step L (``--restart-at-once``): kill and restart a follower, purge and delete on the leader
    while the follower is restarting, then kill the leader and restart it at once; both are back
    when this returns."""
    names = [server.name or f"n{i}" for i, server in enumerate(cluster.servers)]
    victim, follower, third = trial % 3, (trial + 1) % 3, (trial + 2) % 3
    order = [third, follower, victim] if args.client_on == "survivor" else [victim, third, follower]
    nc = await connect([cluster.servers[i].url for i in order])
    back = asyncio.Event()
    probes = {names[i]: await connect_pinned(cluster.servers[i].url, back if i == follower else None)
              for i in range(3)}
    runs = {v: StreamRun(v, f"PF{trial}{v.upper()}", f"pf{trial}{v}.in.k") for v in LAG_VARIANTS}
    lag_mode = LAG_MODES[trial % len(LAG_MODES)]
    restarts: list[tuple[Revival, asyncio.Task[None]]] = []
    try:
        await set_up(nc, runs, dict.fromkeys(runs, names[victim]), args.age)
        meta = await asyncio.to_thread(meta_leader, cluster, [third, follower, victim])

        cluster.kill(follower)
        restarts.append(await revive(cluster, follower, names[follower], time.monotonic()))
        if lag_mode == "on reconnect":
            await back.wait()
        await asyncio.gather(*send(nc, runs["lagfollow"], POINTS, args.wait),
                             *send(nc, runs["lagdel"], DELETED, args.wait))

        t_kill, wall_kill = time.monotonic(), time.time()
        cluster.kill(victim)
        restarts.append(await revive(cluster, victim, names[victim], time.monotonic()))
        after = Aftermath(cluster, names, victim, nc, probes, (t_kill, wall_kill), [], restarts)
        await observe(after, runs, args.wait)
        await delete_streams(nc, list(runs.values()))
        return Trial("lagfollow", names[victim], args.client_on, meta, lag_mode, runs, t_kill,
                     [revival for revival, _ in restarts], trial)
    finally:
        await asyncio.gather(*(task for _, task in restarts), return_exceptions=True)
        for probe in probes.values():
            await probe.close()
        await nc.close()


async def delete_streams(nc: Client, runs: list[StreamRun], timeout: float = 30.0) -> None:
    """Delete the trial's streams (retrying while the meta leader is being elected)."""
    deadline = time.monotonic() + timeout
    for run in runs:
        while True:
            try:
                body = await api(nc, f"STREAM.DELETE.{run.stream}", timeout=2)
                if "error" not in body or body["error"].get("err_code") == 10059:  # deleted, or not found
                    break
            except (TimeoutError, nats.errors.Error):
                pass
            if time.monotonic() > deadline:
                break  # left behind: fresh names per trial keep it out of the way
            await asyncio.sleep(0.2)


# --- the report --------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def shown(read: Read) -> str:
    return str(read) if read != 0 else "none"


def trial_line(trial: Trial, seconds: float) -> str:
    parts = []
    for v, run in trial.runs.items():
        first = min(run.settled.firsts(), default="?")
        stale = " STALE" if run.stale_at_election() or run.stale_leaderless() else ""
        lost = " LOST" if run.lost() else ""
        if trial.revivals:
            lost += " LATE-LOST" if run.lost_late() else ""
            lost += " REJOIN-STALE" if run.stale_rejoin() else ""
            lost += " BEHIND" if run.late is not None and run.behind(run.late) else ""
            lost += " [victim again]" if run.new_leader == trial.victim and v != "ctrl" else ""
        parts.append(f"{v} {run.answered}/{first}{stale}{lost}")
    elections = [run.elected for v, run in trial.runs.items() if v != "ctrl" and run.elected is not None]
    if trial.kind == "main":
        what = f"killed {trial.victim} (meta leader {trial.meta_leader}), kill {trial.kill_mode}"
    else:
        follower = trial.revivals[0]
        what = (f"L: killed follower {follower.node} at {trial.since_kill(follower.killed)} s, restarted, purges "
                f"{trial.kill_mode}; killed leader {trial.victim} (meta leader {trial.meta_leader}); follower "
                f"ready {trial.since_kill(follower.ready)} s")
    if trial.revivals:
        victim = trial.revivals[-1]
        what += f"; victim relaunched {trial.since_kill(victim.launched)} s, ready {trial.since_kill(victim.ready)} s"
    return (f"trial {trial.number:2}: {what} | answered/first: {', '.join(parts)} | "
            f"elected after {spread(elections)} s | {seconds:.0f} s")


def runs_of(trials: list[Trial], variant: str) -> list[StreamRun]:
    return [t.runs[variant] for t in trials if variant in t.runs]


def report(trials: list[Trial]) -> None:
    report_outcomes(trials)
    report_leaderless_reads(trials)
    report_in_flight([t for t in trials if t.kind == "main"])
    report_leaderless_purges([t for t in trials if t.kind == "main"])
    if any(t.revivals for t in trials):
        report_restart(trials)
        report_undone(trials)


def report_outcomes(trials: list[Trial]) -> None:
    print("\n## Purges answered vs what the new leader shows (settled: 1.5 s after it shows)\n")
    print("| variant | trials | purges answered before kill / after kill / not | replies' purged (sum per trial) "
          "| highest answered | "
          "settled first seq >= answered | lost | stale read at election | purged beyond answered | "
          "election s median (min-max) | new leader's first MSG.GET answers (s after elected; seq: n) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in (*VARIANTS, *LAG_VARIANTS):
        runs = runs_of(trials, v)
        if not runs:
            continue
        replies = [p for r in runs for p in r.purges]
        before = sum(1 for p in replies if p.ok and p.at is not None and p.at < 0)
        after = sum(1 for p in replies if p.ok and p.at is not None and p.at >= 0)
        points = Counter(r.answered for r in runs)
        purged = Counter(sum(p.purged or 0 for p in r.purges) for r in runs)
        kept = sum(1 for r in runs if r.settled.firsts() and not r.lost())
        elections = [r.elected for r in runs if r.elected is not None] if v != "ctrl" else []
        leads = [r.leader_reads[0][0] - r.elected for r in runs if r.leader_reads and r.elected is not None]
        seen = Counter(shown(result) for r in runs for _, result in r.leader_reads)
        first_reads = f"{spread(leads)}; " + ", ".join(f"{k}: {n}" for k, n in sorted(seen.items())) if seen else "-"
        print(f"| {TITLES[v]} | {len(runs)} | {before} / {after} / {len(replies) - before - after} | "
              f"{', '.join(f'{p} x{n}' for p, n in sorted(purged.items()))} | "
              f"{', '.join(f'{p} x{n}' for p, n in sorted(points.items()))} | {kept} | "
              f"{sum(r.lost() for r in runs)} | {sum(r.stale_at_election() for r in runs)} | "
              f"{sum(r.beyond() for r in runs)} | {spread(elections)} | {first_reads} |")


def report_leaderless_reads(trials: list[Trial]) -> None:
    print("\n## 4. Direct gets on the survivors while the stream has no leader (every 0.1 s)\n")
    print("Outcome: the first seq on the subject (none: 404; 503: no responders), how often, and when "
          "(s after the kill); by the survivor that became the new leader and by the other one.\n")
    print("| stream | replica | answered / sent | outcomes | stale (< purge answered before the kill) "
          "| trials with a stale read |")
    print("|---|---|---|---|---|---|")
    for v in (*VICTIM_LED, *LAG_VARIANTS):
        runs = runs_of(trials, v)
        if not runs:
            continue
        for role in ("new leader", "other"):
            reads = [(r, at, result) for r in runs for at, node, result in r.leaderless_reads()
                     if (node == r.new_leader) == (role == "new leader")]
            times: dict[str, list[float]] = {}
            for _, at, result in reads:
                times.setdefault(shown(result), []).append(at)
            seqs = [(r, result) for r, _, result in reads if isinstance(result, int)]
            stale = [r for r, result in seqs if result in r.gone(before_kill=True)]
            listed = ", ".join(f"{key}: {len(ats)} (+{min(ats):.1f}-{max(ats):.1f})"
                               for key, ats in sorted(times.items()))
            print(f"| {TITLES[v]} | {role} | {len(seqs)} / {len(reads)} | {listed} | {len(stale)} | "
                  f"{len({id(r) for r in stale})} |")


def report_in_flight(trials: list[Trial]) -> None:
    print("\n## 3. Purges in flight at the kill (below 61..101)\n")
    outcomes: Counter[str] = Counter()
    rows: Counter[tuple[int, int, str]] = Counter()
    for t in trials:
        run = t.runs["mid"]
        for p in run.purges[5:]:
            if not p.ok:
                outcomes[f"error: {p.error}"] += 1
            elif p.at is not None and p.at < 0:
                outcomes["answered before the kill"] += 1
            elif run.elected is not None and p.at is not None and p.at >= run.elected:
                outcomes["answered after the kill, once the new leader was elected"] += 1
            else:
                outcomes["answered after the kill, before the new leader was elected"] += 1
        late = ", ".join(f"<{p.point} +{p.at:.2f}s" for p in run.purges if p.ok and p.at is not None and p.at >= 0)
        rows[(run.answered, min(run.settled.firsts(), default=-1), late)] += 1
    for key, n in sorted(outcomes.items()):
        print(f"- {key}: {n}")
    print("\n| highest answered | settled first seq | replies after the kill (point, s after the kill) | trials |")
    print("|---|---|---|---|")
    for (point, first, late), n in sorted(rows.items()):
        print(f"| {point} | {first} | {late or '-'} | {n} |")


def report_leaderless_purges(trials: list[Trial]) -> None:
    print("\n## 5. Purges sent while the stream has no leader\n")
    outcomes: Counter[str] = Counter()
    for t in trials:
        run = t.runs["idle"]
        first = min(run.settled.firsts(), default=-1)
        for p in run.purges:
            reply = f"answered +{p.at:.1f} s (elected +{run.elected or 0:.1f} s)" if p.ok else p.error
            outcomes[f"below {p.point}: {reply}, {'applied' if first >= p.point else 'not applied'}"] += 1
    for key, n in sorted(outcomes.items()):
        print(f"- {key}: {n}")


ROLES: Final = ("victim", "new leader", "restarted follower", "other")


def role(trial: Trial, run: StreamRun, node: str) -> str:
    """A node's part in the trial: the restarted victim, the stream's new leader, step L's restarted
    follower (unless new leader), or another."""
    if node == trial.victim:
        return "victim"
    if node == run.new_leader:
        return "new leader"
    return "restarted follower" if trial.kind == "lagfollow" and node == trial.revivals[0].node else "other"


def by_role(pairs: list[tuple[Trial, StreamRun, list[str]]]) -> str:
    """How many streams had the listed nodes, by role (``ROLES``)."""
    roles = Counter(role(t, r, node) for t, r, nodes in pairs for node in set(nodes))
    return " / ".join(str(roles[name]) for name in ROLES)


def stale_polled(run: StreamRun, before_election: bool) -> list[str]:
    """The nodes whose own replica held a message answered gone before the kill when polled
    (rejoin reads) before the new leader's election (``leader_since``), or from it on."""
    end = run.elected if run.elected is not None else run.election
    return [node for at, node, _ in run.stale_rejoin_stores()
            if end is None or (at < end) == before_election]


def report_restart(trials: list[Trial]) -> None:
    print("\n## Restart at once: the victim restarted as soon as it was reaped\n")
    print("Counts of streams. *Undone*: a read showed a message an answered purge or delete had removed; "
          "*at leader*: by STREAM.MSG.GET or the subject's count (the leader answers), *any*: by those or a "
          "direct get through any node's client. Direct gets and own replicas (/jsz) by node role: "
          "victim / new leader / step L's restarted follower / other (streams). Rejoin: from the restart "
          "until the late reads, every 0.1 s, against purges and deletes answered before the kill.\n")
    print("| variant | trials | new leader: restarted victim / other | election s median (min-max) "
          "| undone settled: at leader / any | undone late: at leader / any "
          "| direct gets showing one, settled | same, late | own replica holding one, settled | same, late "
          "| rejoin direct gets through the victim showing one (reads, streams) | own replica holding one at "
          "rejoin polls before the election | same, from the election on | victim's own replica: last seen "
          "holding one (s after kill) | beyond |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in (*VARIANTS, *LAG_VARIANTS):
        pairs = [(t, t.runs[v]) for t in trials if v in t.runs and t.revivals]
        if not pairs:
            continue
        runs = [r for _, r in pairs]
        again = sum(1 for t, r in pairs if r.new_leader == t.victim)
        elections = [r.elected for r in runs if r.elected is not None] if v != "ctrl" else []
        lates = [r.late for r in runs if r.late is not None]
        stale_rejoin = [r.stale_rejoin() for r in runs]
        last = [max(at for at, _, _ in s) for t, r in pairs if (s := r.stale_rejoin_stores(t.victim))]
        print(f"| {TITLES[v]} | {len(runs)} | {again} / {len(runs) - again} | {spread(elections)} | "
              f"{sum(r.undone_at_leader(r.settled) for r in runs)} / {sum(r.lost() for r in runs)} | "
              f"{sum(r.undone_at_leader(late) for r, late in zip(runs, lates, strict=False))} / "
              f"{sum(r.lost_late() for r in runs)} | "
              f"{by_role([(t, r, r.stale_replicas(r.settled)) for t, r in pairs])} | "
              f"{by_role([(t, r, r.stale_replicas(r.late)) for t, r in pairs if r.late])} | "
              f"{by_role([(t, r, r.behind(r.settled)) for t, r in pairs])} | "
              f"{by_role([(t, r, r.behind(r.late)) for t, r in pairs if r.late])} | "
              f"{sum(map(len, stale_rejoin))}, {sum(1 for s in stale_rejoin if s)} | "
              f"{by_role([(t, r, stale_polled(r, True)) for t, r in pairs])} | "
              f"{by_role([(t, r, stale_polled(r, False)) for t, r in pairs])} | "
              f"{spread(last)} | {sum(r.beyond() for r in runs)} |")
    restarted = [t for t in trials if t.revivals]
    victims = [(t, t.revivals[-1]) for t in restarted]
    ready = [r.ready - t.t_kill for t, r in victims if r.ready is not None]
    print(f"\n- the victim relaunched after its kill (s): {spread([r.launched - r.killed for _, r in victims])}; "
          f"ready (s after the kill): {spread(ready)}")
    followers = [(t, t.revivals[0]) for t in restarted if t.kind == "lagfollow"]
    if followers:
        print(f"- step L's follower killed before the leader's kill (s): "
              f"{spread([t.t_kill - f.killed for t, f in followers])}; ready (s after the leader's kill): "
              f"{spread([f.ready - t.t_kill for t, f in followers if f.ready is not None])}")
        print(f"- step L's new leader: {dict(Counter(role_in_l(t, r) for t, _ in followers for r in t.runs.values()))}")
    runs = [r for t in restarted for r in t.runs.values()]
    print(f"- settled reads at (s after the kill): {spread([r.settled.at for r in runs])}; "
          f"late reads at: {spread([r.late.at for r in runs if r.late])}")


def role_in_l(trial: Trial, run: StreamRun) -> str:
    """Step L's new leader: the restarted victim, the follower restarted before the kill, or the third node."""
    if run.new_leader == trial.victim:
        return "restarted leader"
    return "lagging follower" if run.new_leader == trial.revivals[0].node else "third node"


def shown_reads(reads: Reads | None) -> str:
    if reads is None:
        return "-"
    replicas = ", ".join(f"{node}: {shown(r)}" for node, r in reads.replicas.items())
    stores = ", ".join(f"{node}: {s[0]}..({s[1]} msgs)" if isinstance(s, tuple) else f"{node}: {s}"
                       for node, s in reads.stores.items())
    return (f"+{reads.at:.2f} s leader {reads.leader_name}: MSG.GET {shown(reads.leader)}, count {reads.count}; "
            f"direct gets {{{replicas}}}; own replicas {{{stores}}}")


def report_undone(trials: list[Trial]) -> None:
    print("\n## Every stream where a read showed a message an answered purge or delete had removed\n")
    found = False
    for t in trials:
        for v, run in t.runs.items():
            stale_late = run.late is not None and (run.stale_replicas(run.late) or run.behind(run.late))
            if not (run.lost() or run.lost_late() or stale_late or run.stale_at_election() or run.stale_leaderless()
                    or run.stale_rejoin() or run.stale_rejoin_stores()):
                continue
            found = True
            follower = f", follower {t.revivals[0].node} killed {t.since_kill(t.revivals[0].killed)} s, ready " \
                       f"{t.since_kill(t.revivals[0].ready)} s" if t.kind == "lagfollow" else ""
            victim = t.revivals[-1] if t.revivals else None
            print(f"- trial {t.number} {v}: killed {t.victim} (meta leader {t.meta_leader}, {t.kill_mode}){follower}; "
                  f"victim relaunched {t.since_kill(victim.launched if victim else None)} s, ready "
                  f"{t.since_kill(victim.ready if victim else None)} s; answered {run.answered} "
                  f"(before the kill {run.answered_before_kill}); new leader {run.new_leader}, elected "
                  f"{run.elected if run.elected is None else round(run.elected, 2)} s")
            print(f"  - at election: {shown_reads(run.at_election)}")
            print(f"  - settled: {shown_reads(run.settled)}")
            print(f"  - late: {shown_reads(run.late)}")
            if run.stale_leaderless():
                print(f"  - leaderless stale: {[(round(at, 2), node, r) for at, node, r in run.leaderless_reads()]}")
            if run.stale_rejoin():
                rejoin = run.stale_rejoin()
                print(f"  - rejoin direct gets showing one: {len(rejoin)}, +{rejoin[0][0]:.2f}..+{rejoin[-1][0]:.2f} s "
                      f"(first seqs {sorted({r for _, r in rejoin})})")
            for node in sorted({name for _, name, _ in run.stale_rejoin_stores()}):
                stores = run.stale_rejoin_stores(node)
                polls = [(at, store) for at, name, store in run.rejoin_stores if name == node]
                print(f"  - {node}'s ({role(t, run, node)}) own replica holding one: {len(stores)} of {len(polls)} "
                      f"polls, +{stores[0][0]:.2f}..+{stores[-1][0]:.2f} s "
                      f"({sorted({s for _, _, s in stores}, key=str)[:4]}); polls +{polls[0][0]:.2f}..+"
                      f"{polls[-1][0]:.2f} s, first {polls[0][1]}, last {polls[-1][1]}")
    if not found:
        print("(none)")


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.r3_purge_failover", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20,
                        help="trials (default 20, ~12 s each): one kill each, with --restart-at-once two leader "
                        "kills and a follower's (steps 1 and L, ~45 s a trial)")
    parser.add_argument("--client-on", choices=("survivor", "victim"), default="survivor",
                        help="the node the main client connects to first (default survivor)")
    parser.add_argument("--sync-interval", default=None,
                        help="the servers' jetstream.sync_interval (default: the server's own, 2m; try 'always')")
    parser.add_argument("--age", type=float, default=0.0,
                        help="seconds the streams exist (set up, all replicas current) before the purges "
                        "(default 0; with under ~5 s, the survivors may not serve direct gets yet: see 4.)")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds to wait for a new leader and for purge replies (default 30)")
    parser.add_argument("--restart-at-once", action="store_true",
                        help="restart the victim as soon as its SIGKILL is reaped, within the trial (as the "
                        "chaos soak's leader-kill-9 does), read every node, and add step L (see above)")
    args = parser.parse_args(argv)
    binary = find_nats_server()
    version = ".".join(map(str, server_version(binary)))
    print(f"nats-server v{version} ({binary}); sync_interval {args.sync_interval or 'default (2m)'}; "
          f"main client on the {args.client_on}; streams aged {args.age:g} s; {args.trials} trials"
          f"{'; victims restarted at once' if args.restart_at_once else ''}")
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="kq-purge-failover-") as tmp:
        async with EmbeddedCluster(3, store_root=Path(tmp), sync_interval=args.sync_interval) as cluster:
            for number in range(args.trials):
                started = time.monotonic()
                trial = await run_trial(cluster, number, args)
                if not args.restart_at_once:
                    await cluster.restart(number % 3)
                trials.append(trial)
                print(trial_line(trial, time.monotonic() - started), flush=True)
                if args.restart_at_once:
                    started = time.monotonic()
                    trials.append(await run_lagfollow(cluster, number, args))
                    print(trial_line(trials[-1], time.monotonic() - started), flush=True)
    report(trials)


if __name__ == "__main__":
    asyncio.run(main())
