"""The Rebaser's wire messages: ``EnqueueUpdatesRequest`` v1-v3 and ``EnqueueUpdatesResponse`` v1.

Every message travels with keyqueue's headers (``X-CONTENT-TYPE``, ``X-MESSAGE-TYPE``,
``X-MESSAGE-VERSION``, ``Nats-Msg-Id`` = the request id, a ULID). A worker decides from the
headers alone whether it can read a request, reads older versions and upgrades them
(v1 -> v2 -> v3), and refuses newer ones with a typed error naming the versions it supports.

Versions of the request:

- v1: the change set (``workspace_id``, ``change_set_id``) and its ``updates``.
- v2: adds ``from_change_set_id``, the change set the updates were rebased from (recorded in the
  snapshot, so a change set shows where its last rebase came from). A v1 request had none.
- v3: adds ``event_session_id``, the caller's event session (recorded with the DVU run that
  covers the request, so the caller's events can be correlated with the run). Older: none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Self

from keyqueue.wire import Message, Registry

__all__ = [
    "AWAIT_DVU",
    "OPS",
    "REGISTRY",
    "STATUS_ERROR",
    "STATUS_SUCCESS",
    "EnqueueUpdatesRequest",
    "EnqueueUpdatesRequestV1",
    "EnqueueUpdatesRequestV2",
    "EnqueueUpdatesRequestV3",
    "EnqueueUpdatesResponse",
    "EnqueueUpdatesResponseV1",
    "Update",
]

REQUEST_TYPE: Final = "EnqueueUpdatesRequest"
"""``X-MESSAGE-TYPE`` of requests."""

RESPONSE_TYPE: Final = "EnqueueUpdatesResponse"
"""``X-MESSAGE-TYPE`` of responses."""

AWAIT_DVU: Final = "X-Rebaser-Await-Dvu"
"""Request header (``true``): also send a second response once a DVU run covering the request finished."""

STATUS_SUCCESS: Final = "success"
"""``EnqueueUpdatesResponse.status``: the updates were applied."""

STATUS_ERROR: Final = "error"
"""``EnqueueUpdatesResponse.status``: nothing was applied; ``message`` says why."""

OPS: Final = ("set_value", "add_node", "remove_node", "add_dependency", "remove_dependency")
"""The update operations, in the order the README documents them."""

REGISTRY = Registry()
"""The Rebaser's message types and their upgrade chains."""


@dataclass(frozen=True)
class Update:
    """One change to a change set's graph. Build them with the class methods.

    ``op`` is one of :data:`OPS`; ``node`` the node it changes. ``value`` is for ``set_value``,
    ``add_node`` and ``remove_dependency``; ``function``, ``inputs`` and ``args`` for
    ``add_dependency`` (the node's value is then ``function(values of inputs, args)``, recomputed
    by every DVU that reaches it).
    """

    op: str
    node: str
    value: Any = None
    function: str | None = None
    inputs: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown update op {self.op!r}; ops are {', '.join(OPS)}")
        if not isinstance(self.node, str) or not self.node:
            raise ValueError("an update names its node with a non-empty string")
        if self.op == "add_dependency" and not self.function:
            raise ValueError(f"add_dependency on {self.node!r} names no function")

    @classmethod
    def set_value(cls, node: str, value: Any) -> Update:
        return cls("set_value", node, value=value)

    @classmethod
    def add_node(cls, node: str, value: Any = None) -> Update:
        return cls("add_node", node, value=value)

    @classmethod
    def remove_node(cls, node: str) -> Update:
        return cls("remove_node", node)

    @classmethod
    def add_dependency(cls, node: str, function: str, inputs: list[str], args: dict[str, Any] | None = None) -> Update:
        return cls("add_dependency", node, function=function, inputs=list(inputs), args=dict(args or {}))

    @classmethod
    def remove_dependency(cls, node: str, value: Any = None) -> Update:
        """Make a computed node plain again, with ``value``."""
        return cls("remove_dependency", node, value=value)

    def describe(self) -> str:
        """A short human form: ``set_value a=3``, ``add_dependency t <- sum(a, b)``."""
        if self.op in ("set_value", "add_node") or (self.op == "remove_dependency" and self.value is not None):
            return f"{self.op} {self.node}={self.value!r}"
        if self.op == "add_dependency":
            return f"add_dependency {self.node} <- {self.function}({', '.join(self.inputs)})"
        return f"{self.op} {self.node}"


@REGISTRY.register
@dataclass(frozen=True)
class EnqueueUpdatesRequestV1(Message):
    """Apply ``updates`` to a change set's snapshot, in order, all or nothing."""

    TYPE = REQUEST_TYPE
    VERSION = 1

    workspace_id: str
    change_set_id: str
    updates: list[Update]


@REGISTRY.register
@dataclass(frozen=True)
class EnqueueUpdatesRequestV2(Message):
    """v1 plus the change set the updates were rebased from."""

    TYPE = REQUEST_TYPE
    VERSION = 2

    workspace_id: str
    change_set_id: str
    updates: list[Update]
    from_change_set_id: str | None

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, EnqueueUpdatesRequestV1)
        return cls(previous.workspace_id, previous.change_set_id, previous.updates, from_change_set_id=None)


@REGISTRY.register
@dataclass(frozen=True)
class EnqueueUpdatesRequestV3(Message):
    """v2 plus the caller's event session."""

    TYPE = REQUEST_TYPE
    VERSION = 3

    workspace_id: str
    change_set_id: str
    updates: list[Update]
    from_change_set_id: str | None
    event_session_id: str | None

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        assert isinstance(previous, EnqueueUpdatesRequestV2)
        return cls(previous.workspace_id, previous.change_set_id, previous.updates, previous.from_change_set_id,
                   event_session_id=None)

    @property
    def key(self) -> str:
        """The change set's key in the ``rebaser`` queue: ``<workspace>.<change_set>``."""
        return f"{self.workspace_id}.{self.change_set_id}"


@REGISTRY.register
@dataclass(frozen=True)
class EnqueueUpdatesResponseV1(Message):
    """The outcome of one request.

    ``status`` is ``success`` (``updates_performed`` updates applied as change number ``change``)
    or ``error`` (nothing applied; ``message`` says why). ``dvu_owed`` says a DVU will run for
    values downstream of the change. A request sent with ``await_dvu`` gets a second response
    once a DVU covering it has finished: it names the run (``dvu_run``) and any values that run
    could not compute (``dvu_errors``).
    """

    TYPE = RESPONSE_TYPE
    VERSION = 1

    status: str
    updates_performed: int = 0
    message: str | None = None
    change: int = 0
    dvu_owed: bool = False
    dvu_run: int | None = None
    dvu_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_SUCCESS


EnqueueUpdatesRequest = EnqueueUpdatesRequestV3
"""The latest request version: what a worker handles and what the client sends."""

EnqueueUpdatesResponse = EnqueueUpdatesResponseV1
"""The latest response version."""
