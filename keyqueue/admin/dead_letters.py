"""A queue's dead-letter queue: list, show, delete, purge and replay dead requests, in order.

Each dead request is a copy of the original (headers and body) plus ``X-KQ-DLQ-*`` headers
saying why, after how many attempts, and where it was stored; its request id is in
``X-KQ-DLQ-Request-Id`` (the copy's own ``Nats-Msg-Id`` is ``dlq:<inbox sequence>``). A copy may
be incomplete: its body cut to fit the server's ``max_payload``, or, as a last resort, only
keyqueue's headers (``X-KQ-DLQ-Truncated`` then gives the original body's size; see
``keyqueue.jetstream.dlq_copy``).

``replay`` stores each complete one again in its key's inbox, oldest first, then removes it from
the DLQ; an incomplete one stays in the DLQ (replaying a cut body could only fail again, or worse,
run on partial data). A replay covers the dead requests there when it begins (or only the
sequences it is given): requests dead-lettered meanwhile, its own replays included, wait for the
next one. A replayed request gets a new request id derived from its DLQ sequence (``<id>.replay-<seq>``,
see ``replay_id``), so JetStream does not drop it as a duplicate of the original, while a replay
that is interrupted and run again does not store it twice; the id it was dead-lettered under
travels in ``X-KQ-Replay-Of``. Its reply inbox is dropped (the original caller is gone). Replayed
requests join the back of their key's backlog. A replayed step of a workflow resumes it: the
workflow stops saying it failed there, and when the step succeeds what follows it is enqueued.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from keyqueue.app.workflows import mark_resumed, step_of
from keyqueue.errors import KeyqueueError, MessageNotFound, WireError
from keyqueue.jetstream.api import JetStreamApi, StoredMsg
from keyqueue.jetstream.dlq_copy import DEDUPE_PREFIX
from keyqueue.jetstream.publish import OutgoingRequest, Publisher
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.workflows import existing_store
from keyqueue.wire import headers as H
from keyqueue.wire import loads, peek

__all__ = [
    "REPLAY_OF",
    "TRACEBACK",
    "DeadLetter",
    "count_dead_letters",
    "dead_letter_of",
    "dead_letters",
    "delete_dead_letters",
    "get_dead_letter",
    "purge_dead_letters",
    "replay",
    "replay_id",
    "replay_request",
]

REPLAY_OF: Final = H.REPLAY_OF
"""On a replayed request: the request id it was dead-lettered under."""

TRACEBACK: Final = H.DLQ_TRACEBACK
"""The last error's traceback on a dead request (``DeadLetter.traceback``, ``keyqueue dlq show``)."""

_REPLAY_SUFFIX: Final = re.compile(r"\.replay-\d+$")

_DLQ_HEADERS: Final = frozenset(h.lower() for h in (
    H.DLQ_REASON, H.DLQ_ERROR_TYPE, H.DLQ_ATTEMPTS, H.DLQ_ORIGINAL_SUBJECT, H.DLQ_ORIGINAL_SEQ, H.DLQ_TIME,
    H.DLQ_REQUEST_ID, H.DLQ_TRUNCATED, H.DLQ_ESCAPED_HEADERS,
    H.ERROR_MESSAGE, H.ERROR_TYPE, H.REPLY_INBOX, H.MSG_ID, REPLAY_OF, TRACEBACK,
))


@dataclass(frozen=True)
class DeadLetter:
    """One dead request."""

    seq: int
    """Its sequence in the DLQ stream."""
    key: str
    request_id: str
    message_type: str
    version: str
    reason: str
    error_type: str
    error_message: str
    attempts: int | None
    """How many times it was delivered before it was dead-lettered (None if the copy does not say)."""
    original_seq: int | None
    """Its sequence in the inbox stream (None if the copy does not say)."""
    time: str
    """When it was dead-lettered (RFC 3339, UTC), or empty."""
    headers: Mapping[str, str]
    data: bytes
    truncated_from: int | None = None
    """The original body's size when this copy is incomplete (see the module docstring), else None."""
    traceback: str | None = None
    """The last error's traceback, when the copy carries one (``TRACEBACK``)."""

    def body(self) -> Any:
        """The body decoded to plain values (or a short description if it does not decode)."""
        try:
            return loads(self.data, peek(self.headers).content_type)
        except WireError as exc:
            return f"<{len(self.data)} bytes that do not decode: {exc}>"


