"""The import directions between keyqueue's packages: a package imports only from the layers below it.

Each package's ``__init__`` docstring says what it may import; ``LAYERS`` is the order those
docstrings describe. Every ``import`` in every module under ``keyqueue/`` is read with ``ast``
(also those inside functions and under ``TYPE_CHECKING``): one that reaches a package of its own
layer or a higher one fails the test, unless one of the two exceptions below allows it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[2] / "keyqueue"
"""The source tree, read as text: the rules hold whether or not the modules import cleanly."""

LAYERS: Final = (
    ("errors",),
    ("settings",),
    ("wire",),
    ("jetstream", "server"),  # NATS from the client side; nats-server processes (errors only)
    ("core",),
    ("tasks",),
    ("plugins",),
    ("app",),
    ("events",),  # the public lifecycle events contract, which the built-in events plugin publishes
    ("builtins", "admin", "metrics"),  # metrics: Prometheus instruments and the plugin counting into them
    ("ext",),  # the public extension API: the layers below, as plugins may build on them
    ("dashboard",),  # keyqueue dashboard: the web app over admin, metrics and the events
    ("cli", "testing", "chaos", "django"),  # django: keyqueue in a Django project, and Django's Tasks backend
    ("keyqueue", "__main__"),  # the public API in keyqueue/__init__.py, and python -m keyqueue
)
"""keyqueue's packages (and top-level modules), lowest first; packages of one layer are independent."""

TYPE_HINTS_FROM_ABOVE: Final = ("keyqueue.plugins", "keyqueue.builtins")
"""Packages whose ``TYPE_CHECKING`` imports may reach any layer: the hooks they declare, call or
implement receive objects made above them (an ``App``, a ``Worker``)."""

COMMANDS_FROM_ABOVE: Final = frozenset({("builtins", "cli")})
"""``(importer, imported)`` packages allowed inside a function: a built-in plugin's
``keyqueue_add_commands`` imports its command from the CLI, which is what calls that hook."""


@dataclass(frozen=True)
class Import:
    """One import of a keyqueue module by a keyqueue module."""

    module: str
    target: str
    line: int
    type_only: bool
    """Under ``if TYPE_CHECKING:``."""
    lazy: bool
    """Inside a function, so it runs when the function is called rather than on import."""

    def __str__(self) -> str:
        where = " (under TYPE_CHECKING)" if self.type_only else " (inside a function)" if self.lazy else ""
        return f"{self.module}:{self.line} imports {self.target}{where}"


def package_of(module: str) -> str:
    """``keyqueue.tasks.task`` -> ``tasks``; ``keyqueue.errors`` -> ``errors``; ``keyqueue`` -> ``keyqueue``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(package: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if package in layer), None)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _scan(nodes: Iterable[ast.AST], type_only: bool, lazy: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only, lazy
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _scan(node.body, True, lazy)
            yield from _scan(node.orelse, type_only, lazy)
        else:
            inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _scan(ast.iter_child_nodes(node), type_only, inner)


def _targets(module: str, is_package: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*parts, *([base] if base else [])])
    if base == "keyqueue":  # ``from keyqueue import wire`` imports a package; ``import App`` the façade
        return [f"keyqueue.{a.name}" if layer_of(a.name) is not None else base for a in node.names]
    return [base]


def imports(module: str, source: str, *, is_package: bool = False) -> list[Import]:
    """The keyqueue modules that ``module`` (whose code is ``source``) imports."""
    found = []
    for node, type_only, lazy in _scan(ast.parse(source).body, False, False):
        for target in _targets(module, is_package, node):
            if target == "keyqueue" or target.startswith("keyqueue."):
                found.append(Import(module, target, getattr(node, "lineno", 0), type_only, lazy))
    return found


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """Why each of ``module``'s imports breaks the layering (nothing if none does)."""
    found = []
    for imp in imports(module, source, is_package=is_package):
        importer, imported = package_of(imp.module), package_of(imp.target)
        low, high = layer_of(imported), layer_of(importer)
        if importer == imported or low is None or high is None or low < high:
            continue  # an unlisted package is test_every_package_has_a_layer's failure
        if imp.type_only and any(imp.module == m or imp.module.startswith(m + ".") for m in TYPE_HINTS_FROM_ABOVE):
            continue
        if imp.lazy and (importer, imported) in COMMANDS_FROM_ABOVE:
            continue
        found.append(f"{imp}: {importer} (layer {high}) may import only from layers below it, "
                     f"and {imported} is layer {low}")
    return found


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def test_every_package_has_a_layer() -> None:
    unplaced = sorted({package_of(module) for module, _ in _modules() if layer_of(package_of(module)) is None})
    assert not unplaced, f"packages in no layer of LAYERS (add each where it belongs): {unplaced}"


def test_every_module_imports_only_from_the_layers_below() -> None:
    found = [
        v for module, path in _modules()
        for v in violations(module, path.read_text(encoding="utf-8"), is_package=path.name == "__init__.py")
    ]
    assert not found, "imports against the layering:\n" + "\n".join(found)


# --- what a package's docstring says it may import --------------------------------------------------

