"""The getting-started commands keep what the server stores: README.md promises that nothing
accepted is lost, so every `keyqueue dev-server` it and the guides tell a reader to run, and the
one `keyqueue --help` starts with, keeps its store across restarts (`--store-dir`)."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from keyqueue.cli import main

ROOT = Path(__file__).parents[2]
GUIDES = ("README.md", "docs/tutorial.md", "docs/web.md", "docs/dashboard.md")
SHELL_BLOCK = re.compile(r"^```(?:sh|console|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def dev_server_commands(text: str) -> list[str]:
    """The lines of shell blocks that run `keyqueue dev-server` (comments cut off)."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip().removeprefix("$ ")
            if re.search(r"(^|/)keyqueue dev-server\b", command):
                found.append(command)
    return found


def test_every_dev_server_the_guides_start_keeps_its_store() -> None:
    commands = {doc: dev_server_commands((ROOT / doc).read_text()) for doc in GUIDES}
    assert commands["README.md"] and commands["docs/tutorial.md"], "the guides start a server"
    for doc, lines in commands.items():
        for command in lines:
            assert "--store-dir" in command, f"{doc}: {command!r} deletes every stored request when it stops"


def test_the_command_lines_help_starts_a_server_that_keeps_its_store() -> None:
    shown = CliRunner().invoke(main, ["--help"]).output
    assert re.search(r"keyqueue dev-server --store-dir \S+", shown), shown
