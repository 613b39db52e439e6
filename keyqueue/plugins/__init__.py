"""Plugins: every hook keyqueue calls (``hookspecs``) and the manager that loads and calls them.

``hookimpl`` marks an implementation; ``PluginManager`` registers the built-in plugins
(``keyqueue.builtins``), the ``keyqueue`` entry-point group and the plugins an ``App`` is given.

May import ``errors`` (and, for type hints only, the modules whose objects hooks receive).
"""

from keyqueue.plugins.manager import (
    BUILTIN_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    ENTRY_POINT_GROUP,
    PluginInfo,
    PluginManager,
    autoload_disabled,
    hookimpl,
    maybe_await,
)

__all__ = [
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "PluginManager",
    "autoload_disabled",
    "hookimpl",
    "maybe_await",
]
