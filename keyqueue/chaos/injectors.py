"""The soak's fault injectors: worker processes, the server, the nodes of a cluster.

Each injector is a coroutine that injects one fault at a time until ``ending`` is set, logging
each fault's start and end through :class:`~keyqueue.chaos.fleet.Faults` (network faults are
:class:`~keyqueue.chaos.proxy.FaultScript`'s). Kinds, by class:

- ``process`` (:func:`process_faults`, a random worker each time): ``stall-under`` /
  ``stall-over`` (the worker blocks its own loop 0.75x / 1.5x the lease on a signal), ``sigstop``
  (1.2-2.5x the lease, then SIGCONT), ``kill-9`` (and a new process under the same name),
  ``drain`` (SIGTERM, then a new process), ``block-loop`` (the next request enqueued is flagged
  to block its handler's event loop for 1.5x the lease: blocking code in an ``async def``);
- ``server`` on one server (:func:`server_faults`): ``server-restart`` / ``server-kill-9``, then
  started again on the same store and port;
- on a cluster, one node-level fault at a time (:func:`node_faults`), each drawn from the classes
  chosen: ``server`` -> ``rolling-restart`` (every node in turn stopped gracefully and started
  again, the next only once it is healthy and caught up and every group of the queue has a leader;
  one fault per node);
  ``cluster`` -> ``leader-kill-9-<target>`` (kill -9 of the node leading the inbox, token or lease
  stream or the token consumer; back after 1-3 s); ``partition`` -> ``node-cut`` (every route
  proxy touching one node reset and refused, or blackholed, for 2-6 s, then healed);
  ``stepdown`` -> ``stepdown-<target>`` (the leader of the inbox, token, lease or dead-letter
  stream, or of the token consumer, steps down).

A node-level fault ends (``fault_end``) once the cluster is whole again: the node restarted and
healthy, the cut healed and the node healthy, a new leader elected (after a leader's kill -9: of every
group of the queue, since the node may have led more than the one aimed at).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import Callable, Mapping
from typing import Any

from keyqueue.chaos.fleet import Faults, Fleet
from keyqueue.chaos.proxy import FaultProxy
from keyqueue.errors import KeyqueueError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import EmbeddedServer
from keyqueue.server.probe import healthy

__all__ = ["NODE_FAULT_CLASSES", "PROCESS_KINDS", "node_faults", "process_faults", "server_faults"]

PROCESS_KINDS = ("stall-under", "stall-over", "sigstop", "kill-9", "drain", "block-loop")
"""The ``process`` class's faults."""

NODE_FAULT_CLASSES = ("server", "cluster", "partition", "stepdown")
"""The classes whose faults act on the nodes of a cluster (one at a time)."""


