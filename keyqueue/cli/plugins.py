"""``keyqueue plugins``: the loaded plugins and the hooks each implements."""

from __future__ import annotations

import click

from keyqueue.plugins.manager import PluginManager, autoload_disabled

__all__ = ["plugins"]


@click.command()
def plugins() -> None:
    """List the loaded plugins and the hooks each implements.

    Third-party plugins come from the `keyqueue` entry-point group; set
    KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD=1 to start without them.

    \b
    Example:
      $ keyqueue plugins
    """
    disabled = autoload_disabled()
    manager = PluginManager(autoload=not disabled)
    for info in manager.listing():
        origin = "built-in" if info.builtin else info.distribution or "registered"
        click.echo(f"{info.name} ({origin})")
        click.echo("  " + (", ".join(info.hooks) or "no hooks"))
    if disabled:
        click.echo("(entry-point plugins not loaded: KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD is set)")
