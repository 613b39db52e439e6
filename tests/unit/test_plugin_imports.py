"""keyqueue's own plugins use only its public names, and the events contract has one definition.

Every ``import`` in ``plugins/`` and ``contrib/`` is read with ``ast`` (also those inside
functions and under ``TYPE_CHECKING``): one of a keyqueue module outside
``keyqueue.ext.PUBLIC_MODULES`` fails the test with its file and line. A plugin that needs
something private should get it made public (in ``keyqueue.ext``, documented and tested), not
import it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

import keyqueue
from keyqueue.ext import PUBLIC_MODULES

ROOT: Final = Path(__file__).resolve().parents[2]
PLUGIN_TREES: Final = (ROOT / "plugins", ROOT / "contrib")

CONTRACT: Final = ROOT / "keyqueue" / "events.py"
CONTRACT_NAMES: Final = frozenset({
    "EVENT_NAMES", "EVENT_FIELDS", "EVENT_FIELD_NAMES", "EVENT_MESSAGE_TYPE", "EVENT_VERSION", "EVENT_HEADERS",
    "EventField", "FieldType", "events_stream", "events_subject", "stream_config",
    "ensure_events_stream",
})
"""What :mod:`keyqueue.events` defines, by name: no other module may define these again."""


def sources(*trees: Path) -> Iterator[Path]:
    for tree in trees:
        yield from sorted(path for path in tree.rglob("*.py") if "build" not in path.relative_to(tree).parts)


def keyqueue_imports(source: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for each keyqueue module ``source`` imports, wherever the import is."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "keyqueue":
                # ``from keyqueue import App`` is the public API; ``from keyqueue import core`` a module.
                for alias in node.names:
                    yield node.lineno, "keyqueue" if alias.name in keyqueue.__all__ else f"keyqueue.{alias.name}"
            elif node.module == "keyqueue.wire":
                for alias in node.names:
                    yield node.lineno, "keyqueue.wire.headers" if alias.name == "headers" else node.module
            else:
                yield node.lineno, node.module


def private_imports(path: Path, source: str) -> list[str]:
    """``file:line imports module`` for each import of a keyqueue module that plugins may not use."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for line, module in keyqueue_imports(source)
        if (module == "keyqueue" or module.startswith("keyqueue.")) and module not in PUBLIC_MODULES
    ]


def test_the_plugins_import_only_public_keyqueue_modules() -> None:
    found = [line for path in sources(*PLUGIN_TREES) for line in private_imports(path, path.read_text())]
    assert found == [], "plugins must use keyqueue's public modules only:\n" + "\n".join(found)


def test_the_plugin_trees_are_scanned() -> None:
    scanned = {path.relative_to(ROOT).parts[:2] for path in sources(*PLUGIN_TREES)}
    assert scanned >= {("plugins", "keyqueue_otel"), ("plugins", "keyqueue_spark"), ("contrib", "rebaser")}


@pytest.mark.parametrize(("source", "reported"), [
    ("from keyqueue.jetstream.kv import KeyValue\n", ["keyqueue.jetstream.kv"]),
    ("import keyqueue.core.processor\n", ["keyqueue.core.processor"]),
    ("from keyqueue import core\n", ["keyqueue.core"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from keyqueue.app.worker import Worker\n",
     ["keyqueue.app.worker"]),
    ("def f():\n    from keyqueue.builtins.events import publish\n", ["keyqueue.builtins.events"]),
    ("from keyqueue.wire.codec import dumps\n", ["keyqueue.wire.codec"]),
    ("from keyqueue import App, hookimpl\nimport keyqueue\n", []),
    ("from keyqueue.ext import KeyValue\nfrom keyqueue.events import publish_event\n", []),
    ("from keyqueue.errors import LeaseLost\nfrom keyqueue.wire import CBOR, headers\n", []),
    ("from keyqueue.wire.headers import MSG_ID\nfrom .streams import connect_to\n", []),
])
def test_a_private_import_is_reported_with_its_file_and_line(source: str, reported: list[str]) -> None:
    path = ROOT / "plugins" / "example.py"
    found = private_imports(path, source)
    assert [line.rsplit(" ", 1)[1] for line in found] == reported
    assert all(line.startswith("plugins/example.py:") for line in found)


def contract_definitions(path: Path) -> Iterator[str]:
    """``file:line name`` for each definition of a contract name, and each ``KeyqueueEvent`` literal."""
    where = path.relative_to(ROOT)
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.stmt | ast.expr):  # definitions are statements, literals expressions
            continue
        names: list[str] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Constant) and node.value == "KeyqueueEvent":
            names = ["'KeyqueueEvent'"]
        yield from (f"{where}:{node.lineno} {name}" for name in names if name in CONTRACT_NAMES | {"'KeyqueueEvent'"})


def test_the_events_contract_is_defined_once() -> None:
    others = [path for path in sources(ROOT / "keyqueue", *PLUGIN_TREES) if path != CONTRACT]
    found = [line for path in others for line in contract_definitions(path)]
    assert found == [], "the events contract belongs to keyqueue/events.py only:\n" + "\n".join(found)
    assert {line.rsplit(" ", 1)[1] for line in contract_definitions(CONTRACT)} >= CONTRACT_NAMES
