"""The NATS permissions each role needs: least privilege for a locked-down server.

``keyqueue permissions ROLE QUEUE...`` prints them as a nats-server ``permissions`` block; the
tests give users exactly these and check what each can and cannot do (docs/security.md). The roles:

- ``producer``: enqueues (also delayed requests, ``call``, whose reply comes to its own inbox, and
  workflows whose first step runs in the queue: their plan), and nothing else: it cannot read
  requests, results or the dead-letter queue, nor purge anything.
  The queue's streams must exist (a worker, or an operator, creates them).
- ``worker``: runs a queue's requests: its streams and consumers (created or checked at start),
  tokens, leases, records, schedules, events, replies to callers.
- ``dashboard``: reads, never writes: stream and consumer state, direct reads of stored messages,
  and the events and progress of every queue. Its DLQ actions are refused.
- ``operator``: the command line's writes (purge, configure, dlq replay, release, recreate-consumer):
  the JetStream API and keyqueue's subjects of every queue.

NATS wildcards match whole subject tokens only, so a per-queue set names each stream of the queue.
"""

from __future__ import annotations

from typing import Final, Literal

from keyqueue.events import events_stream
from keyqueue.jetstream.schedules import ScheduleNames
from keyqueue.jetstream.subjects import QueueNames, validate_queue_name

__all__ = ["ROLES", "Role", "permissions", "server_block"]

Role = Literal["producer", "worker", "dashboard", "operator"]
ROLES: Final = ("producer", "worker", "dashboard", "operator")

INBOXES: Final = "_INBOX.>"
"""Where nats-py's request replies (JetStream acknowledgements, API answers, results) arrive."""


def _streams(queue: str) -> list[str]:
    names = QueueNames(queue)
    return [names.inbox_stream, names.token_stream, names.dlq_stream, names.lease_stream, f"KQ_{queue}_RECORDS",
            ScheduleNames(queue).stream, events_stream(queue), names.work_stream,
            f"KQ_{queue}_WORKFLOWS"]


def permissions(role: Role, queues: list[str]) -> dict[str, list[str]]:
    """``{"publish": [...], "subscribe": [...]}``: the subjects ``role`` may use for ``queues``."""
    for queue in queues:
        validate_queue_name(queue)
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    publish: list[str] = ["$JS.API.INFO"]
    subscribe: list[str] = [INBOXES]
    if role == "dashboard":
        publish += ["$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.MSG.GET.*",
                    "$JS.API.DIRECT.GET.*", "$JS.API.DIRECT.GET.*.>", "$JS.API.CONSUMER.INFO.*.*",
                    "$JS.API.CONSUMER.NAMES.*", "$JS.API.CONSUMER.LIST.*"]
        subscribe += ["kq.*.events.>", "kq.*.progress.>"]
        return {"publish": publish, "subscribe": subscribe}
    if role == "operator":
        return {"publish": ["$JS.API.>", "$JS.ACK.>", "kq.>", INBOXES], "subscribe": ["kq.>", INBOXES]}
    for queue in queues:
        streams = _streams(queue)
        if role == "producer":
            publish += [f"kq.{queue}.in.>", f"kq.{queue}.tok.>", f"kq.{queue}.at.>",
                        f"kq.{queue}.work.>",  # unkeyed requests
                        f"kq.{queue}.result.>",  # the pending record of a task that keeps results
                        f"kq.{queue}.wf.>",  # the plan and start of a workflow whose first step runs here
                        f"kq.{queue}.events.>"]  # the enqueued event (core publishes)
            publish += [f"$JS.API.STREAM.INFO.{s}" for s in streams]
            names = QueueNames(queue)  # a producer checks that the token consumer exists (it reads no state)
            publish.append(f"$JS.API.CONSUMER.INFO.{names.token_stream}.{names.consumer}")
        else:  # worker
            publish += [f"kq.{queue}.>", INBOXES, f"$JS.ACK.{QueueNames(queue).token_stream}.>",
                        f"$JS.ACK.{ScheduleNames(queue).stream}.>", f"$JS.ACK.{QueueNames(queue).work_stream}.>"]
            for s in streams:
                publish += [f"$JS.API.STREAM.{verb}.{s}" for verb in ("INFO", "CREATE", "UPDATE", "PURGE")]
                publish += [f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.STREAM.MSG.DELETE.{s}",
                            f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>",
                            f"$JS.API.CONSUMER.*.{s}", f"$JS.API.CONSUMER.*.{s}.>",
                            f"$JS.API.CONSUMER.MSG.NEXT.{s}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.>"]
            subscribe.append(f"kq.{queue}.>")
    return {"publish": publish, "subscribe": subscribe}


def server_block(role: Role, queues: list[str]) -> str:
    """``permissions`` as a nats-server configuration block (for a user's entry in ``authorization``)."""
    allowed = permissions(role, queues)

    def quoted(subjects: list[str]) -> str:
        return ", ".join(f'"{s}"' for s in subjects)

    return ("permissions: {\n"
            f"  publish: {{ allow: [{quoted(allowed['publish'])}] }}\n"
            f"  subscribe: {{ allow: [{quoted(allowed['subscribe'])}] }}\n"
            "}")
