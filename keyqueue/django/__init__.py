"""keyqueue in a Django project, in two forms (docs/web.md, "Django"; needs ``keyqueue[django]``).

keyqueue's own API, with its settings in Django's::

    # mysite/kq.py
    import keyqueue
    from keyqueue.django import django_settings

    app = keyqueue.App("shop", settings=django_settings, result_ttl=3600)   # KEYQUEUE_URL etc. read lazily

    # shop/tasks.py: @app.task(key="{order_id}") ...; in a view: charge.delay_on_commit(order_id=...)

A backend of Django's own Tasks framework (``django.tasks``, or the ``django_tasks`` backport before
Django 6)::

    TASKS = {"default": {"BACKEND": "keyqueue.django.backend.KeyqueueBackend"}}

    @task(key="{order_id}")                       # keyqueue's key=, through Django 6.1's @task(**kwargs)
    def charge(order_id: str, amount: int) -> dict: ...

Either way ``keyqueue worker`` serves the tasks: with ``DJANGO_SETTINGS_MODULE`` set it sets Django up
and imports each installed app's ``tasks`` module first (``keyqueue.app.loading``).
``keyqueue worker keyqueue.django`` serves the default backend's tasks (``app`` below), and a
backend given ``OPTIONS={"APP": "mysite.kq:app"}`` registers them on that app, so one worker
serves both forms.

This package sits above ``app`` and beside the command line; nothing in keyqueue imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from keyqueue.errors import ConfigError
from keyqueue.settings import Settings

__all__ = ["django_settings", "keyqueue_settings"]

_PREFIX = "KEYQUEUE_"


def keyqueue_settings(django_conf: Any, environ: Mapping[str, str] | None = None) -> Settings:
    """``Settings`` from a Django settings object's ``KEYQUEUE_*`` attributes (``KEYQUEUE_URL``,
    ``KEYQUEUE_CREDS``, ... : the names of the environment variables); each one the settings do not
    set is read from the environment (``environ``, default ``os.environ``)."""
    env = dict(os.environ if environ is None else environ)
    for name in dir(django_conf):
        if name.startswith(_PREFIX) and name.isupper():
            value = getattr(django_conf, name)
            if value is None:
                env.pop(name, None)
            else:
                env[name] = str(value)
    try:
        return Settings.from_env(env)
    except ConfigError as exc:
        message = str(exc).replace(f" (from {_PREFIX}* environment variables)", "")
        raise ConfigError(f"{message} (from Django's {_PREFIX}* settings or the environment)") from None


def django_settings() -> Settings:
    """The app's ``Settings`` from Django's settings (``KEYQUEUE_URL`` ...), then the environment.

    Give it to ``keyqueue.App(..., settings=django_settings)``: the app calls it when it first
    needs to connect, after Django has loaded its settings, not where the app is declared."""
    try:
        from django.conf import settings
    except ImportError:
        raise ConfigError("keyqueue.django needs Django: pip install 'keyqueue[django]'") from None
    return keyqueue_settings(settings)


def __getattr__(name: str) -> Any:
    """``app``: the keyqueue app of the default Tasks backend (``keyqueue worker keyqueue.django``)."""
    if name == "app":
        from keyqueue.django.backend import default_backend_app

        return default_backend_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
