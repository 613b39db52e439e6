"""The Rebaser's errors, rooted in keyqueue's tree.

    KeyqueueError                       (keyqueue.errors)
    └── RebaserError
        ├── SnapshotConflict            a snapshot write lost to another writer (revision check)
        ├── UnreadableSnapshot          a stored snapshot this Rebaser cannot read
        └── DvuFailed                   a DVU could not be committed after its retries
"""

from __future__ import annotations

from keyqueue import KeyqueueError

__all__ = ["DvuFailed", "RebaserError", "SnapshotConflict", "UnreadableSnapshot"]


class RebaserError(KeyqueueError):
    """Root of the Rebaser's own errors."""


class SnapshotConflict(RebaserError):
    """A snapshot write was refused: someone wrote the change set since this holder read it.

    Either a newer holder of the key (this holder is stale and must stop) or a stale one (this
    holder reloads and applies again). ``fencing`` is this holder's fencing token.
    """

    def __init__(self, key: str, fencing: tuple[int, int], expected_revision: int, detail: str = "") -> None:
        self.key, self.fencing, self.expected_revision = key, fencing, expected_revision
        super().__init__(
            f"change set {key}: the holder with fencing token {fencing} wrote against revision "
            f"{expected_revision}, but the snapshot has changed since{f' ({detail})' if detail else ''}; "
            "it reloads and applies again, or stops if a newer holder wrote"
        )


class UnreadableSnapshot(RebaserError):
    """The stored snapshot is in a format this Rebaser does not know, or does not decode."""


class DvuFailed(RebaserError):
    """A DVU kept failing to commit; the roots stay stored and the next holder runs it again."""
