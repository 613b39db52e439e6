"""``keyqueue``'s public surface: sorted, complete, and nothing but keyqueue's own objects."""

from __future__ import annotations
import __future__

import inspect

import keyqueue
from keyqueue import errors


def test_all_is_sorted_and_every_name_exists() -> None:
    assert keyqueue.__all__ == sorted(keyqueue.__all__)
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
