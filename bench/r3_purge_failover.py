"""``python -m bench.r3_purge_failover``: does an answered purge survive a SIGKILL of the stream's leader?

A 3-node embedded cluster (``EmbeddedCluster``), R3 file streams with ``allow_direct``. Each trial
creates fresh streams, puts 200 messages on one subject of each (``<stream>.in.k``, one awaited
publish at a time), purges below a sequence (``$JS.API.STREAM.PURGE`` with ``filter`` and ``seq``,
as keyqueue does), SIGKILLs one node (the *victim*, node ``trial % 3``) and reads what is left once
each stream has a leader again. The victim is restarted before the next trial. One kill per trial
serves every variant, each on its own stream (leaders are moved with a preferred stepdown):

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
C. ``ctrl``    leader on another node, the victim is a follower; 10 pipelined purges as in 2.

The main client is connected to a survivor (``--client-on victim`` connects it to the victim, so
its connection drops at the kill as well). After a stream's new leader shows in ``STREAM.INFO``
(polled every 0.1 s), it is read at once (*at election*) and again 1.5 s later (*settled*): the first
message on the subject via ``STREAM.MSG.GET`` (leader) and via a direct get on each survivor, and
the subject's count from ``STREAM.INFO`` with ``subjects_filter``.

How to read the output: *answered* is the highest purge point (``seq``) whose reply said success;
every message below it must be gone. ``lost`` counts streams whose settled first message is below
that point (an answered purge undone); ``stale`` counts reads below it (at election, or while
leaderless). ``beyond`` counts streams purged past the answered point (a purge applied although its
reply never came). Election times run from the kill to the new leader's ``leader_since`` (server
clock, same machine); a read counts as leaderless if it was answered before that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import nats
import nats.errors
from nats.aio.client import Client

from keyqueue.jetstream.api import stored_seconds
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import find_nats_server, server_version

MESSAGES: Final = 200
POINTS: Final = tuple(range(11, 102, 10))
"""The pipelined purges' points: below 11, 21, .., 101."""
POLL: Final = 0.1
"""Seconds between polls (leader, leaderless reads)."""
LEADER_POLL: Final = 0.1
"""Seconds to wait for ``STREAM.INFO`` while polling for the new leader (only the leader answers)."""
KILL_MODES: Final = ("unflushed", "flushed", "+0.5 ms", "+1 ms", "+2 ms")
"""When the victim is killed after the in-flight purges of variant 3 are sent: before the client
has flushed them, once flushed (they reached the client's server), or that long after the flush."""
READ_TIMEOUT: Final = 0.5
SETTLE: Final = 1.5
"""Seconds after the last new leader shows before the settled reads (and before in-flight purges
still unanswered are given up)."""
VICTIM_LED: Final = ("seq", "pipe", "mid", "idle")
VARIANTS: Final = (*VICTIM_LED, "ctrl")
TITLES: Final = {
    "seq": "1 sequential purge <101, kill",
    "pipe": "2 10 pipelined purges, kill",
    "mid": "3 kill with purges in flight",
    "idle": "5 purges sent while leaderless",
    "ctrl": "C follower killed (pipelined)",
}

Read = int | str
"""A read's outcome: the first stored sequence on the subject, ``0`` for none (404), or an error."""


@dataclass
class Reply:
    """A purge request and what came of it (times in seconds from the kill)."""

    point: int
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
    """The first message by direct get, per survivor asked."""
    count: Read = "-"
    """The subject's message count (``STREAM.INFO`` with ``subjects_filter``)."""

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

    @property
    def answered(self) -> int:
        """The highest purge point answered with success (1: none, nothing must be gone)."""
        return max((p.point for p in self.purges if p.ok), default=1)

    @property
    def answered_before_kill(self) -> int:
        return max((p.point for p in self.purges if p.ok and p.at is not None and p.at < 0), default=1)

    def lost(self) -> bool:
        too_many = isinstance(self.settled.count, int) and self.settled.count > MESSAGES + 1 - self.answered
        return too_many or any(first and first < self.answered for first in self.settled.firsts())

    def stale_at_election(self) -> bool:
        firsts = [*self.at_election.firsts(), *(r for _, r in self.leader_reads if isinstance(r, int))]
        return any(first and first < self.answered_before_kill for first in firsts)

    def leaderless_reads(self) -> list[tuple[float, str, Read]]:
        """The direct gets answered (or failed) before the new leader took over."""
        end = self.elected if self.elected is not None else self.election
        return [read for read in self.leaderless if end is None or read[0] < end]

    def stale_leaderless(self) -> bool:
        return any(isinstance(r, int) and r and r < self.answered_before_kill for _, _, r in self.leaderless_reads())

    def beyond(self) -> bool:
        firsts = self.settled.firsts()
        return bool(firsts) and min(firsts) > self.answered


