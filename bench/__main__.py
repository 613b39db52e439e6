"""``python -m bench [--quick | --full] [--peers | --no-peers]``: run the benchmarks, print the table.

The full run writes ``docs/benchmarks.md`` and ``docs/benchmarks-latency.png``; a quick run writes
``out/benchmarks-quick.md`` and its chart instead, so a quick look never replaces the published
figures (``--docs`` makes it write docs/ anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from bench import delays, result_ttl
from bench import report as output
from bench.fleet import REPO, WorkerOptions
from bench.results import MODES, Row
from bench.run import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="smaller workloads, under a minute, peers off unless --peers")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="the default")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help=argparse.SUPPRESS)
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                        help="also run Celery, Dramatiq and procrastinate on the hot and the cold workload, "
                        "beside keyqueue's product path (default: on in full mode)")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                        help="write docs/benchmarks.md (default: only in full mode)")
    parser.add_argument("--concurrency", type=int, default=128, help="key slots per keyqueue worker process")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default=None,
                        help="the product path's `keyqueue worker --loop` (default: the command's own)")
    parser.add_argument("--profile", type=Path, help="profile every keyqueue worker with pyinstrument into DIR")
    args = parser.parse_args(argv)
    mode_name = args.mode or "full"
    peers = args.peers if args.peers is not None else mode_name == "full"
    docs = args.docs if args.docs is not None else mode_name == "full"
    command = "python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    options = WorkerOptions(concurrency=args.concurrency, profile_dir=args.profile, loop=args.loop)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    result = asyncio.run(run(MODES[mode_name], peers=peers, command=command.strip(), options=options))
    for lateness in asyncio.run(delays.run(mode_name)):  # due-time lateness of delayed requests
        print(lateness.line())
        p99 = lateness.percentile(99)
        row = result.add(Row(f"8. delayed requests {lateness.name}", "keyqueue", p99 * 1000, "ms",
                             f"p99 start lateness; p50 {lateness.percentile(50) * 1000:.0f} ms, "
                             f"max {max(lateness.seconds) * 1000:.0f} ms, n={len(lateness.seconds):,}"))
        if lateness.name.startswith("burst"):
            row.goal, row.met = "p99 <= 1 s", p99 <= 1.0
    # What keeping results (result_ttl) costs a worker: rounds with and without, alternating.
    sizes = {"full": (5000, 100, 3, 32)}.get(mode_name, (2000, 100, 1, 32))
    without, kept = asyncio.run(result_ttl.main(*sizes))
    cost = 1 - kept / without
    row = result.add(Row("9. result_ttl cost (throughput lost)", "keyqueue", cost * 100, "%",
                         f"{kept:,.0f} req/s keeping results against {without:,.0f} without (medians of "
                         f"{sizes[2]} alternating rounds, {sizes[0]:,} requests over {sizes[1]} keys, app.worker)"))
    row.goal, row.met = "<= 15%", cost <= 0.15
    print(output.table(result))
    if docs:
        md, png = REPO / "docs" / "benchmarks.md", REPO / "docs" / "benchmarks-latency.png"
    else:
        md, png = REPO / "out" / f"benchmarks-{mode_name}.md", REPO / "out" / f"benchmarks-{mode_name}-latency.png"
    output.write(result, md, png, REPO / "out" / f"benchmarks-{mode_name}.json")
    print(f"\nwrote {md.relative_to(REPO)} and {png.relative_to(REPO)} ({result.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
