"""Draw one burst and its DVU runs: ``python -m examples.rebaser.timeline`` (needs matplotlib).

A worker runs in this process with a Rebaser whose ``digest`` takes 0.25 s, so each DVU is slow.
One change set gets 60 requests, about one every 20 ms. The Rebaser's observer records when
each request was applied and when each DVU run started and finished; the picture shows the
requests landing while runs are going, and each run covering every request applied before it
started. It writes ``docs/images/rebaser-dvu-timeline.png`` and prints the same as text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import keyqueue
from keyqueue.server.embedded import EmbeddedServer
from keyqueue_rebaser import FunctionRegistry, RebaserClient, RebaserPlugin, Update, hookimpl, load_functions

OUT = Path(__file__).resolve().parents[2] / "docs" / "images" / "rebaser-dvu-timeline.png"
REQUESTS, SPACING, DIGEST = 60, 0.02, 0.25


class SlowDigest:
    @hookimpl
    def rebaser_register_functions(self, functions: FunctionRegistry) -> None:
        def digest(inputs: Sequence[Any], args: Mapping[str, Any]) -> Any:
            time.sleep(DIGEST)
            return sum(inputs)

        functions.register("digest", digest)


async def record(url: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    plugin = RebaserPlugin(functions=load_functions([SlowDigest()], autoload=False),
                           observer=lambda event, fields: events.append((event, fields)))
    app = keyqueue.App("timeline", url=url, plugins=[plugin], autoload_plugins=False, set_as_default=False)
    async with app, app.worker(linger=0.5), await RebaserClient.connect(url) as client:
        graph = [Update.add_node("a", 0), Update.add_node("b", 0), Update.add_node("d"),
                 Update.add_dependency("d", "digest", ["a", "b"])]
        await client.enqueue_updates("w", "cs", graph, await_dvu=True)
        events.clear()
        for i in range(1, REQUESTS + 1):
            last = i == REQUESTS  # waits for the DVU run that covers it, hence the whole burst
            await client.enqueue_updates("w", "cs", [Update.set_value("a" if i % 2 else "b", i)], wait=last,
                                         await_dvu=last)
            await asyncio.sleep(SPACING)
    return events


def draw(events: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(f["t"] for _, f in events)
    applied = [(f["t"] - origin, f["change"]) for e, f in events if e == "applied"]
    started = {f["run"]: (f["t"] - origin, f) for e, f in events if e == "dvu_started"}
    finished = {f["run"]: (f["t"] - origin, f) for e, f in events if e == "dvu_finished"}
    runs = sorted(set(started) & set(finished))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.scatter([t for t, _ in applied], [1.0] * len(applied), marker="|", s=300, color="tab:blue",
               label=f"request applied ({len(applied)})")
    for n, run in enumerate(runs):
        t0, _ = started[run]
        t1, done = finished[run]
        ax.barh(0.35, t1 - t0, left=t0, height=0.3, color=("tab:orange", "tab:red")[n % 2], edgecolor="black")
        ax.text(t0 + (t1 - t0) / 2, 0.35, f"run {run}\n{done['triggers']} triggers", ha="center", va="center",
                fontsize=8)
    ax.set_yticks([0.35, 1.0], ["DVU runs", "requests"])
    ax.set_ylim(0, 1.4)
    ax.set_xlabel("seconds")
    triggers = sum(finished[r][1]["triggers"] for r in runs)
    ax.set_title(f"One change set: {len(applied)} requests in a burst, {triggers} DVU triggers -> {len(runs)} "
                 f"runs (each DVU takes ~{DIGEST}s)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")
    for run in runs:
        t0, _ = started[run]
        t1, done = finished[run]
        covered = [c for t, c in applied if t <= t0]
        print(f"run {run}: {t0:5.2f}s .. {t1:5.2f}s  absorbs {done['triggers']:>2} trigger(s), values current through "
              f"change {done['covered']}  ({len(covered)} requests applied before it started)")


async def main() -> None:
    async with EmbeddedServer() as server:
        events = await record(server.url)
    draw(events)


if __name__ == "__main__":
    asyncio.run(main())
