"""Change-set snapshots in a JetStream key-value bucket, with revision-checked writes.

The KV key is the change set's queue key, ``<workspace>.<change_set>``. Every write names the
revision its writer read; a write that lost the race (someone wrote since) is refused by the
server and raises :class:`~keyqueue_rebaser.errors.SnapshotConflict`, naming the writer's fencing
token. So a stale holder of a change set (paused past its lease, say) can never overwrite what
the current holder wrote: its next write fails, and when it reloads it finds a newer fencing
token in the state and stops.
"""

from __future__ import annotations

from typing import Final

from keyqueue import WrongLastSequence
from keyqueue.ext import Client, KeyValue

from .errors import SnapshotConflict
from .state import ChangeSetState, decode_state, encode_state

__all__ = ["DEFAULT_BUCKET", "SnapshotStore"]

DEFAULT_BUCKET: Final = "rebaser_snapshots"
"""The KV bucket the Rebaser keeps change-set snapshots in."""


class SnapshotStore:
    """Loads and saves :class:`ChangeSetState` values by change-set key."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: Client, bucket: str = DEFAULT_BUCKET, *, replicas: int = 1) -> SnapshotStore:
        """The store on ``bucket``, created if missing."""
        kv = KeyValue(nc, bucket, replicas=replicas)
        await kv.ensure()
        return cls(kv)

    async def load(self, key: str) -> tuple[ChangeSetState, int]:
        """The change set's state and its revision; a new change set is an empty state at revision 0."""
        entry = await self.kv.get(key)
        if entry is None:
            return ChangeSetState(), 0
        return decode_state(entry.value), entry.revision

    async def save(self, key: str, state: ChangeSetState, *, expected_revision: int) -> int:
        """Write ``state`` if the stored revision is still ``expected_revision``; returns the new revision."""
        try:
            return await self.kv.put(key, encode_state(state), expected_revision=expected_revision)
        except WrongLastSequence as e:
            raise SnapshotConflict(key, state.fencing, expected_revision, e.description) from e
