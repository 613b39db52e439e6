"""keyqueue: a task queue on NATS JetStream with exclusive, ordered work per key.

::

    import keyqueue

    app = keyqueue.App("shop")

    @app.task(key="{order_id}", max_attempts=5)
    async def charge(ctx: keyqueue.Context, order_id: str, amount: int) -> dict: ...

    receipt = await charge.enqueue(order_id="o1", amount=5)
    result = await charge.call(order_id="o1", amount=5, timeout=10)

    @app.task()                                   # no key: no exclusivity, no lock cost
    async def send_receipt(ctx: keyqueue.Context, email: str) -> None: ...

Everything below is the public API; the sub-packages (``core``, ``jetstream``, ``wire``) are
the machinery under it.
"""

from __future__ import annotations

from keyqueue.app.application import App, default_app, task
from keyqueue.app.cancel import CancelState
from keyqueue.app.schedules import Periodic
from keyqueue.app.status import RequestStatus, StatusReport
from keyqueue.app.worker import Worker
from keyqueue.core.observer import DeadLetterReason
from keyqueue.core.processor import (
    BaseProcessor,
    CloseReason,
    KeyProcessor,
    Reply,
    Request,
    RequestContext,
    SessionContext,
)
from keyqueue.core.retry import RetryPolicy
from keyqueue.errors import (
    BacklogFull,
    CallOnOwnKey,
    Cancelled,
    ConfigError,
    ConnectionClosed,
    ConnectionFailed,
    ConsumerNotFound,
    DeadLettered,
    Disconnected,
    EnqueueError,
    EnqueueTimeout,
    Expired,
    InvalidKey,
    InvalidRequestId,
    InvalidSchedule,
    InvalidSubject,
    JetStreamError,
    JetStreamUnavailable,
    KeyAlreadyScheduled,
    KeyqueueError,
    KeyqueueTimeout,
    LeaseLost,
    MalformedBody,
    MessageNotFound,
    MissingExtra,
    MissingHeader,
    PartiallyEnqueued,
    PayloadTooLarge,
    Reject,
    RemoteError,
    ReplyLost,
    RequestNotFound,
    ResultExpired,
    ResultNotKept,
    ResultUnavailable,
    Retry,
    ServerNotFound,
    SoftTimeout,
    StreamNotFound,
    Superseded,
    SyncTimeout,
    TaskFailure,
    TokenPublishFailed,
    TopologyMismatch,
    UnknownMessageType,
    UnsupportedContentType,
    UnsupportedVersion,
    WireError,
    WorkflowCancelled,
    WorkflowFailed,
    WrongLastSequence,
)
from keyqueue.jetstream.subjects import UNKEYED
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.plugins.manager import hookimpl, inline_observer
from keyqueue.settings import Settings
from keyqueue.tasks.canvas import (
    Canvas,
    Chain,
    Chord,
    Group,
    Signature,
    StepFailure,
    WorkflowReceipt,
    chain,
    chord,
    group,
)
from keyqueue.tasks.context import Context, Progress
from keyqueue.tasks.task import Backoff, BatchTask, Dispatcher, Policy, Receipt, Task, TaskRequest, TaskSpec

__all__ = [
    "UNKEYED",
    "App",
    "BacklogFull",
    "Backoff",
    "BaseProcessor",
    "BatchTask",
    "CallOnOwnKey",
    "CancelState",
    "Cancelled",
    "Canvas",
    "Chain",
    "Chord",
    "CloseReason",
    "ConfigError",
    "ConnectionClosed",
    "ConnectionFailed",
    "ConsumerNotFound",
    "Context",
    "DeadLetterReason",
    "DeadLettered",
    "Disconnected",
    "Dispatcher",
    "EnqueueError",
    "EnqueueTimeout",
    "Expired",
    "Group",
    "InvalidKey",
    "InvalidRequestId",
    "InvalidSchedule",
    "InvalidSubject",
    "JetStreamError",
    "JetStreamUnavailable",
    "KeyAlreadyScheduled",
    "KeyProcessor",
    "KeyqueueError",
    "KeyqueueTimeout",
    "LeaseLost",
    "MalformedBody",
    "MessageNotFound",
    "MissingExtra",
    "MissingHeader",
    "PartiallyEnqueued",
    "PayloadTooLarge",
    "Periodic",
    "Policy",
    "Progress",
    "QueueConfig",
    "Receipt",
    "Reject",
    "RemoteError",
    "Reply",
    "ReplyLost",
    "Request",
    "RequestContext",
    "RequestNotFound",
    "RequestStatus",
    "ResultExpired",
    "ResultNotKept",
    "ResultUnavailable",
    "Retry",
    "RetryPolicy",
    "ServerNotFound",
    "SessionContext",
    "Settings",
    "Signature",
    "SoftTimeout",
    "StatusReport",
    "StepFailure",
    "StreamNotFound",
    "Superseded",
    "SyncTimeout",
    "Task",
    "TaskFailure",
    "TaskRequest",
    "TaskSpec",
    "TokenPublishFailed",
    "TopologyMismatch",
    "UnknownMessageType",
    "UnsupportedContentType",
    "UnsupportedVersion",
    "WireError",
    "Worker",
    "WorkflowCancelled",
    "WorkflowFailed",
    "WorkflowReceipt",
    "WrongLastSequence",
    "chain",
    "chord",
    "default_app",
    "group",
    "hookimpl",
    "inline_observer",
    "task",
]
