"""``python -m keyqueue.chaos``: run a soak and print the verdict (exit 1 if it failed)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from keyqueue.chaos.handlers import HANDLERS
from keyqueue.chaos.liveness import LivenessBounds
from keyqueue.chaos.soak import CLASSES, CLUSTER_CLASSES, DEFAULT_CLASSES, SoakOptions, soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m keyqueue.chaos",
        description="Soak keyqueue under injected faults and check that a key never had two holders, "
                    "that each key's requests completed in order, that none was lost, and that none waited "
                    "for nobody (strands) or for a fault's keys to move longer than its bound.",
        epilog="Examples: python -m keyqueue.chaos --seed 7 --faults 500 --duration 1200  (make chaos); "
               "python -m keyqueue.chaos --seed 7 --faults 1000 --classes all --duration 3600  (make chaos-cluster)")
    p.add_argument("--seed", type=int, default=1, help="seed of every random choice (default 1)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults at most (default 120)")
    p.add_argument("--faults", type=int, default=None, help="stop after this many faults (default: no limit)")
    p.add_argument("--classes", default=",".join(DEFAULT_CLASSES),
                   help=f"fault classes, comma-separated, any mix of {', '.join(CLASSES)}; all; or none (no "
                        f"fault: the liveness baseline) (default: "
                        f"{','.join(DEFAULT_CLASSES)}); {', '.join(CLUSTER_CLASSES)} run on a 3-node R3 cluster, "
                        "where server means rolling restarts")
    p.add_argument("--nodes", type=int, choices=(1, 3), default=None,
                   help="nats-servers: 1, or 3 (R3 streams); default: 3 with a cluster class, else 1")
    p.add_argument("--workers", type=int, default=3, help="worker processes, each behind its own proxy")
    p.add_argument("--keys", type=int, default=12, help="keys the producer spreads requests over")
    p.add_argument("--rate", type=float, default=60.0, help="requests enqueued per second")
    p.add_argument("--max-backlog", type=int, default=2000,
                   help="store nothing while more requests than this wait (default 2000; 0: no limit), so that a "
                        "fleet slower than --rate ends the faults with a backlog it can drain; the time held back "
                        "is printed")
    p.add_argument("--ack-wait", type=float, default=2.0, help="the lease, in seconds")
    p.add_argument("--strand-bound", type=float, default=2.0,
                   help="longest a stored request may wait with its key and a worker free (default 2 s)")
    p.add_argument("--resume-bound", type=float, default=2.0,
                   help="after a fault shorter than the lease, its keys progress within this (default 2 s)")
    p.add_argument("--silence-bound", type=float, default=5.0,
                   help="longest a worker may write nothing while available with some request waiting on a free "
                        "key: strand time of any request, summed (default 5 s); a silent worker's stacks are "
                        "dumped into its stderr file")
    p.add_argument("--lease-slack", type=float, default=1.0,
                   help="after a lost holder's lease (whole seconds), its keys move within this (default 1 s)")
    p.add_argument("--handlers", default="async",
                   help=f"handler shapes of the workload, comma-separated, any mix of {', '.join(HANDLERS)}; or "
                        "all (default: async). Each request takes one of async/thread/process; one request every "
                        "--stall-every seconds stalls its worker in a gil or blocking handler, or runs 1.5x the "
                        "lease longer in a thread or process; bad-input mixes in requests the workers must "
                        "dead-letter")
    p.add_argument("--stall-every", type=float, default=8.0,
                   help="seconds between two requests flagged to stall (gil, blocking) or to be slow (thread, "
                        "process), in turn (default 8)")
    p.add_argument("--bad-every", type=float, default=2.0,
                   help="seconds between two bad requests (bad-input) (default 2)")
    p.add_argument("--rss-warmup", type=float, default=10.0,
                   help="seconds a worker process runs before its warm-up RSS sample (default 10)")
    p.add_argument("--rss-limit", type=float, default=None,
                   help="fail the soak if a worker's RSS after the last fault is more than this fraction above "
                        "its warm-up RSS (e.g. 0.10); default: print the comparison only")
    p.add_argument("--workdir", type=Path, default=Path("chaos-run"),
                   help="where the run log, worker stderr and the server's store go (default ./chaos-run)")
    args = p.parse_args(argv)
    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip())
    if classes == ("all",):
        classes = CLASSES
    elif classes == ("none",):
        classes = ()
    unknown = set(classes) - set(CLASSES)
    if unknown:
        p.error(f"unknown fault class(es): {', '.join(sorted(unknown))}; choose from {', '.join(CLASSES)} or all")
    handlers = tuple(h.strip() for h in args.handlers.split(",") if h.strip())
    if handlers == ("all",):
        handlers = HANDLERS
    unknown = set(handlers) - set(HANDLERS)
    if unknown or not handlers:
        p.error(f"unknown handler(s): {', '.join(sorted(unknown)) or 'none given'}; choose from "
                f"{', '.join(HANDLERS)} or all")
    if args.nodes == 1 and set(CLUSTER_CLASSES) & set(classes):
        p.error(f"{', '.join(sorted(set(CLUSTER_CLASSES) & set(classes)))} need a cluster: leave out --nodes 1")
    bounds = LivenessBounds(lease=args.ack_wait, strand=args.strand_bound, resume=args.resume_bound,
                            slack=args.lease_slack, silence=args.silence_bound)
    options = SoakOptions(seed=args.seed, duration=args.duration, max_faults=args.faults, classes=classes,
                          nodes=args.nodes, workers=args.workers, keys=args.keys, rate=args.rate,
                          max_backlog=args.max_backlog,
                          ack_wait=args.ack_wait, bounds=bounds, workdir=args.workdir, handlers=handlers,
                          stall_every=args.stall_every, bad_every=args.bad_every, rss_warmup=args.rss_warmup,
                          rss_limit=args.rss_limit)
    # SIGTERM ends the soak like Ctrl-C: its worker processes and servers are stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = asyncio.run(soak(options))
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