STATED: Final = ("core", "jetstream")
"""Packages whose ``__init__`` docstring has a ``May import ...`` sentence naming, in double
backquotes, every keyqueue package and every distribution outside the standard library that
the package imports: held to it exactly, stricter than the layer order (core is below tasks,
plugins and the app, and needs none of the layer's other packages either)."""

MAY_IMPORT: Final = re.compile(r"May import (.*?)\.(?:\s|$)", re.S)
"""The sentence, up to its full stop."""


def stated(package: str) -> tuple[set[str], set[str]]:
    """The keyqueue packages and the other distributions ``package``'s docstring says it may import."""
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8"))) or ""
    match = MAY_IMPORT.search(doc)
    assert match is not None, f"keyqueue/{package}/__init__.py's docstring has no 'May import ...' sentence"
    names = set(re.findall(r"``([\w.]+)``", match.group(1)))
    return {n for n in names if layer_of(n) is not None}, {n for n in names if layer_of(n) is None}


def outside_imports(source: str) -> set[str]:
    """The top-level names of the modules ``source`` imports from outside keyqueue and the standard library."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name != "keyqueue" and name not in sys.stdlib_module_names}


@pytest.mark.parametrize("package", STATED)
def test_a_package_imports_only_what_its_docstring_states(package: str) -> None:
    packages, outside = stated(package)
    assert packages, f"{package}'s docstring names no keyqueue package it may import"
    below = {p for p in packages if (layer_of(p) or 0) < (layer_of(package) or 0)}
    assert packages == below, f"{package}'s docstring allows packages that are not below it: {packages - below}"
    found = []
    for module, path in _modules():
        if package_of(module) != package:
            continue
        source = path.read_text(encoding="utf-8")
        found += [f"{imp}, and {package}'s docstring allows only {sorted(packages)}"
                  for imp in imports(module, source, is_package=path.name == "__init__.py")
                  if package_of(imp.target) not in {package, *packages}]
        found += [f"{module} imports {name}, and {package}'s docstring allows only {sorted(outside)} "
                  "outside the standard library" for name in sorted(outside_imports(source) - outside)]
    assert not found, "imports against the package's docstring:\n" + "\n".join(found)


def test_the_core_stays_below_tasks_plugins_the_app_and_the_tools() -> None:
    packages, outside = stated("core")
    assert packages.isdisjoint({"tasks", "plugins", "app", "builtins", "cli", "dashboard", "admin", "chaos"})
    assert outside == {"nats"}
    assert stated("jetstream") == ({"wire", "errors"}, {"nats"})


TASK_MODULE: Final = ROOT / "tasks" / "task.py"


@pytest.mark.parametrize(("module", "source", "is_package"), [
    ("keyqueue.tasks.task", TASK_MODULE.read_text(encoding="utf-8") + "\nfrom keyqueue.app import App\n", False),
    ("keyqueue.tasks.task", "if TYPE_CHECKING:\n    from keyqueue.app.application import App\n", False),
    ("keyqueue.tasks.task", "if typing.TYPE_CHECKING:\n    pass\nelse:\n    import keyqueue.app\n", False),
    ("keyqueue.tasks.task", "def f():\n    from keyqueue.app.application import App\n", False),
    ("keyqueue.tasks.task", "from ..app import application\n", False),
    ("keyqueue.tasks", "from ..app.worker import Worker\n", True),
    ("keyqueue.core.session", "from keyqueue import tasks\n", False),
    ("keyqueue.wire.codec", "from keyqueue import App\n", False),
    ("keyqueue.jetstream.api", "from keyqueue.server.embedded import EmbeddedServer\n", False),
    ("keyqueue.plugins.hookspecs", "from keyqueue.app.application import App\n", False),
    ("keyqueue.builtins.events", "from keyqueue.cli.events import events\n", False),
    ("keyqueue.events", "from keyqueue.builtins.events import PUBLISHER\n", False),
])
def test_an_import_from_a_layer_above_is_reported(module: str, source: str, is_package: bool) -> None:
    [found] = violations(module, source, is_package=is_package)
    assert found.startswith(f"{module}:")
    assert " imports keyqueue" in found


@pytest.mark.parametrize(("module", "source"), [
    ("keyqueue.app.application", "from keyqueue.tasks.task import Task\nimport keyqueue.wire.headers as H\n"),
    ("keyqueue.tasks.task", "from keyqueue.tasks.arguments import KeyMaker\nfrom . import context\n"),
    ("keyqueue.plugins.hookspecs", "if TYPE_CHECKING:\n    from keyqueue.app.application import App\n"),
    ("keyqueue.builtins.events", "if TYPE_CHECKING:\n    from keyqueue.testing import EagerRunner\n"),
    ("keyqueue.builtins.events", "def keyqueue_add_commands(cli):\n    from keyqueue.cli.events import events\n"),
    ("keyqueue.ext", "from keyqueue.builtins.events import EVENT_NAMES\n"),
    ("keyqueue.builtins.events", "from keyqueue.events import EVENT_HEADERS\n"),
])
def test_an_import_from_below_or_an_allowed_exception_is_not(module: str, source: str) -> None:
    assert violations(module, source) == []