@dataclass
class Trial:
    victim: str
    client_on: str
    meta_leader: str
    kill_mode: str
    runs: dict[str, StreamRun]


# --- requests ----------------------------------------------------------------------------------


async def quiet(_: Exception) -> None:
    """nats-py logs every connection error with a traceback unless given an error callback."""


async def connect(urls: list[str], *, reconnect: bool = True) -> Client:
    """A client on the first of ``urls`` (in order), reconnecting to the others if it drops."""
    return await nats.connect(servers=urls, dont_randomize=True, allow_reconnect=reconnect, error_cb=quiet,
                              reconnect_time_wait=0.1, max_reconnect_attempts=-1, connect_timeout=2)


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


async def purge(nc: Client, stream: str, subject: str, reply: Reply, timeout: float) -> None:
    """Purge ``subject`` below ``reply.point``, filling ``reply`` in (monotonic times; see ``relative``)."""
    reply.sent = time.monotonic()
    try:
        body = await api(nc, f"STREAM.PURGE.{stream}", {"filter": subject, "seq": reply.point}, timeout)
        reply.at = time.monotonic()
        if body.get("success"):
            reply.purged = int(body.get("purged", 0))
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
    leader, info, *replicas = await asyncio.gather(
        first_by_leader(nc, run.stream, run.subject),
        stream_info(nc, run.stream, run.subject),
        *(first_direct(probe, run.stream, run.subject) for probe in probes.values()))
    count: Read = "timeout"
    if info is not None:
        count = int((info["state"].get("subjects") or {}).get(run.subject, 0))
    return Reads(leader, dict(zip(probes, replicas, strict=True)), count)


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


# --- one trial ---------------------------------------------------------------------------------


async def await_leader(nc: Client, probes: dict[str, Client], run: StreamRun, victim: str,
                       kill: tuple[float, float], timeout: float) -> None:
    """Poll until the stream has a leader other than ``victim``, then read it at once. ``kill``:
    the kill's monotonic and wall-clock times."""
    t_kill, wall_kill = kill
    while time.monotonic() - t_kill < timeout:
        info = await stream_info(nc, run.stream, timeout=LEADER_POLL)
        cluster = (info or {}).get("cluster", {})
        if cluster.get("leader") and cluster["leader"] != victim:
            run.election, run.new_leader = time.monotonic() - t_kill, cluster["leader"]
            run.at_election = await read_all(nc, probes, run)
            since = stored_seconds(cluster.get("leader_since", ""))
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
    task = asyncio.create_task(purge(nc, run.stream, run.subject, first, wait))
    try:
        await asyncio.sleep(2.0)
        if run.election is None:
            second = Reply(61)
            run.purges.append(second)
            await purge(nc, run.stream, run.subject, second, wait)
        await task
    finally:
        task.cancel()


async def run_trial(cluster: EmbeddedCluster, trial: int, args: argparse.Namespace) -> Trial:
    """One kill: set up every variant's stream, purge, kill the victim, read; the victim stays down."""
    names = [server.name or f"n{i}" for i, server in enumerate(cluster.servers)]
    victim = trial % 3
    survivors = [i for i in range(3) if i != victim]
    order = [*survivors, victim] if args.client_on == "survivor" else [victim, *survivors]
    nc = await connect([cluster.servers[i].url for i in order])
    probes = {names[i]: await connect([cluster.servers[i].url], reconnect=False) for i in survivors}
    runs = {v: StreamRun(v, f"PF{trial}{v.upper()}", f"pf{trial}{v}.in.k") for v in VARIANTS}
    setup_deadline = time.monotonic() + 60
    try:
        await asyncio.gather(*(create(nc, run, setup_deadline) for run in runs.values()))
        await asyncio.gather(*(place_leader(nc, run, names[victim if v in VICTIM_LED else survivors[0]],
                                            setup_deadline) for v, run in runs.items()))
        await asyncio.gather(*(publish(nc, run) for run in runs.values()))
        await asyncio.gather(*(wait_current(nc, run, setup_deadline) for run in runs.values()))
        await asyncio.sleep(args.age)
        meta = await asyncio.to_thread(meta_leader, cluster, [*survivors, victim])

        def send(variant: str, points: tuple[int, ...]) -> list[asyncio.Task[None]]:
            run = runs[variant]
            replies = [Reply(point) for point in points]
            run.purges += replies
            return [asyncio.create_task(purge(nc, run.stream, run.subject, reply, args.wait)) for reply in replies]

        await asyncio.gather(*send("seq", (101,)), *send("pipe", POINTS), *send("ctrl", POINTS),
                             *send("mid", POINTS[:5]))
        in_flight = send("mid", POINTS[5:])
        kill_mode = KILL_MODES[trial % len(KILL_MODES)]
        await asyncio.sleep(0)  # the requests are written to the client's buffer
        if kill_mode != "unflushed":
            await nc.flush()  # ... and have reached the client's server
        if kill_mode.startswith("+"):
            await asyncio.sleep(float(kill_mode.split()[0]) / 1000)
        t_kill, wall_kill = time.monotonic(), time.time()
        cluster.kill(victim)

        leaderless_purges = asyncio.create_task(purge_when_leaderless(nc, runs["idle"], args.wait))
        watcher = asyncio.create_task(watch_leaderless(probes, [runs[v] for v in VICTIM_LED], t_kill))
        fast_reads = [asyncio.create_task(watch_first_leader_reads(nc, runs[v], t_kill)) for v in VICTIM_LED]
        await asyncio.gather(*(await_leader(nc, probes, run, names[victim], (t_kill, wall_kill), args.wait)
                               for run in runs.values()))
        watcher.cancel()
        await asyncio.gather(*fast_reads)
        await asyncio.wait([*in_flight, leaderless_purges], timeout=SETTLE)
        for task in [*in_flight, leaderless_purges, watcher]:
            task.cancel()  # the purges still unanswered are given up: "no reply"
        await asyncio.gather(*in_flight, leaderless_purges, watcher, return_exceptions=True)
        settled = await asyncio.gather(*(read_all(nc, probes, run) for run in runs.values()))
        for run, reads in zip(runs.values(), settled, strict=True):
            run.settled = reads
            for reply in run.purges:
                relative(reply, t_kill)
        await delete_streams(nc, list(runs.values()))
        return Trial(names[victim], args.client_on, meta, kill_mode, runs)
    finally:
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


