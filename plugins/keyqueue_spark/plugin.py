"""The keyqueue plugin: adds ``keyqueue report`` and ``keyqueue backfill`` to the command line.

Registered through the entry-point group ``keyqueue`` (this folder's pyproject.toml)::

    [project.entry-points.keyqueue]
    spark = "keyqueue_spark.plugin"

Importing this module does not import pyspark.
"""

from __future__ import annotations

import click

from keyqueue import hookimpl


@hookimpl
def keyqueue_add_commands(cli: click.Group) -> None:
    """Add ``report`` and ``backfill``."""
    from .cli import commands

    for command in commands():
        cli.add_command(command)
