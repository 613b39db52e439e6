"""A worker process for chaos runs: a real ``QueueWorker`` whose processor logs every run.

    python -m keyqueue.chaos.worker URL[,URL...] QUEUE LOGFILE --name w1 [--ack-wait S] [--concurrency N]
        [--clock-offset S] [--pool-size N]

Each request is read as :func:`keyqueue.chaos.handlers.read_work` says (one it cannot read is
dead-lettered at once with the reason, as keyqueue's task processor does): a JSON body
``{"tag": ..., "sleep": seconds, "shape": ...}``, optionally with ``"block": seconds``. The
processor logs ``start``, runs the work in its handler shape (:mod:`keyqueue.chaos.handlers`: on
the loop, in a thread, in a child of the process pool ``--pool-size``), waiting ``sleep`` seconds
(with ``block``: first stalls that long, by blocking the event loop with ``time.sleep`` or holding
the GIL in a thread, logging ``blocked`` / ``unblocked`` records, or, in a thread or child, sleeps
that much longer; only the first run of the request in the whole fleet does, claimed with a marker
file beside the log), checks its lease, writes the
tag to the :class:`~keyqueue.chaos.fenced.FencedStore` under the session's fencing token (logging
the ``write`` and whether it was accepted), and logs ``end`` (``"ok": false`` when it did not
finish). A refused write means this holder is a former one: the run ends with ``LeaseLost`` and
leaves the request to the current holder.

Every step of every key session is logged too, as an ``event`` record (:class:`EventLog`). The
``ready`` record says the process's ``pid``, its ``concurrency`` (keys it may hold at once) and its
``clock_offset``: with ``--clock-offset``, the process's wall clock runs that many seconds ahead
(or behind) of the true one (:func:`~keyqueue.chaos.clock.skew_wall_clock`); every record's ``t``
stays on the true clock.

Signals inject faults into this process: SIGUSR1 blocks the event loop for ``--stall-under``
seconds, SIGUSR2 for ``--stall-over`` (each logged as ``paused`` / ``resumed``, since nothing in
the process runs meanwhile); SIGTERM drains (a second SIGTERM stops at once). Two more ask what a
worker that went silent is doing (the soak sends both, :class:`~keyqueue.chaos.fleet.SilenceWatch`),
each written to the process's stderr: SIGQUIT, every thread's Python stack (:mod:`faulthandler`,
from C: it answers with the event loop blocked and the GIL held); SIGHUP, from the event loop, the
NATS client's state (connected, reconnecting, its reconnect task) and every asyncio task's stack,
with a ``dumped`` record of the client's state in the run log. The worker logs ``disconnected``
and ``reconnected`` records as its connection drops and comes back.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from keyqueue.app.process_pool import ProcessPool
from keyqueue.chaos.clock import skew_wall_clock
from keyqueue.chaos.fenced import FencedStore
from keyqueue.chaos.handlers import RunLog, read_work, sync_fields, sync_work
from keyqueue.core.observer import KeyHold, NullObserver, Outcome, RequestAttempt, SessionEnd, describe
from keyqueue.core.processor import BaseProcessor, Reply, Request, RequestContext
from keyqueue.core.retry import RetryPolicy
from keyqueue.core.session import SessionSettings
from keyqueue.core.worker import QueueWorker
from keyqueue.errors import ConnectionFailed, LeaseLost, Reject
from keyqueue.jetstream.connect import connect
from keyqueue.jetstream.topology import QueueConfig

HANDLER_IO_TIMEOUT = 1.0
"""Seconds a handler's write to the fenced store waits for its reply before the run fails (and is
retried): a write is a few milliseconds, an R3 leader's election up to 9 s."""


