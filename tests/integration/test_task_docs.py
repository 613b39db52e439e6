"""The docs' ``python`` blocks are complete programs: each runs against a real nats-server.

Blocks fenced as ``py`` are fragments and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ("docs/tutorial.md", "docs/plugins.md", "docs/web.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for number, match in enumerate(BLOCK.finditer((ROOT / doc).read_text()), start=1):
            found.append((f"{Path(doc).stem}-{number}", match.group(1)))
    return found


@pytest.mark.parametrize(("name", "code"), blocks(), ids=[name for name, _ in blocks()])
def test_the_snippet_runs(name: str, code: str, nats_url: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name.replace('-', '_')}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_URL=nats_url, KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the snippet prints what it shows"
