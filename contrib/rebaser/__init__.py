"""The Rebaser: keyqueue's reference plugin, distribution ``keyqueue-rebaser`` (see README.md in this folder).

Per change set (key ``<workspace>.<change_set>`` of the ``rebaser`` queue) update requests apply
strictly in order, and "dependent values update" (DVU) runs one at a time beside them,
coalescing any number of triggers into one more run.
"""

from __future__ import annotations

from .client import Accepted, RebaserClient, change_set_key
from .dvu import SerialDvuTask
from .errors import DvuFailed, RebaserError, SnapshotConflict, UnreadableSnapshot
from .events import DVU_EVENTS, DVU_FINISHED, DVU_STARTED
from .functions import BUILTINS, FunctionRegistry, hookimpl, load_functions
from .graph import Node, UpdateError, apply_updates, full_recompute, recompute
from .messages import (
    REGISTRY,
    EnqueueUpdatesRequest,
    EnqueueUpdatesRequestV1,
    EnqueueUpdatesRequestV2,
    EnqueueUpdatesRequestV3,
    EnqueueUpdatesResponse,
    Update,
)
from .plugin import RebaserPlugin, RebaserProcessors, queue_config
from .processor import RebaserProcessor, RebaserSettings
from .state import ChangeSetState, DvuRun
from .store import SnapshotStore

__all__ = [
    "BUILTINS",
    "DVU_EVENTS",
    "DVU_FINISHED",
    "DVU_STARTED",
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