class EventLog(NullObserver):
    """A session observer that appends each step to the run log as an ``event`` record::

        {"w": "w1", "kind": "event", "t": ..., "event": "acquired", "queue": "q", "worker": "w1",
         "key": "k", "fencing": [7, 1], "delivered": 1}

    Events and their fields: ``token`` (delivered: a token reached the worker), ``acquired``
    (fencing, delivered), ``started`` (request_id, seq,
    attempt, batch, message_type), ``retried`` (request_id, attempt, delay, error, message_type),
    ``succeeded`` (request_id, seq, elapsed, message_type), ``dead_lettered`` (request_id, seq,
    reason, attempts, error, message_type), ``released`` / ``handed-off`` (processed, republished),
    ``lease_lost`` (reason), ``session_failed`` (error), ``interrupted``, ``contended``, and
    ``pinned`` / ``unpinned`` (pin_id, key null).
    """

    def __init__(self, log: RunLog, worker: str) -> None:
        self.log = log
        self.worker = worker

    def _write(self, event: str, queue: str, key: str | None, **fields: Any) -> None:
        self.log.write("event", event=event, queue=queue, worker=self.worker, key=key, **fields)

    def token_received(self, queue: str, key: str, delivered: int) -> None:
        self._write("token", queue, key, delivered=delivered)

    def key_acquired(self, hold: KeyHold) -> None:
        self._write("acquired", hold.queue, hold.key, fencing=hold.fencing, delivered=hold.delivered)

    def key_released(self, hold: KeyHold, end: SessionEnd) -> None:
        if end.outcome is Outcome.LEASE_LOST:
            self._write("lease_lost", hold.queue, hold.key, reason=end.reason)
        elif end.outcome is Outcome.FAILED:
            self._write("session_failed", hold.queue, hold.key, error=end.reason)
        elif end.outcome in (Outcome.INTERRUPTED, Outcome.CONTENDED):
            self._write(end.outcome.value, hold.queue, hold.key)
        else:
            self._write(end.outcome.value, hold.queue, hold.key, processed=end.processed,
                        republished=end.republished)

    def request_started(self, attempt: RequestAttempt) -> None:
        self._write("started", attempt.queue, attempt.key, request_id=attempt.request_id, seq=attempt.seq,
                    attempt=attempt.attempt, batch=attempt.batch, message_type=attempt.message_type)

    def request_retried(self, attempt: RequestAttempt, delay: float, error: BaseException) -> None:
        self._write("retried", attempt.queue, attempt.key, request_id=attempt.request_id, attempt=attempt.attempt,
                    delay=delay, error=describe(error), message_type=attempt.message_type)

    def request_succeeded(self, request: RequestAttempt, elapsed: float, superseded_by: str | None) -> None:
        self._write("succeeded", request.queue, request.key, request_id=request.request_id, seq=request.seq,
                    elapsed=elapsed, message_type=request.message_type)

    def request_dead_lettered(self, request: RequestAttempt, reason: str, error: BaseException) -> None:
        self._write("dead_lettered", request.queue, request.key, request_id=request.request_id, seq=request.seq,
                    reason=reason, attempts=request.attempt, error=describe(error),
                    message_type=request.message_type)

    def worker_pinned(self, queue: str, pin_id: str) -> None:
        self._write("pinned", queue, None, pin_id=pin_id)

    def worker_unpinned(self, queue: str, pin_id: str) -> None:
        self._write("unpinned", queue, None, pin_id=pin_id)


