"""``python -m bench.revisions BASE [OTHER]``: the product path of two git revisions, in turns, in one run.

A change of a few percent in the worker's CPU per request is smaller than what separates two runs of
the same code on a shared machine (up to a quarter here). So this runs ``python -m bench.user_path``
(hot and cold keys, stored first, one ``keyqueue worker`` process; no peers, no unkeyed workload) on
each revision in turn, ``--rounds`` times, BASE first in odd rounds and OTHER first in even ones (a
run's place in a round can itself favour it: with one revision first every time, the same code
measured against itself came out 0.75x the CPU per hot request), and compares them round by round:
each round's ratio OTHER / BASE is taken on figures measured a minute apart on the same machine,
and the median of those ratios is the comparison. Give the same revision twice for a control: what
this machine makes of no change at all, which a change must clearly exceed.

Each revision runs from a temporary git worktree (removed at the end) with this checkout's
virtualenv; OTHER defaults to this working tree, uncommitted changes included. Both must have
``bench.user_path`` with the options used here (any revision since the peers were added to it).

    python -m bench.revisions 953fd7c            # the last commit before a change, against the tree
    python -m bench.revisions v0.1.0 main --rounds 5 --cold-keys 10000
    python -m bench.revisions 3c556ac --calls    # Python calls per cold key and per hot request
    python -m bench.revisions 4659dc3 --cluster  # on a 3-node cluster, R3 streams (both need --cluster)
    python -m bench.revisions 953fd7c 953fd7c    # the control: one revision against itself

``--calls`` counts instead of timing: the Python calls the worker makes per cold key and per hot
request, by cProfile, as the difference between two runs of different sizes (so start-up and
shut-down drop out). A count does not vary from run to run as the machine's speed does, so one
run of each revision shows a change of a few percent in the Python per request; it does not see
what a call costs, nor the collector, the kernel or the server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")

_ROW = re.compile(r"^(?P<workload>hot keys|cold keys)\b.*?(?P<rate>[\d,]+) req/s.*?worker CPU\s+(?P<cpu>\d+) us/req")


@dataclass(frozen=True)
class Figures:
    """One run's rates (requests a second) and the worker's CPU per request (microseconds)."""

    hot: float
    hot_cpu: float
    cold: float
    cold_cpu: float


def parse(output: str) -> Figures:
    """The hot and cold rows of ``bench.user_path``'s output."""
    found: dict[str, tuple[float, float]] = {}
    for line in output.splitlines():
        if match := _ROW.match(line):
            found[match["workload"]] = (float(match["rate"].replace(",", "")), float(match["cpu"]))
    if set(found) != {"hot keys", "cold keys"}:
        raise ValueError(f"bench.user_path printed no hot and cold rows:\n{output}")
    return Figures(*found["hot keys"], *found["cold keys"])


