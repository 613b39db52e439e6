"""The Rebaser: keyqueue's reference plugin (see README.md in this folder).

Per change set (key ``<workspace>.<change_set>`` of the ``rebaser`` queue) update requests apply
strictly in order, and "dependent values update" (DVU) runs one at a time beside them,
coalescing any number of triggers into one more run.
"""

from __future__ import annotations

from contrib.rebaser.client import Accepted, RebaserClient, change_set_key
from contrib.rebaser.dvu import SerialDvuTask
from contrib.rebaser.errors import DvuFailed, RebaserError, SnapshotConflict, UnreadableSnapshot
from contrib.rebaser.functions import BUILTINS, FunctionRegistry, hookimpl, load_functions
from contrib.rebaser.graph import Node, UpdateError, apply_updates, full_recompute, recompute
from contrib.rebaser.messages import (
    REGISTRY,
    EnqueueUpdatesRequest,
    EnqueueUpdatesRequestV1,
    EnqueueUpdatesRequestV2,
    EnqueueUpdatesRequestV3,
    EnqueueUpdatesResponse,
    Update,
)
from contrib.rebaser.plugin import RebaserPlugin, RebaserProcessors, queue_config
from contrib.rebaser.processor import RebaserProcessor, RebaserSettings
from contrib.rebaser.state import ChangeSetState, DvuRun
from contrib.rebaser.store import SnapshotStore

__all__ = [
    "BUILTINS",
    "REGISTRY",
    "Accepted",
    "ChangeSetState",
    "DvuFailed",
    "DvuRun",
    "EnqueueUpdatesRequest",
    "EnqueueUpdatesRequestV1",
    "EnqueueUpdatesRequestV2",
    "EnqueueUpdatesRequestV3",
    "EnqueueUpdatesResponse",
    "FunctionRegistry",
    "Node",
    "RebaserClient",
    "RebaserError",
    "RebaserPlugin",
    "RebaserProcessor",
    "RebaserProcessors",
    "RebaserSettings",
    "SerialDvuTask",
    "SnapshotConflict",
    "SnapshotStore",
    "UnreadableSnapshot",
    "Update",
    "UpdateError",
    "apply_updates",
    "change_set_key",
    "full_recompute",
    "hookimpl",
    "load_functions",
    "queue_config",
    "recompute",
]
