"""The keyqueue plugin: adds ``keyqueue report`` and ``keyqueue backfill`` to the command line.

Registered through the entry-point group ``keyqueue``::

    [project.entry-points.keyqueue]
    spark = "plugins.keyqueue_spark.plugin"

Importing this module imports neither pyspark nor keyqueue.
"""

from __future__ import annotations

import click
import pluggy

hookimpl = pluggy.HookimplMarker("keyqueue")
"""keyqueue's hook marker (``keyqueue.hookimpl``), made here so this module needs no keyqueue import."""


@hookimpl
def keyqueue_add_commands(cli: click.Group) -> None:
    """Add ``report`` and ``backfill``."""
    from plugins.keyqueue_spark.cli import commands

    for command in commands():
        cli.add_command(command)
