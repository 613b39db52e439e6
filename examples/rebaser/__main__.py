"""The Rebaser demo: bursts of graph updates for many change sets, two workers, coalesced DVU runs.

Run it from the repository root with ``make demo`` (or ``python -m examples.rebaser``).

1. An embedded nats-server starts, and two worker processes run ``keyqueue worker
   examples.rebaser.app:app`` (the Rebaser plugin, plus a deliberately slow ``digest`` function).
2. Forty change sets each get a first request that builds a small graph of attribute values,
   then three rounds of bursts of update requests (a few hot change sets get big bursts), all
   enqueued at once, interleaved across change sets, through ``RebaserClient.enqueue_many``.
3. Each change set gets one last request that waits for the DVU covering it.
4. Every change set's stored values are checked against applying its requests one by one in
   memory and recomputing every value from scratch.

The demo prints, per change set, the requests applied and the DVU runs (N triggers -> k runs),
then the totals and throughput. It exits 0 only if every check holds.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections import Counter, deque
from pathlib import Path

from examples.rebaser.app import FUNCTIONS
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.queue_io import requests_waiting
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_rebaser import ChangeSetState, RebaserClient, Update
from keyqueue_rebaser.workload import ChangeSetModel, compare, setup_updates

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("w1", "w2")
WORKSPACES, CHANGE_SETS_PER_WORKSPACE, ROUNDS = 4, 10, 3
SEED = 2024


class Checks:
    """Named checks; the demo's exit status is whether all of them held."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
        if not ok:
            self.failed.append(what)


def first_request() -> list[Update]:
    """The graph every change set starts with: the workload's, plus a slow ``digest`` of two results."""
    return [*setup_updates(), Update.add_node("stamp"), Update.add_dependency("stamp", "digest", ["grand", "tag"])]


# --- worker processes ----------------------------------------------------------------------------