@contextlib.contextmanager
def checkout(revision: str | None, into: Path, slot: int = 1) -> Iterator[Path]:
    """A directory holding ``revision`` (None: this working tree, as it is); ``slot`` tells apart two
    checkouts of one revision."""
    if revision is None:
        yield ROOT
        return
    path = into / f"{slot}-{re.sub(r'[^A-Za-z0-9._-]', '_', revision)}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), revision], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def measure(tree: Path, args: argparse.Namespace) -> Figures:
    """One ``bench.user_path`` run of the code in ``tree``."""
    command = [sys.executable, "-m", "bench.user_path", "--hot-keys", str(args.hot_keys), "--hot-per-key",
               str(args.hot_per_key), "--cold-keys", str(args.cold_keys), "--unkeyed", "1", "--no-end-to-end",
               "--raw", str(args.raw)] + (["--cluster"] if args.cluster else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bench.user_path failed in {tree} ({done.returncode}):\n{done.stderr[-2000:]}")
    return parse(done.stdout)


def calls(tree: Path, args: argparse.Namespace, into: Path) -> tuple[float, float]:
    """The Python calls the worker of ``tree`` makes per cold key and per hot request."""
    def count(hot_per_key: int, cold_keys: int) -> int:
        stats = into / f"calls-{tree.name}-{hot_per_key}-{cold_keys}.prof"
        command = [sys.executable, "-m", "bench.user_path", "--hot-keys", str(args.hot_keys if hot_per_key else 0),
                   "--hot-per-key", str(hot_per_key), "--cold-keys", str(cold_keys), "--unkeyed", "1",
                   "--no-end-to-end", "--raw", "2000", "--profile", str(stats)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"bench.user_path failed in {tree} ({done.returncode}):\n{done.stderr[-2000:]}")
        return sum(entry[1] for entry in pstats.Stats(str(stats)).stats.values())  # type: ignore[attr-defined]

    small, large = max(1, args.cold_keys // 4), args.cold_keys
    per_key = (count(0, large) - count(0, small)) / (large - small)
    few, many = max(1, args.hot_per_key // 4), args.hot_per_key
    per_request = (count(many, 0) - count(few, 0)) / (args.hot_keys * (many - few))
    return per_key, per_request


def ratios(base: Sequence[Figures], other: Sequence[Figures]) -> Figures:
    """The median over the rounds of each round's OTHER / BASE."""
    def median(field: str) -> float:
        return statistics.median(float(getattr(o, field)) / float(getattr(b, field))
                                 for b, o in zip(base, other, strict=True))

    return Figures(median("hot"), median("hot_cpu"), median("cold"), median("cold_cpu"))


def medians(figures: Sequence[Figures]) -> Figures:
    return Figures(*(statistics.median(getattr(f, field) for f in figures)
                     for field in ("hot", "hot_cpu", "cold", "cold_cpu")))


def in_turns(revisions: tuple[tuple[str, T], tuple[str, T]], rounds: int) -> Iterator[tuple[int, str, T]]:
    """(round, name, tree) for each run: BASE first in odd rounds, OTHER first in even ones."""
    for n in range(1, rounds + 1):
        for name, tree in revisions if n % 2 else revisions[::-1]:
            yield n, name, tree


def _row(label: str, f: Figures, unit: str = "") -> str:
    if unit == "x":
        return f"{label:28} {f.hot:8.2f}x {f.hot_cpu:10.2f}x {f.cold:9.2f}x {f.cold_cpu:10.2f}x"
    return f"{label:28} {f.hot:9,.0f} {f.hot_cpu:8.0f} us {f.cold:10,.0f} {f.cold_cpu:8.0f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__.splitlines()[0],
                                     epilog="Example: python -m bench.revisions HEAD~3 --rounds 5")
    parser.add_argument("base", help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("other", nargs="?", help="the revision measured against it (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each revision, in turns (default 3)")
    parser.add_argument("--hot-keys", type=int, default=100)
    parser.add_argument("--hot-per-key", type=int, default=200)
    parser.add_argument("--cold-keys", type=int, default=5000)
    parser.add_argument("--raw", type=int, default=5000, help="messages of raw fetch+ack each run measures first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--cluster", action="store_true",
                        help="on a 3-node cluster with R3 streams (both revisions' bench.user_path need --cluster)")
    parser.add_argument("--calls", action="store_true",
                        help="count the worker's Python calls per cold key and per hot request instead (one run each)")
    args = parser.parse_args(argv)
    names = (args.base, args.other or "working tree")
    if names[0] == names[1]:  # the control: one revision against itself
        names = (f"{args.base} (1)", f"{args.base} (2)")
    if args.calls:
        return _count_calls(args, names)
    results: dict[str, list[Figures]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="kq-revisions-") as tmp, \
            checkout(args.base, Path(tmp)) as base_tree, checkout(args.other, Path(tmp), 2) as other_tree:
        print(f"{'round, revision':28} {'hot req/s':>9} {'CPU/req':>11} {'cold keys/s':>10} {'CPU/key':>11}",
              flush=True)
        for n, name, tree in in_turns(((names[0], base_tree), (names[1], other_tree)), args.rounds):
            figures = measure(tree, args)
            results[name].append(figures)
            print(_row(f"{n}. {name}", figures), flush=True)
    print()
    for name in names:
        print(_row(f"median, {name}", medians(results[name])))
    print(_row(f"{names[1]} / {names[0]}", ratios(results[names[0]], results[names[1]]), "x"))
    print("(the last row: the median over the rounds of each round's ratio; CPU below 1x is less CPU)")
    return 0


def _count_calls(args: argparse.Namespace, names: tuple[str, str]) -> int:
    counted: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="kq-revisions-") as tmp, \
            checkout(args.base, Path(tmp)) as base_tree, checkout(args.other, Path(tmp), 2) as other_tree:
        print(f"{'revision':28} {'calls per cold key':>18} {'per hot request':>16}", flush=True)
        for name, tree in zip(names, (base_tree, other_tree), strict=True):
            counted.append(calls(tree, args, Path(tmp)))
            print(f"{name:28} {counted[-1][0]:18,.0f} {counted[-1][1]:16,.0f}", flush=True)
    (base_key, base_request), (key, request) = counted
    print(f"{names[1] + ' / ' + names[0]:28} {key / base_key:17.2f}x {request / base_request:15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
