"""Finding an application by name: ``MODULE:APP``, as ``keyqueue worker`` and plugin commands take it.

In a Django project (``DJANGO_SETTINGS_MODULE`` set, as ``manage.py`` and ``wsgi.py`` set it) Django
is set up first and each installed app's ``tasks`` module imported, as a web process would have
them: a tasks module may then import models, and every app's tasks are registered before the
worker serves (docs/web.md, "Django").
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Final

from keyqueue.app.application import App, default_app
from keyqueue.errors import ConfigError

__all__ = ["DJANGO_SETTINGS", "load_app", "setup_django"]

DJANGO_SETTINGS: Final = "DJANGO_SETTINGS_MODULE"
"""The environment variable naming a Django project's settings module: when set, ``load_app`` sets Django up."""


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
    setup_django()
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


def setup_django() -> bool:
    """When ``DJANGO_SETTINGS_MODULE`` is set: ``django.setup()``, then import every installed app's
    ``tasks`` module (Django's own ``autodiscover_modules``, as the admin finds ``admin`` modules).
    Whether Django was set up; ``ConfigError`` saying why it could not be."""
    settings_module = os.environ.get(DJANGO_SETTINGS)
    if not settings_module:
        return False
    try:
        import django
        from django.utils.module_loading import autodiscover_modules
    except ImportError:
        raise ConfigError(f"{DJANGO_SETTINGS}={settings_module} is set, but Django is not installed: "
                          "pip install 'keyqueue[django]', or unset the variable") from None
    try:
        django.setup()
        autodiscover_modules("tasks")
    except Exception as exc:
        raise ConfigError(f"setting up Django ({DJANGO_SETTINGS}={settings_module}) failed: {type(exc).__name__}: "
                          f"{exc} (django-admin check shows the traceback)") from None
    logging.getLogger("keyqueue.app").info("Django set up (%s=%s); each installed app's tasks module imported",
                                           DJANGO_SETTINGS, settings_module)
    return True
