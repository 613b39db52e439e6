"""``python -m keyqueue.chaos``: run a soak and print the verdict (exit 1 if it failed)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from keyqueue.chaos.soak import CLASSES, DEFAULT_CLASSES, SoakOptions, soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m keyqueue.chaos",
        description="Soak keyqueue under injected faults and check that a key never had two holders, "
                    "that each key's requests completed in order, and that none was lost.",
        epilog="Example: python -m keyqueue.chaos --seed 7 --faults 500 --duration 900  (make chaos)")
    p.add_argument("--seed", type=int, default=1, help="seed of every random choice (default 1)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults at most (default 120)")
    p.add_argument("--faults", type=int, default=None, help="stop after this many faults (default: no limit)")
    p.add_argument("--classes", default=",".join(DEFAULT_CLASSES),
                   help=f"fault classes, comma-separated, from {', '.join(CLASSES)} (default: "
                        f"{','.join(DEFAULT_CLASSES)}; cluster runs a 3-node cluster, alone or with process)")
    p.add_argument("--workers", type=int, default=3, help="worker processes, each behind its own proxy")
    p.add_argument("--keys", type=int, default=12, help="keys the producer spreads requests over")
    p.add_argument("--rate", type=float, default=60.0, help="requests enqueued per second")
    p.add_argument("--ack-wait", type=float, default=2.0, help="the lease, in seconds")
    p.add_argument("--workdir", type=Path, default=Path("chaos-run"),
                   help="where the run log, worker stderr and the server's store go (default ./chaos-run)")
    args = p.parse_args(argv)
    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip())
    unknown = set(classes) - set(CLASSES)
    if unknown:
        p.error(f"unknown fault class(es): {', '.join(sorted(unknown))}; choose from {', '.join(CLASSES)}")
    if "cluster" in classes and {"network", "server"} & set(classes):
        p.error("the cluster class runs alone or with process faults (its workers use no proxies)")
    options = SoakOptions(seed=args.seed, duration=args.duration, max_faults=args.faults, classes=classes,
                          workers=args.workers, keys=args.keys, rate=args.rate, ack_wait=args.ack_wait,
                          workdir=args.workdir)
    # SIGTERM ends the soak like Ctrl-C: its worker processes and servers are stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = asyncio.run(soak(options))
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
