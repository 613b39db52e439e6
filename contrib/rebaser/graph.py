"""A change set's graph of attribute values, the updates that change it, and the DVU computation.

A *node* has a value. A node may also be *computed*: it names a function and input nodes, and its
value is ``function(values of the inputs, args)``. The edges "input -> computed node" form a DAG:
an update that would close a cycle is refused, so a cycle can only come from a stored snapshot
written by something else, and the DVU then reports it instead of looping.

Updates are applied all or nothing (:func:`apply_updates`); each node an update touches becomes a
*dependent-value root*. A DVU (:func:`recompute`) recomputes every computed node downstream of
the roots, in topological order. A function that raises leaves its node with value ``None`` and
an error, and the nodes downstream see that ``None``; nothing here ever raises because of a
function.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .functions import FunctionRegistry
from .messages import Update

__all__ = ["Node", "Recomputed", "UpdateError", "apply_updates", "dependents", "full_recompute", "recompute"]


@dataclass(frozen=True)
class Node:
    """One attribute value, as stored in the snapshot."""

    value: Any = None
    function: str | None = None
    """Set for a computed node: the function of its inputs that gives its value."""
    inputs: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    stamp: int = 0
    """The change number of the last update that touched this node (not a DVU)."""
    error: str | None = None
    """Why the last DVU could not compute the value (it is then ``None``)."""

    @property
    def computed(self) -> bool:
        return self.function is not None


class UpdateError(Exception):
    """An update cannot be applied; the whole request is refused and nothing changes."""

    def __init__(self, index: int, update: Update, reason: str) -> None:
        self.index, self.update, self.reason = index, update, reason
        super().__init__(f"update {index} ({update.describe()}): {reason}")


def dependents(nodes: Mapping[str, Node]) -> dict[str, list[str]]:
    """For each node, the computed nodes that take it as an input (in name order)."""
    out: dict[str, list[str]] = {}
    for name in sorted(nodes):
        for source in dict.fromkeys(nodes[name].inputs):
            out.setdefault(source, []).append(name)
    return out


def _reaches(nodes: Mapping[str, Node], start: Iterable[str], target: str) -> list[str] | None:
    """A path of inputs from one of ``start`` up to ``target`` (following inputs), or None."""
    parents: dict[str, str | None] = {}
    queue: deque[str] = deque()
    for name in start:
        if name not in parents:
            parents[name] = None
            queue.append(name)
    while queue:
        name = queue.popleft()
        if name == target:
            path = [name]
            while (parent := parents[path[-1]]) is not None:
                path.append(parent)
            return path
        node = nodes.get(name)
        for source in node.inputs if node else ():
            if source not in parents:
                parents[source] = name
                queue.append(source)
    return None


def apply_updates(nodes: Mapping[str, Node], updates: Sequence[Update], change: int,
                  functions: FunctionRegistry) -> tuple[dict[str, Node], set[str]]:
    """Apply ``updates`` in order as change number ``change``: the new nodes and the roots they make.

    All or nothing: the first update that cannot apply raises :class:`UpdateError` and ``nodes``
    is untouched (it is never modified in place).
    """
    result = dict(nodes)
    roots: set[str] = set()
    for index, update in enumerate(updates):
        name = update.node
        node = result.get(name)

        def refuse(reason: str, index: int = index, update: Update = update) -> UpdateError:
            return UpdateError(index, update, reason)

        if update.op == "add_node":
            if node is not None:
                raise refuse("the node already exists")
            result[name] = Node(value=update.value, stamp=change)
        elif node is None:
            raise refuse("no such node")
        elif update.op == "set_value":
            if node.computed:
                raise refuse(f"the node is computed by {node.function}; remove its dependency to set its value")
            result[name] = replace(node, value=update.value, stamp=change, error=None)
        elif update.op == "remove_node":
            users = sorted(n for n, other in result.items() if name in other.inputs and n != name)
            if users:
                raise refuse(f"nodes {', '.join(users)} depend on it; remove their dependencies first")
            del result[name]
            roots.discard(name)
            continue
        elif update.op == "add_dependency":
            if update.function not in functions:
                raise refuse(f"unknown function {update.function!r}; known: {', '.join(functions.names())}")
            missing = [source for source in update.inputs if source not in result]
            if missing:
                raise refuse(f"no such input node(s): {', '.join(missing)}")
            cycle = _reaches(result, update.inputs, name)
            if cycle is not None:
                path = " -> ".join([name, *reversed(cycle)])
                raise refuse(f"it would create a cycle: {path} (each depends on the next)")
            result[name] = replace(node, function=update.function, inputs=list(update.inputs),
                                   args=dict(update.args), stamp=change)
        elif update.op == "remove_dependency":
            if not node.computed:
                raise refuse("the node has no dependency")
            # The node's value becomes the update's, not whatever the last DVU computed: the outcome
            # of a request must not depend on when DVUs happened to run.
            result[name] = replace(node, value=update.value, function=None, inputs=[], args={}, stamp=change,
                                   error=None)
        roots.add(name)
    return result, roots


@dataclass(frozen=True)
class Recomputed:
    """What one DVU computed: new ``(value, error)`` per computed node, in the order computed."""

    values: dict[str, tuple[Any, str | None]]
    affected: int
    """Nodes downstream of the roots (roots included)."""
    errors: list[str]
    """One line per node whose function failed, and one per cycle found."""


def recompute(nodes: Mapping[str, Node], roots: Iterable[str], functions: FunctionRegistry) -> Recomputed:
    """Recompute every computed node downstream of ``roots`` (roots included), in topological order."""
    users = dependents(nodes)
    affected: set[str] = set()
    queue = deque(root for root in roots if root in nodes)
    while queue:
        name = queue.popleft()
        if name in affected:
            continue
        affected.add(name)
        queue.extend(users.get(name, ()))
    # Kahn's algorithm on the affected nodes: a node is ready once its affected inputs are done.
    waiting = {name: len({s for s in nodes[name].inputs if s in affected}) for name in affected}
    ready = deque(sorted(name for name, count in waiting.items() if count == 0))
    values: dict[str, tuple[Any, str | None]] = {}
    errors: list[str] = []
    done: set[str] = set()
    while ready:
        name = ready.popleft()
        done.add(name)
        node = nodes[name]
        if node.function is not None:
            values[name] = _evaluate(name, node, nodes, values, functions)
            if values[name][1] is not None:
                errors.append(f"{name}: {values[name][1]}")
        for user in users.get(name, ()):
            if user in affected:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
    stuck = sorted(affected - done)
    if stuck:
        errors.append(f"cycle: {', '.join(stuck)} depend on each other and were not recomputed")
    return Recomputed(values, len(affected), errors)


def full_recompute(nodes: Mapping[str, Node], functions: FunctionRegistry) -> dict[str, Node]:
    """Every node with every computed value recomputed from scratch (the DVU's reference answer)."""
    result = recompute(nodes, list(nodes), functions)
    out = dict(nodes)
    for name, (value, error) in result.values.items():
        out[name] = replace(out[name], value=value, error=error)
    return out


def _evaluate(name: str, node: Node, nodes: Mapping[str, Node], fresh: Mapping[str, tuple[Any, str | None]],
              functions: FunctionRegistry) -> tuple[Any, str | None]:
    try:
        missing = [source for source in node.inputs if source not in nodes]
        if missing:
            raise LookupError(f"no such input node(s): {', '.join(missing)}")
        inputs = [fresh[source][0] if source in fresh else nodes[source].value for source in node.inputs]
        fn = functions.get(node.function or "")
        return fn(inputs, node.args), None
    except Exception as e:
        return None, f"{node.function}: {type(e).__name__}: {e}"