def trial_line(number: int, trial: Trial, seconds: float) -> str:
    parts = []
    for v, run in trial.runs.items():
        first = min(run.settled.firsts(), default="?")
        stale = " STALE" if run.stale_at_election() or run.stale_leaderless() else ""
        lost = " LOST" if run.lost() else ""
        parts.append(f"{v} {run.answered}/{first}{stale}{lost}")
    elections = [run.elected for v, run in trial.runs.items() if v in VICTIM_LED and run.elected is not None]
    return (f"trial {number:2}: killed {trial.victim} (meta leader {trial.meta_leader}), kill {trial.kill_mode} | "
            f"answered/first: {', '.join(parts)} | elected after {spread(elections)} s | {seconds:.0f} s")


def report(trials: list[Trial]) -> None:
    report_outcomes(trials)
    report_leaderless_reads(trials)
    report_in_flight(trials)
    report_leaderless_purges(trials)


def report_outcomes(trials: list[Trial]) -> None:
    print("\n## Purges answered vs what the new leader shows (settled: 1.5 s after it shows)\n")
    print("| variant | trials | purges answered before kill / after kill / not | replies' purged (sum per trial) "
          "| highest answered | "
          "settled first seq >= answered | lost | stale read at election | purged beyond answered | "
          "election s median (min-max) | new leader's first MSG.GET answers (s after elected; seq: n) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        runs = [t.runs[v] for t in trials]
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
    for v in VICTIM_LED:
        runs = [t.runs[v] for t in trials]
        for role in ("new leader", "other"):
            reads = [(r, at, result) for r in runs for at, node, result in r.leaderless_reads()
                     if (node == r.new_leader) == (role == "new leader")]
            times: dict[str, list[float]] = {}
            for _, at, result in reads:
                times.setdefault(shown(result), []).append(at)
            seqs = [(r, result) for r, _, result in reads if isinstance(result, int)]
            stale = [r for r, result in seqs if result and result < r.answered_before_kill]
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


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.r3_purge_failover", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="kills, one per trial (default 20, ~12 s each)")
    parser.add_argument("--client-on", choices=("survivor", "victim"), default="survivor",
                        help="the node the main client connects to first (default survivor)")
    parser.add_argument("--sync-interval", default=None,
                        help="the servers' jetstream.sync_interval (default: the server's own, 2m; try 'always')")
    parser.add_argument("--age", type=float, default=0.0,
                        help="seconds the streams exist (set up, all replicas current) before the purges "
                        "(default 0; with under ~5 s, the survivors may not serve direct gets yet: see 4.)")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds to wait for a new leader and for purge replies (default 30)")
    args = parser.parse_args(argv)
    binary = find_nats_server()
    version = ".".join(map(str, server_version(binary)))
    print(f"nats-server v{version} ({binary}); sync_interval {args.sync_interval or 'default (2m)'}; "
          f"main client on the {args.client_on}; streams aged {args.age:g} s; {args.trials} trials")
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="kq-purge-failover-") as tmp:
        async with EmbeddedCluster(3, store_root=Path(tmp), sync_interval=args.sync_interval) as cluster:
            for number in range(args.trials):
                started = time.monotonic()
                trial = await run_trial(cluster, number, args)
                await cluster.restart(number % 3)
                trials.append(trial)
                print(trial_line(number, trial, time.monotonic() - started), flush=True)
    report(trials)


if __name__ == "__main__":
    asyncio.run(main())