class WorkerProcess:
    """``keyqueue worker examples.rebaser.app:app`` in a child process; its log is read as it comes."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name, self.proc = name, proc
        self.log: deque[str] = deque(maxlen=200)
        self.serving = asyncio.Event()
        # A log pipe nobody reads fills up and stalls the worker: read it for the worker's whole life.
        self.reader = asyncio.create_task(self._read_log(), name=f"log:{name}")

    @classmethod
    async def start(cls, name: str, url: str) -> WorkerProcess:
        keyqueue = Path(sys.executable).with_name("keyqueue")
        command = [str(keyqueue)] if keyqueue.exists() else [sys.executable, "-m", "keyqueue.cli"]
        env = {**os.environ, "KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"}
        proc = await asyncio.create_subprocess_exec(
            *command, "worker", "examples.rebaser.app:app", "--url", url, "--concurrency", "32",
            cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        return cls(name, proc)

    async def _read_log(self) -> None:
        assert self.proc.stderr is not None
        while line := (await self.proc.stderr.readline()).decode():
            self.log.append(line)
            if "serving queue rebaser" in line:
                self.serving.set()

    async def ready(self) -> None:
        """Wait until the worker says it serves the queue."""
        await asyncio.wait({asyncio.ensure_future(self.serving.wait()), self.reader},
                                     return_when=asyncio.FIRST_COMPLETED)
        if not self.serving.is_set():
            raise RuntimeError(f"worker {self.name} exited during start:\n" + "".join(self.log))

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.proc.wait(), 30)
        await asyncio.wait_for(self.reader, 5)
        return code


# --- the run -------------------------------------------------------------------------------------


async def run(url: str, checks: Checks) -> None:
    workers = [await WorkerProcess.start(name, url) for name in WORKERS]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.ready() for w in workers)), 60)
        names = {f":{w.proc.pid}": w.name for w in workers}
        print(f"workers {', '.join(f'{w.name} (pid {w.proc.pid})' for w in workers)} serve queue rebaser")
        async with await RebaserClient.connect(url, timeout=60) as client:
            await exercise(client, names, checks)
            api = JetStreamApi(client.nc)
            leftovers = {stream: (await api.stream_info(stream))["state"]["messages"]
                         for stream in ("KQ_rebaser_TOKENS", "KQ_rebaser_DLQ")}
            # Requests, not messages: a key given back keeps its release marker for a second.
            leftovers["KQ_rebaser_INBOX"] = await requests_waiting(api, QueueNames("rebaser"))
    finally:
        codes = [await w.stop() for w in workers]
    checks.check(leftovers["KQ_rebaser_INBOX"] == 0 and leftovers["KQ_rebaser_DLQ"] == 0,
                 f"every request was processed and removed; none dead-lettered ({leftovers})")
    checks.check(codes == [0, 0], f"both workers drained and exited cleanly (exit codes {codes})")
    if codes != [0, 0]:
        for w in workers:
            print(f"--- {w.name} log tail ---\n" + "".join(w.log)[-3000:])


async def exercise(client: RebaserClient, names: dict[str, str], checks: Checks) -> None:
    rng = random.Random(SEED)
    keys = [(f"ws{w}", f"cs{c:02d}") for w in range(WORKSPACES) for c in range(CHANGE_SETS_PER_WORKSPACE)]
    hot = set(keys[::7])
    models = {key: ChangeSetModel(FUNCTIONS) for key in keys}
    sent = Counter[tuple[str, str]]()
    mismatched: list[str] = []

    async def send(batch: list[tuple[str, str, list[Update]]], expected: list[bool]) -> None:
        responses = await client.enqueue_many(batch, wait=True)
        for (w, cs, _), response, applies in zip(batch, responses, expected, strict=True):
            sent[(w, cs)] += 1
            ok = getattr(response, "ok", None)
            if ok is not applies:
                mismatched.append(f"{w}.{cs}: expected {'success' if applies else 'a refusal'}, got {response}")

    print(f"\n== {len(keys)} change sets: a first request each, then {ROUNDS} rounds of bursts ==")
    started = time.monotonic()
    firsts = [(w, cs, first_request()) for w, cs in keys]
    await send(firsts, [models[(w, cs)].apply(u) for w, cs, u in firsts])
    for round_no in range(1, ROUNDS + 1):
        bursts = {key: [] for key in keys}
        for key in keys:
            for _ in range(rng.randint(40, 70) if key in hot else rng.randint(4, 20)):
                bursts[key].append(models[key].random_request(rng))
        # Interleaved across change sets, as many producers would send them.
        batch, expected = [], []
        for position in range(max(len(b) for b in bursts.values())):
            for (w, cs), burst in bursts.items():
                if position < len(burst):
                    batch.append((w, cs, burst[position]))
                    expected.append(models[(w, cs)].apply(burst[position]))
        round_started = time.monotonic()
        await send(batch, expected)
        took = time.monotonic() - round_started
        print(f"round {round_no}: {len(batch)} requests answered in {took:.2f}s ({len(batch) / took:,.0f} req/s)")
    last = [Update.set_value("in5", 0)]
    settled = await asyncio.gather(*(client.enqueue_updates(w, cs, last, await_dvu=True) for w, cs in keys))
    for key in keys:
        models[key].apply(last)
        sent[key] += 1
    elapsed = time.monotonic() - started
    states = {key: await client.snapshot(*key) for key in keys}
    expected_values = {key: await asyncio.to_thread(models[key].expected) for key in keys}

    print(f"\n{'change set':<10} {'requests':>8} {'refused':>7}   {'DVU: triggers -> runs':<22} "
          f"{'last runs by worker':<20} values")
    wrong: list[str] = []
    for key in keys:
        state, model = states[key], models[key]
        problems = compare(state.nodes, expected_values[key])
        if problems:
            wrong.append(f"{key[0]}.{key[1]}: {problems[:2]}")
        by_worker = Counter(names.get(run.worker[run.worker.rfind(":"):], run.worker) for run in state.dvu_history)
        shown = ", ".join(f"{w}: {n}" for w, n in sorted(by_worker.items()))
        print(f"{key[0]}.{key[1]:<6} {state.change:>8} {model.refused:>7}   "
              f"{state.triggers:>4} -> {state.dvu_runs:<4} {'(hot)' if key in hot else '':<10} {shown:<20} "
              f"{'ok' if not problems else 'WRONG'}")
    show_timeline(max(keys, key=lambda k: states[k].triggers), states, names)

    total = sum(sent.values())
    triggers = sum(s.triggers for s in states.values())
    runs = sum(s.dvu_runs for s in states.values())
    print(f"\n{total} requests for {len(keys)} change sets in {elapsed:.2f}s: {total / elapsed:,.0f} requests/s "
          f"end to end (each answered, plus a DVU awaited per change set); "
          f"{triggers} DVU triggers -> {runs} DVU runs ({triggers / max(runs, 1):.1f} triggers per run)")
    print("\nchecks:")
    checks.check(not mismatched, f"every response was a success or the expected refusal ({len(mismatched)} not)"
                 + (f": {mismatched[:2]}" if mismatched else ""))
    checks.check(all(r.ok and r.dvu_run is not None for r in settled),
                 "each change set's last request came back with the DVU run that covered it")
    checks.check(all(states[k].change == models[k].applied for k in keys),
                 "every applied request is in the stored state, exactly once (change count = requests applied)")
    checks.check(not wrong, "every change set's values equal applying its requests in order and recomputing "
                 "from scratch" + (f"; wrong: {wrong[:2]}" if wrong else ""))
    checks.check(all(not s.dvu_owed for s in states.values()), "no DVU is owed anywhere (no pending roots)")
    checks.check(runs < triggers, f"DVU triggers coalesced: {triggers} triggers ran as {runs} runs")
    used = {names.get(run.worker[run.worker.rfind(":"):]) for s in states.values() for run in s.dvu_history}
    checks.check(used >= set(WORKERS), f"both workers ran change sets ({', '.join(sorted(filter(None, used)))})")


def show_timeline(key: tuple[str, str], states: dict[tuple[str, str], ChangeSetState], names: dict[str, str]) -> None:
    state = states[key]
    runs = state.dvu_history[-12:]
    print(f"\nthe busiest change set, {key[0]}.{key[1]}: its last {len(runs)} DVU runs (each covers every change "
          "applied before it started)")
    origin = runs[0].started if runs else 0.0
    previous = runs[0].covered - runs[0].triggers if runs else 0
    for run in runs:
        worker = names.get(run.worker[run.worker.rfind(":"):], run.worker)
        print(f"  run {run.run:>3} on {worker}: +{run.started - origin:6.3f}s .. +{run.finished - origin:6.3f}s  "
              f"changes {previous + 1:>3}..{run.covered:<3} {run.triggers:>3} trigger(s), "
              f"{run.recomputed:>2} values recomputed")
        previous = run.covered


async def main() -> int:
    checks = Checks()
    started = time.monotonic()
    async with EmbeddedServer() as server:
        print(f"embedded nats-server with JetStream on {server.url}")
        await run(server.url, checks)
    took = time.monotonic() - started
    if checks.failed:
        print(f"\ndemo FAILED {len(checks.failed)} check(s) in {took:.1f}s: " + "; ".join(checks.failed))
        return 1
    print(f"\ndemo passed every check in {took:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
