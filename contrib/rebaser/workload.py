"""A reproducible random workload for one change set, with its reference answer.

:class:`ChangeSetModel` applies requests sequentially in memory, exactly as a single holder
would, and :meth:`ChangeSetModel.expected` recomputes every value from scratch. The demo and
the tests send the same requests to the Rebaser and compare what it stored with this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .functions import FunctionRegistry, load_functions
from .graph import Node, UpdateError, apply_updates, full_recompute
from .messages import Update

__all__ = ["ChangeSetModel", "compare", "setup_updates"]

INPUTS = ("in0", "in1", "in2", "in3", "in4", "in5")


def setup_updates() -> list[Update]:
    """A first request: six inputs and a few computed nodes using every built-in function."""
    return [
        *(Update.add_node(name, i + 1) for i, name in enumerate(INPUTS)),
        Update.add_node("total"),
        Update.add_dependency("total", "sum", ["in0", "in1", "in2"]),
        Update.add_node("high"),
        Update.add_dependency("high", "max", ["in3", "in4", "in5"]),
        Update.add_node("low"),
        Update.add_dependency("low", "min", ["in0", "in3"]),
        Update.add_node("label"),
        Update.add_dependency("label", "template", ["total", "high"], {"text": "total={0} high={1}"}),
        Update.add_node("tag"),
        Update.add_dependency("tag", "concat", ["label", "low"], {"sep": "/"}),
        Update.add_node("echo"),
        Update.add_dependency("echo", "identity", ["tag"]),
        Update.add_node("grand"),
        Update.add_dependency("grand", "sum", ["total", "high", "low"]),
    ]


@dataclass
class ChangeSetModel:
    """One change set applied sequentially in memory: the reference the Rebaser must match."""

    functions: FunctionRegistry = field(default_factory=load_functions)
    nodes: dict[str, Node] = field(default_factory=dict)
    applied: int = 0
    refused: int = 0
    extra: int = 0

    def apply(self, updates: list[Update]) -> bool:
        """Apply one request; False if the Rebaser must refuse it (then nothing changes)."""
        try:
            self.nodes, _ = apply_updates(self.nodes, updates, self.applied + 1, self.functions)
        except UpdateError:
            self.refused += 1
            return False
        self.applied += 1
        return True

    def expected(self) -> dict[str, tuple[Any, str | None]]:
        """Every node's value and error, recomputed from scratch."""
        return {name: (node.value, node.error) for name, node in sorted(full_recompute(self.nodes,
                                                                                         self.functions).items())}

    def random_request(self, rng: random.Random) -> list[Update]:
        """One to three updates, mostly new input values, sometimes structure changes or a mistake."""
        updates: list[Update] = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            roll = rng.random()
            plain = [name for name, node in self.nodes.items() if not node.computed]
            if roll < 0.70 and plain:
                value: Any = rng.randint(-50, 50) if rng.random() < 0.98 else "oops"  # a string breaks sum/min/max
                updates.append(Update.set_value(rng.choice(plain), value))
            elif roll < 0.82:
                self.extra += 1
                name = f"x{self.extra}"
                sources = rng.sample(sorted(self.nodes), k=min(len(self.nodes), rng.randint(1, 3)))
                function = rng.choice(("sum", "max", "min", "concat"))
                updates += [Update.add_node(name, 0), Update.add_dependency(name, function, sources)]
            elif roll < 0.90:
                leaves = sorted(name for name in self.nodes if name.startswith("x")
                                and not any(name in other.inputs for other in self.nodes.values()))
                if leaves:
                    updates.append(Update.remove_node(rng.choice(leaves)))
            elif roll < 0.97:
                extras = sorted(name for name, node in self.nodes.items() if name.startswith("x") and node.computed)
                if extras:
                    updates.append(Update.remove_dependency(rng.choice(extras)))
            else:
                # A mistake the Rebaser must refuse: a cycle, or an unknown node.
                updates.append(rng.choice((Update.add_dependency("in0", "identity", ["grand"]),
                                           Update.set_value("missing", 1))))
        return updates or [Update.set_value("in0", rng.randint(0, 9))]


def compare(stored: dict[str, Node], expected: dict[str, tuple[Any, str | None]]) -> list[str]:
    """Differences between a stored graph and the reference answer (empty when they agree)."""
    problems = []
    for name in sorted(set(stored) | set(expected)):
        if name not in stored:
            problems.append(f"{name}: missing")
        elif name not in expected:
            problems.append(f"{name}: unexpected node")
        elif (stored[name].value, stored[name].error) != expected[name]:
            problems.append(f"{name}: stored {stored[name].value!r} (error {stored[name].error!r}), "
                            f"expected {expected[name][0]!r} (error {expected[name][1]!r})")
    return problems