class FencedWriter(BaseProcessor):
    """Logs each run and writes its tag to the fenced store under the session's fencing token.

    The request's ``shape`` (:mod:`keyqueue.chaos.handlers`) says how its work runs: on the loop,
    in a thread of ``executor`` or in a child of ``pool`` (None: no ``process`` requests).
    """

    def __init__(self, log: RunLog, store: FencedStore, markers: Path, executor: Executor,
                 pool: ProcessPool | None = None) -> None:
        self.log = log
        self.store = store
        self.markers = markers
        self.executor = executor
        self.pool = pool

    async def handle(self, ctx: RequestContext, request: Request) -> Reply | None:
        work = read_work(request)  # a WireError dead-letters the request, before any run
        tag = str(work["tag"])
        shape = str(work.get("shape", "async"))
        self.log.write("start", key=request.key, tag=tag, seq=request.seq, fencing=list(ctx.fencing),
                       attempt=ctx.attempt, shape=shape)
        ok = False
        try:
            stall = float(work.get("block") or 0.0)
            if stall and not self._first_to_block(tag):
                stall = 0.0
            if shape in ("async", "blocking"):
                if stall:
                    self.log.write("blocked", key=request.key, tag=tag, seconds=stall)
                    time.sleep(stall)  # noqa: ASYNC251  # blocking code in an async handler, on purpose
                    self.log.write("unblocked", key=request.key, tag=tag)
                await asyncio.sleep(float(work.get("sleep", 0.0)))
            else:
                fields = sync_fields(self.log.path, self.log.worker, request.key, work, shape, stall)
                if shape == "process":
                    await self._in_child(ctx, request, fields)
                else:
                    await sync_work.run(None, [], fields, self.executor)
            ctx.check_lease()
            outcome = await self.store.attempt(request.key, ctx.fencing, {"tag": tag})
            self.log.write("write", key=request.key, tag=tag, fencing=list(ctx.fencing),
                           accepted=outcome.accepted, seq=outcome.seq)
            if not outcome.accepted:
                raise LeaseLost(f"the fenced store refused fencing {ctx.fencing}: a newer holder wrote")
            ok = True
            return None
        finally:
            self.log.write("end", key=request.key, tag=tag, ok=ok)

    async def _in_child(self, ctx: RequestContext, request: Request, fields: dict[str, Any]) -> None:
        if self.pool is None:
            raise Reject("a process-shape request reached a chaos worker without a process pool (--pool-size 0)")
        context = {"task": sync_work.name, "queue": ctx.queue, "key": request.key,
                   "request_id": request.request_id, "attempt": ctx.attempt, "fencing": list(ctx.fencing)}
        try:
            await self.pool.run(sync_work, fields, context)
        finally:
            # The pool has the child's answer, or has killed and joined it: its run is over.
            self.log.write("reaped", key=request.key, tag=fields["tag"])

    def _first_to_block(self, tag: str) -> bool:
        """Whether this run claims the request's one stalling run (a rerun elsewhere does not stall)."""
        try:
            os.close(os.open(self.markers / f"blocked-{tag}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def _stall(log: RunLog, seconds: float) -> None:
    log.write("paused", reason="stall", seconds=seconds)
    time.sleep(seconds)  # blocks the event loop on purpose
    log.write("resumed", reason="stall")


def _dump(log: RunLog, nc: Any) -> None:
    """Write the NATS client's state and every asyncio task's stack to stderr; log the state."""
    task = getattr(nc, "_reconnection_task", None)
    state: dict[str, Any] = {
        "connected": nc.is_connected, "reconnecting": nc.is_reconnecting, "closed": nc.is_closed,
        "url": nc.connected_url.netloc if nc.connected_url else None,
        "reconnect_task": None if task is None else ("cancelled" if task.cancelled() else "done" if task.done()
                                                     else "running"),
        "reconnect_error": repr(task.exception()) if task is not None and task.done() and not task.cancelled()
        and task.exception() is not None else None,
        "last_error": repr(nc.last_error) if nc.last_error else None,
        "tasks": len(asyncio.all_tasks()),
    }
    print(f"--- dump at {time.time():.3f}: {state}", file=sys.stderr, flush=True)
    for each in asyncio.all_tasks():
        print(f"task {each!r}", file=sys.stderr)
        each.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()
    log.write("dumped", **state)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("logfile")
    p.add_argument("--name", default=f"w{os.getpid()}")
    p.add_argument("--ack-wait", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--linger", type=float, default=0.02)
    p.add_argument("--drain-timeout", type=float, default=2.0)
    p.add_argument("--stall-under", type=float, default=1.5)
    p.add_argument("--stall-over", type=float, default=3.0)
    p.add_argument("--replicas", type=int, default=1, help="3 on a cluster (the soak's cluster class)")
    p.add_argument("--no-watchdog", dest="watchdog", action="store_false",
                   help="run without the loop watchdog and the lease alarm (keyqueue worker runs with both): a "
                        "stall or a stop past the lease then leaves a zombie the fencing token must catch, instead "
                        "of ending the process")
    p.add_argument("--clock-offset", type=float, default=0.0,
                   help="run this process's wall clock this many seconds ahead (negative: behind)")
    p.add_argument("--pool-size", type=int, default=0,
                   help="child processes of the process pool that runs process-shape requests (0: none)")
    args = p.parse_args()
    # The soak's dump signals (SilenceWatch): answered from the start, never the default action
    # (both would end the process); SIGHUP's loop handler comes once the client is up.
    faulthandler.register(signal.SIGQUIT, file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    skew_wall_clock(args.clock_offset)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(created).3f {args.name} %(levelname)s %(name)s: %(message)s")
    log = RunLog(args.logfile, args.name)
    worker: QueueWorker | None = None

    async def reconnected() -> None:
        log.write("reconnected")
        if worker is not None:
            worker.reconnected()

    async def disconnected() -> None:
        log.write("disconnected")

    # The server (or this worker's proxy) may be down right now: a restarted worker waits for it.
    for attempt in range(120):
        try:
            nc = await connect(args.url, name=args.name, reconnected=reconnected, disconnected=disconnected)
            break
        except ConnectionFailed:
            if attempt == 119:
                raise
            await asyncio.sleep(0.5)
    # The handler's own write gives up after a second, as a handler that retries its I/O promptly
    # would: a write lost with a restarted leader (no reply ever) costs the key a second and a
    # retry, not the API's 5 s, which the checker would count against the hand-off (the key's
    # holder never let go of it).
    store = FencedStore(nc, replicas=args.replicas, timeout=HANDLER_IO_TIMEOUT)
    config = QueueConfig(args.queue, ack_wait=args.ack_wait, replicas=args.replicas)
    settings = SessionSettings(ack_wait=args.ack_wait, linger=args.linger, drain_timeout=args.drain_timeout,
                               retry=RetryPolicy(max_attempts=1000, base_delay=0.05, max_delay=0.5))
    markers = Path(args.logfile).parent
    executor = ThreadPoolExecutor(args.concurrency, thread_name_prefix="chaos-sync")
    pool = ProcessPool("keyqueue.chaos.handlers:app", args.pool_size) if args.pool_size else None
    worker = QueueWorker(nc, config, lambda key: FencedWriter(log, store, markers, executor, pool),
                         concurrency=args.concurrency, settings=settings, name=args.name, reconcile_interval=5.0,
                         observer=EventLog(log, args.name), watchdog=args.watchdog)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _stall, log, args.stall_under)
    loop.add_signal_handler(signal.SIGUSR2, _stall, log, args.stall_over)
    loop.add_signal_handler(signal.SIGHUP, _dump, log, nc)
    signals = 0

    def on_term() -> None:
        nonlocal signals
        signals += 1
        assert worker is not None
        worker.stop(now=signals > 1)

    loop.add_signal_handler(signal.SIGTERM, on_term)
    run = asyncio.create_task(worker.run())
    await worker.started()
    log.write("ready", pid=os.getpid(), concurrency=args.concurrency, clock_offset=args.clock_offset)
    await run
    log.write("exit", counts=worker.counts)
    if pool is not None:
        pool.close()
    executor.shutdown(wait=False)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