def dead_letter_of(names: QueueNames, msg: StoredMsg) -> DeadLetter:
    """The dead request a message of the DLQ stream holds."""
    h = msg.headers
    return DeadLetter(
        seq=msg.seq,
        key=names.key_of(msg.subject),
        # Copies made before X-KQ-DLQ-Request-Id existed kept the request id as their Nats-Msg-Id.
        request_id=h.get(H.DLQ_REQUEST_ID, "") or _legacy_request_id(h.get(H.MSG_ID, "")),
        message_type=h.get(H.MESSAGE_TYPE, ""),
        version=h.get(H.MESSAGE_VERSION, ""),
        reason=h.get(H.DLQ_REASON, ""),
        error_type=h.get(H.DLQ_ERROR_TYPE, ""),
        error_message=h.get(H.ERROR_MESSAGE, ""),
        attempts=_number(h.get(H.DLQ_ATTEMPTS, "")),
        original_seq=_number(h.get(H.DLQ_ORIGINAL_SEQ, "")),
        time=h.get(H.DLQ_TIME, ""),
        headers=h,
        data=msg.data,
        truncated_from=_number(h.get(H.DLQ_TRUNCATED, "")),
        traceback=_traceback(h.get(TRACEBACK)),
    )


def _number(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _traceback(value: str | None) -> str | None:
    if not value:
        return None
    try:
        decoded = json.loads(value)
    except ValueError:
        return value  # not the JSON string it should be: show it as it came
    return decoded if isinstance(decoded, str) else value


def _legacy_request_id(msg_id: str) -> str:
    return "" if msg_id.startswith(DEDUPE_PREFIX) else msg_id


async def dead_letters(api: JetStreamApi, queue: str, *, key: str | None = None, limit: int | None = None,
                       after: int = 0) -> list[DeadLetter]:
    """Dead requests of ``queue`` (of ``key`` only, if given), oldest first, from sequence ``after + 1``."""
    names = QueueNames(queue)
    subject = names.dlq(key) if key is not None else names.dlq_prefix + ">"
    found: list[DeadLetter] = []
    seq = after + 1
    while limit is None or len(found) < limit:
        msg = await api.get_msg(names.dlq_stream, seq=seq, next_by_subject=subject, direct=False)
        if msg is None:
            break
        found.append(dead_letter_of(names, msg))
        seq = msg.seq + 1
    return found


async def count_dead_letters(api: JetStreamApi, queue: str, *, key: str | None = None) -> int:
    """How many dead requests ``queue`` holds (of ``key`` only, if given)."""
    names = QueueNames(queue)
    if key is None:
        return int((await api.stream_info(names.dlq_stream))["state"].get("messages", 0))
    return sum((await api.subjects(names.dlq_stream, names.dlq(key))).values())


async def get_dead_letter(api: JetStreamApi, queue: str, seq: int) -> DeadLetter:
    """The dead request at DLQ sequence ``seq`` (``MessageNotFound`` if there is none)."""
    names = QueueNames(queue)
    msg = await api.get_msg(names.dlq_stream, seq=seq, direct=False)
    if msg is None:
        raise MessageNotFound(f"queue {queue} has no dead request at sequence {seq}", 404, 10037)
    return dead_letter_of(names, msg)


async def delete_dead_letters(api: JetStreamApi, queue: str, seqs: Collection[int]) -> None:
    """Remove the dead requests at DLQ sequences ``seqs``, or none of them if one is not there
    (``MessageNotFound`` naming those)."""
    await _selected(api, queue, seqs)
    names = QueueNames(queue)
    for seq in sorted(set(seqs)):
        await api.delete_msg(names.dlq_stream, seq)


async def purge_dead_letters(api: JetStreamApi, queue: str, *, key: str | None = None) -> int:
    """Remove every dead request of ``queue`` (of ``key`` only, if given); returns how many."""
    names = QueueNames(queue)
    return await api.purge(names.dlq_stream, subject=names.dlq(key) if key is not None else None)


async def _selected(api: JetStreamApi, queue: str, seqs: Collection[int], key: str | None = None) -> list[DeadLetter]:
    """The dead requests at ``seqs`` (of ``key``, if given), in order; ``MessageNotFound`` if one is missing."""
    found: list[DeadLetter] = []
    missing: list[int] = []
    for seq in sorted(set(seqs)):
        try:
            letter = await get_dead_letter(api, queue, seq)
        except MessageNotFound:
            missing.append(seq)
            continue
        if key is not None and letter.key != key:
            missing.append(seq)
        else:
            found.append(letter)
    if missing:
        whose = f" of key {key}" if key is not None else ""
        raise MessageNotFound(f"queue {queue} has no dead request{whose} at sequence "
                              f"{', '.join(map(str, missing))}; nothing was changed", 404, 10037)
    return found


def replay_id(request_id: str, seq: int) -> str:
    """The request id a dead request at DLQ sequence ``seq`` is replayed under: ``<id>.replay-<seq>``.

    An id that is itself a replay's (``o1.replay-3``, dead again at 15) has its suffix replaced
    (``o1.replay-15``), so ids do not grow with each replay. The DLQ sequence alone makes the id
    unique: replaying one dead request twice stores it once.
    """
    return f"{_REPLAY_SUFFIX.sub('', request_id) or 'unknown'}.replay-{seq}"


def replay_request(letter: DeadLetter) -> OutgoingRequest:
    """The request ``replay`` stores for a dead one."""
    headers = {k: v for k, v in letter.headers.items() if k.lower() not in _DLQ_HEADERS}
    request_id = replay_id(letter.request_id, letter.seq)
    headers[H.MSG_ID] = request_id
    if letter.request_id:
        headers[REPLAY_OF] = letter.request_id
    return OutgoingRequest(letter.key, headers, letter.data, request_id)


async def replay(api: JetStreamApi, publisher: Publisher, queue: str, *, key: str | None = None,
                 seqs: Collection[int] | None = None, dry_run: bool = False,
                 on_replayed: Callable[[DeadLetter], None] | None = None,
                 on_skipped: Callable[[DeadLetter], None] | None = None) -> int:
    """Store the dead requests of ``queue`` (or of ``key``) again, oldest first; returns how many.

    Only those in the DLQ when the replay begins: one dead-lettered meanwhile (a replayed request
    that fails again, say) waits for the next replay, so a replay always ends. With ``seqs``, only
    the dead requests at those DLQ sequences, still oldest first (``MessageNotFound``, before
    anything is replayed, if one is not there). Each is removed from the DLQ once it is stored
    again; ``on_replayed`` is called after each. An incomplete copy (``truncated_from`` set) stays
    in the DLQ and ``on_skipped`` is called for it. ``dry_run`` makes the same calls and changes
    nothing.
    """
    names = QueueNames(queue)
    count = 0
    async for letter in _to_replay(api, queue, key, seqs):
        if letter.truncated_from is not None:
            if on_skipped is not None:
                on_skipped(letter)
            continue
        if not dry_run:
            # A step of a workflow: its workflow says "running" again *before* the step is stored, or
            # the replayed step could fail again (and say so) before it, leaving "running" for ever.
            await _resume_workflow(api, letter)
            try:
                await publisher.enqueue(replay_request(letter))
            except KeyqueueError as exc:
                raise KeyqueueError(f"replaying dead request {letter.seq} (key {letter.key}) failed after "
                                    f"{count} replayed: {exc}") from exc
            await api.delete_msg(names.dlq_stream, letter.seq)
        count += 1
        if on_replayed is not None:
            on_replayed(letter)
    return count


async def _resume_workflow(api: JetStreamApi, letter: DeadLetter) -> None:
    """A replayed step of a workflow: its workflow no longer says it stopped there (it runs again)."""
    step = step_of(letter.headers)
    if step is None:
        return
    store = await existing_store(api.nc, step.queue)
    if store is not None:
        await mark_resumed(store, step.workflow_id, step.step)


async def _to_replay(api: JetStreamApi, queue: str, key: str | None,
                     seqs: Collection[int] | None) -> AsyncIterator[DeadLetter]:
    """The dead requests a replay covers, oldest first: those at ``seqs``, else those there now."""
    if seqs is not None:
        for letter in await _selected(api, queue, seqs, key):
            yield letter
        return
    last = int((await api.stream_info(QueueNames(queue).dlq_stream))["state"].get("last_seq", 0))
    after = 0
    while after < last and (batch := await dead_letters(api, queue, key=key, limit=100, after=after)):
        for letter in batch:
            if letter.seq > last:
                return
            after = letter.seq
            yield letter