async def _pause(ending: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` or until ``ending``; True if the soak is ending."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ending.wait(), seconds)
    return ending.is_set()


# --- worker processes --------------------------------------------------------------------------


async def process_faults(fleet: Fleet, faults: Faults, rng: random.Random, ending: asyncio.Event, ack_wait: float,
                         flag_block: Callable[[float], None]) -> None:
    """Faults in worker processes, one at a time, on a random worker."""
    while not await _pause(ending, rng.uniform(0.5, 2.0)):
        name = rng.choice(fleet.names())
        kind = rng.choice(PROCESS_KINDS)
        if kind == "block-loop":
            faults.begin(kind, seconds=ack_wait * 1.5)
            flag_block(ack_wait * 1.5)
            continue
        if not fleet.alive(name) or name in fleet.busy:
            continue
        fleet.busy.add(name)
        fault = faults.begin(kind, name)
        try:
            await _process_fault(fleet, name, kind, rng, ack_wait)
        except (RuntimeError, TimeoutError) as e:  # a worker that cannot come back: start it again
            fleet.note("soak", "fault_error", fault=kind, target=name, error=repr(e))
            if not fleet.alive(name):
                fleet.start(name)
        finally:
            fleet.busy.discard(name)
            faults.end(fault)


async def _process_fault(fleet: Fleet, name: str, kind: str, rng: random.Random, ack_wait: float) -> None:
    # A stall's fault lasts as long as the stall (the worker logs it as a pause as well).
    if kind == "stall-under":
        fleet.signal(name, signal.SIGUSR1)
        await asyncio.sleep(ack_wait * 0.75)
    elif kind == "stall-over":
        fleet.signal(name, signal.SIGUSR2)
        await asyncio.sleep(ack_wait * 1.5)
    elif kind == "sigstop":
        fleet.pause(name)
        await asyncio.sleep(rng.uniform(ack_wait * 1.2, ack_wait * 2.5))
        fleet.resume(name)
    elif kind == "kill-9":
        await fleet.kill(name)
        fleet.start(name)
        await fleet.wait_ready([name], timeout=90)
    else:
        await fleet.drain(name)
        fleet.note(name, "killed", reason="drained")
        fleet.start(name)
        await fleet.wait_ready([name], timeout=90)


# --- one server --------------------------------------------------------------------------------


async def server_faults(server: EmbeddedServer, faults: Faults, rng: random.Random, ending: asyncio.Event) -> None:
    """Restarts and kill -9 of the nats-server, spaced out so work goes on between them."""
    while not await _pause(ending, rng.uniform(4.0, 8.0)):
        kind = rng.choice(["server-restart", "server-kill-9"])
        fault = faults.begin(kind)
        if kind == "server-restart":
            await server.restart()
        else:
            server.kill()
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await server.start()
        faults.end(fault)


# --- the nodes of a cluster --------------------------------------------------------------------


def _leader_targets(config: QueueConfig) -> dict[str, tuple[str, str | None]]:
    """Per fault target, ``(stream, consumer or None)``: every stream of the queue and its consumer."""
    n = config.names
    return {"inbox": (n.inbox_stream, None), "tokens": (n.token_stream, None), "leases": (n.lease_stream, None),
            "dlq": (n.dlq_stream, None), "consumer": (n.token_stream, n.consumer)}


async def _leader(api: JetStreamApi, stream: str, consumer: str | None) -> str:
    info = await (api.consumer_info(stream, consumer) if consumer else api.stream_info(stream))
    return str(info.get("cluster", {}).get("leader") or "")


async def _until_leader(api: JetStreamApi, stream: str, consumer: str | None, ending: asyncio.Event,
                        timeout: float = 30.0) -> str:
    """The leader once one is elected (``""`` if none within ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        with contextlib.suppress(KeyqueueError):
            if leader := await _leader(api, stream, consumer):
                return leader
        if await _pause(ending, 0.1):
            break
    return ""


async def _until_healthy(server: EmbeddedServer, timeout: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await healthy(server.monitoring_url):
            return True
        await asyncio.sleep(0.1)
    return False


async def node_faults(cluster: EmbeddedCluster, api: JetStreamApi, config: QueueConfig, classes: tuple[str, ...],
                      faults: Faults, rng: random.Random, ending: asyncio.Event) -> None:
    """One node-level fault at a time, of a class drawn from ``classes`` (module docstring)."""
    kinds = [c for c in NODE_FAULT_CLASSES if c in classes]
    targets = _leader_targets(config)
    while kinds and not await _pause(ending, rng.uniform(2.0, 5.0)):
        kind = rng.choice(kinds)
        try:
            if kind == "server":
                await _rolling_restart(cluster, api, targets, faults, ending)
            elif kind == "partition":
                await _cut_off(cluster, faults, rng)
            else:
                target = rng.choice(sorted(t for t in targets if kind == "stepdown" or t != "dlq"))
                await _leader_fault(cluster, api, kind, target, targets, faults, rng, ending)
        except KeyqueueError as e:
            faults.fleet.note("soak", "fault_error", fault=kind, error=repr(e))


async def _rolling_restart(cluster: EmbeddedCluster, api: JetStreamApi, targets: Mapping[str, tuple[str, str | None]],
                           faults: Faults, ending: asyncio.Event) -> None:
    for step, server in enumerate(cluster.servers, 1):
        if ending.is_set():
            return
        fault = faults.begin("rolling-restart", server.name, step=step)
        await server.stop()
        await server.start(timeout=60)
        # A node back and healthy is not yet a queue that can be served: three nodes restarted a
        # second apart can leave a group without a leader (or without a quorum that answers) for
        # longer than an election, and nothing of that group can be read or written meanwhile. The
        # step lasts until every group of the queue has a leader again (it records them).
        leaders = {name: await _until_leader(api, *group, ending) for name, group in sorted(targets.items())}
        faults.end(fault, leaders=leaders)


async def _cut_off(cluster: EmbeddedCluster, faults: Faults, rng: random.Random) -> None:
    index = rng.randrange(cluster.size)
    proxies = [p for p in cluster.routes_of(index) if isinstance(p, FaultProxy)]
    mode = rng.choice(["refuse", "blackhole"])
    fault = faults.begin("node-cut", cluster.servers[index].name, mode=mode)
    for proxy in proxies:
        if mode == "refuse":
            proxy.reset()
            proxy.refuse(True)
        else:
            proxy.blackhole()
    await asyncio.sleep(rng.uniform(2.0, 6.0))
    for proxy in proxies:
        proxy.refuse(False)
        proxy.heal()
    await _until_healthy(cluster.servers[index])
    faults.end(fault)


async def _leader_fault(cluster: EmbeddedCluster, api: JetStreamApi, kind: str, target: str,
                        targets: Mapping[str, tuple[str, str | None]], faults: Faults, rng: random.Random,
                        ending: asyncio.Event) -> None:
    stream, consumer = targets[target]
    leader = await _leader(api, stream, consumer)
    index = next((i for i, server in enumerate(cluster.servers) if server.name == leader), None)
    if index is None:
        return
    if kind == "cluster":
        fault = faults.begin(f"leader-kill-9-{target}", leader)
        cluster.kill(index)
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        await cluster.restart(index, timeout=60)
        # The dead node led more groups than the target, maybe: the fault lasts until every group of
        # the queue has a leader again. An election can take more than one round (4-9 s each), and
        # nothing of a leaderless group can be read or written meanwhile, whatever keyqueue does.
        leaders = {name: await _until_leader(api, *group, ending) for name, group in sorted(targets.items())}
        faults.end(fault, leaders=leaders)
        return
    fault = faults.begin(f"stepdown-{target}", leader)
    subject = (f"CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}" if consumer else f"STREAM.LEADER.STEPDOWN.{stream}")
    reply: Mapping[str, Any] = {}
    try:
        reply = await api.request(subject, {})
    finally:
        faults.end(fault, leader=await _until_leader(api, stream, consumer, ending), ok=bool(reply.get("success")))
