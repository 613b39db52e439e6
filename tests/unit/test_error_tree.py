"""The exception tree drawn in ``keyqueue/errors.py``'s docstring is the real class hierarchy.

The drawing is what a reader catches by: a class drawn under the wrong parent (``CallOnOwnKey``
under ``Retry`` while the code makes it a ``Reject``) tells them a retry will come when none does.
The drawing is parsed here and compared with the classes, so the two cannot drift apart.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Final

from keyqueue import errors

BRANCH: Final = re.compile(r"(?P<rails>(?:│   |    )*)(?P<joint>[├└])── (?P<name>\w+)(?P<note>.*)")
"""A drawn class below the root: the rails of its ancestors, its own joint, its name, what it is."""


@dataclass(frozen=True)
class Drawn:
    """One class as the drawing shows it."""

    name: str
    parent: str | None
    note: str
    last: bool
    """Drawn with ``└──``: the last child of its parent."""


def parse(docstring: str) -> list[Drawn]:
    """The drawing in ``docstring``: its first indented block, a root and ``├──`` / ``└──`` branches."""
    lines = docstring.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    ") and line.strip())
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    root, *branches = [line[4:] for line in lines[start:end]]
    drawn = [Drawn(root.split()[0], None, root[len(root.split()[0]):].strip(), True)]
    path = [drawn[0].name]
    for line in branches:
        match = BRANCH.fullmatch(line)
        assert match is not None, f"not a branch of the drawing: {line!r}"
        depth = len(match["rails"]) // 4 + 1
        assert depth <= len(path), f"{match['name']} is drawn below no parent"
        del path[depth:]
        drawn.append(Drawn(match["name"], path[-1], match["note"].strip(), match["joint"] == "└"))
        path.append(match["name"])
    return drawn


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class ``keyqueue.errors`` defines."""
    return {
        name: cls for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, errors.KeyqueueError) and cls.__module__ == errors.__name__
    }


def mismatches(drawing: list[Drawn], classes: dict[str, type[BaseException]]) -> list[str]:
    """Where the drawing and the classes disagree (nothing if they agree)."""
    found = []
    names = [d.name for d in drawing]
    found += [f"{name} is drawn twice" for name in sorted({n for n in names if names.count(n) > 1})]
    found += [f"{name} is not drawn" for name in sorted(set(classes) - set(names))]
    found += [f"{name} is drawn but not defined" for name in sorted(set(names) - set(classes))]
    for d in drawing:
        cls = classes.get(d.name)
        if cls is None:
            continue
        bases = [b.__name__ for b in cls.__bases__]
        if d.parent is None:
            if bases != ["Exception"]:
                found.append(f"{d.name} is drawn as the root but subclasses {', '.join(bases)}")
            continue
        if d.parent not in bases:
            found.append(f"{d.name} is drawn under {d.parent} but subclasses {', '.join(bases)}")
            continue
        found += [f"{d.name} also subclasses {base}, which its line does not say"
                  for base in bases if base != d.parent and base not in d.note]
    for parent in {d.parent for d in drawing if d.parent}:
        children = [d for d in drawing if d.parent == parent]
        joints = [d.last for d in children]
        if joints != [False] * (len(children) - 1) + [True]:
            found.append(f"the children of {parent} are not drawn ├── ... └──: {[d.name for d in children]}")
    return found


def test_the_drawn_tree_is_the_class_hierarchy() -> None:
    assert errors.__doc__ is not None
    drawing = parse(errors.__doc__)
    assert drawing[0].name == "KeyqueueError"
    assert mismatches(drawing, error_classes()) == []


def test_a_class_drawn_under_the_wrong_parent_is_reported() -> None:
    """The drawing as it was: ``CallOnOwnKey`` under ``Retry``."""
    assert errors.__doc__ is not None
    lines = errors.__doc__.splitlines()
    [call] = [line for line in lines if "── CallOnOwnKey" in line]
    lines.remove(call)
    retry = next(i for i, line in enumerate(lines) if "── Retry" in line)
    lines.insert(retry + 1, call)
    assert "CallOnOwnKey is drawn under Retry but subclasses Reject" in mismatches(parse("\n".join(lines)),
                                                                                   error_classes())


def test_a_class_left_out_of_the_drawing_is_reported() -> None:
    assert errors.__doc__ is not None
    without = "\n".join(line for line in errors.__doc__.splitlines() if "── EnqueueTimeout" not in line)
    assert mismatches(parse(without), error_classes())[0] == "EnqueueTimeout is not drawn"
