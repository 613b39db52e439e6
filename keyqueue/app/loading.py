"""Finding an application by name: ``MODULE:APP``, as ``keyqueue worker`` and plugin commands take it."""

from __future__ import annotations

import importlib
import os
import sys

from keyqueue.app.application import App, default_app
from keyqueue.errors import ConfigError

__all__ = ["load_app"]


def load_app(spec: str, url: str | None = None) -> App:
    """The ``App`` named by ``MODULE:APP`` (``MODULE`` alone: its ``app``), with ``url`` if given.

    The current directory is importable, as with ``python -m``.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or (spec.count(":") > 1):
        raise ConfigError(f"{spec!r} is not MODULE:APP (for example shop:app for `app` in shop.py, "
                          "or shop.tasks:app in a package)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(f"cannot import {module_name!r}: no module named {exc.name!r} "
                              f"(looked in {os.getcwd()} and the installed packages)") from None
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc} "
                          f"(python -c 'import {module_name}' shows the traceback)") from None
    if attribute:
        if not hasattr(module, attribute):
            raise ConfigError(f"module {module_name!r} has no attribute {attribute!r}")
        app = getattr(module, attribute)
    else:
        app = getattr(module, "app", None)
        if app is None:
            app = default_app()
    if not isinstance(app, App):
        raise ConfigError(f"{spec} is a {type(app).__name__}, not a keyqueue.App")
    if url is not None:
        app.settings = app.settings.with_url(url)
    return app
