"""keyqueue's public surface: ``keyqueue`` (sorted, complete, nothing but keyqueue's own objects),
and for plugins ``keyqueue.ext`` and ``keyqueue.events``."""

from __future__ import annotations
import __future__

import ast
import importlib
import inspect
import typing
from types import ModuleType

import pytest

import keyqueue
import keyqueue.events
import keyqueue.ext
from keyqueue import errors


def test_all_is_sorted_and_every_name_exists() -> None:
    # As the linter sorts it (RUF022): constants (``UNKEYED``) first, then the rest.
    assert keyqueue.__all__ == sorted(keyqueue.__all__, key=lambda name: (not name.isupper(), name))
    assert len(set(keyqueue.__all__)) == len(keyqueue.__all__)
    for name in keyqueue.__all__:
        assert hasattr(keyqueue, name), name


def test_every_public_name_in_the_package_is_exported() -> None:
    public = {
        name
        for name, value in vars(keyqueue).items()
        if not name.startswith("_") and not inspect.ismodule(value) and not isinstance(value, __future__._Feature)
    }
    assert public == set(keyqueue.__all__)


def test_every_error_is_exported() -> None:
    exported_errors = {name for name in errors.__all__ if name != "from_api_error"}
    assert exported_errors <= set(keyqueue.__all__)


def test_the_api_of_the_issue_is_there() -> None:
    for name in ("App", "Context", "Receipt", "Task", "BatchTask", "task", "hookimpl", "Worker", "KeyProcessor",
                 "BaseProcessor", "RemoteError", "DeadLettered", "Superseded", "Reject"):
        assert name in keyqueue.__all__, name
    objects = [getattr(keyqueue, name) for name in keyqueue.__all__]
    assert all(o.__module__.startswith("keyqueue.") for o in objects if inspect.isclass(o) or inspect.isfunction(o))


def defined_names(module: ModuleType) -> set[str]:
    """The public names a module's own top-level statements define (not the ones it imports)."""
    names: set[str] = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("module", [keyqueue.ext, keyqueue.events], ids=lambda m: m.__name__)
def test_the_extension_modules_list_every_public_name_sorted(module: ModuleType) -> None:
    assert module.__all__ == sorted(module.__all__, key=lambda name: (not name.isupper(), name))
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name
    assert defined_names(module) <= set(module.__all__)


def test_the_extension_api_exports_everything_it_imports() -> None:
    imported = {
        name
        for name, value in vars(keyqueue.ext).items()
        if not name.startswith("_") and not inspect.ismodule(value) and not isinstance(value, __future__._Feature)
        and value is not typing.Final
    }
    assert imported == set(keyqueue.ext.__all__)


def test_the_extension_api_has_what_the_plugins_use() -> None:
    for name in ("connect", "Client", "JetStreamApi", "parse_pub_ack", "KeyValue", "KvEntry", "Publisher",
                 "OutgoingRequest", "Enqueued", "QueueNames", "validate_key", "Topology"):
        assert name in keyqueue.ext.__all__, name
    assert set(keyqueue.ext.PUBLIC_MODULES) >= {"keyqueue", "keyqueue.ext", "keyqueue.events", "keyqueue.errors"}
    for module in keyqueue.ext.PUBLIC_MODULES:
        assert importlib.import_module(module).__doc__, f"{module} documents what it is for"


def test_the_events_contract_names_keyqueues_events_only() -> None:
    fields = keyqueue.events.EVENT_FIELDS
    assert tuple(field.name for field in fields) == keyqueue.events.EVENT_FIELD_NAMES
    assert {field.type for field in fields} == set(typing.get_args(keyqueue.events.FieldType))
    assert keyqueue.events.event_names()[:len(keyqueue.events.EVENT_NAMES)] == keyqueue.events.EVENT_NAMES
    assert not [name for name in keyqueue.events.EVENT_NAMES if "dvu" in name]
