"""Every per-key read and write a key session makes, for one queue.

This is the small interface between ``keyqueue.core`` (which knows the protocol) and NATS
(which only this package imports). Tests of the session's pure logic can stand in for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import (
    ConnectionFailed,
    JetStreamError,
    KeyqueueError,
    KeyqueueTimeout,
    MessageNotFound,
    WrongLastSequence,
    from_api_error,
)
from keyqueue.jetstream.acks import AckBarrier
from keyqueue.jetstream.api import (
    API_TIMEOUT,
    DESCRIPTION,
    STATUS,
    JetStreamApi,
    StoredMsg,
    direct_reply,
    message_gone,
    parse_pub_ack,
    raise_for_reply,
    stored_from_direct,
    stored_from_json,
)
from keyqueue.jetstream.connect import connect, disconnected, wait_connected
from keyqueue.jetstream.dlq_copy import dead_letter_copy, minimal_dead_letter_copy
from keyqueue.jetstream.fastpub import publish_plain
from keyqueue.jetstream.mux import RequestMux, wait
from keyqueue.jetstream.publish import Publisher
from keyqueue.jetstream.pull import Token
from keyqueue.jetstream.rechecks import InboxRechecks
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.jetstream.topology import QueueConfig
from keyqueue.jetstream.unawaited import UnawaitedDeletes
from keyqueue.wire.headers import RELEASED, is_release_marker

log = logging.getLogger("keyqueue.session")

EXPECTED_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"
"""Publish header: store only if the subject's last message has this sequence (0: none)."""

TTL: Final = "Nats-TTL"
"""Publish header: seconds until the server removes the message (nats-server >= 2.11)."""

ROLLUP: Final = "Nats-Rollup"
"""Publish header: ``sub`` removes the subject's earlier messages once this one is stored (the
stream must allow it: ``allow_rollup_hdrs``)."""

STEP_TIMEOUT_MIN: Final = 0.5
"""Shortest wait for a key session step's reply (a lease of 5 s waits 0.5 s; 30 s waits 3 s)."""

HEAD_TTL: Final = 24 * 3600
"""Seconds a crash-loop counter (``kq.<queue>.head.<key>``) is kept."""


class Watch:
    """A core subscription on one key's inbox subject that wakes once, when a request lands: it
    says so (:attr:`arrived`) and wakes the session waiting for one (:attr:`waiter`).

    A held key that waits for requests keeps one open, so it is made small: a nats-py subscription
    with a future rather than a callback (a callback subscription runs a task and a queue per key;
    this is how nats-py's own old-style requests subscribe), and one wake-up, after which the
    session opens a fresh watch before it reads again."""

    __slots__ = ("arrived", "rechecked", "sub", "waiter")

    def __init__(self) -> None:
        self.arrived = False
        """A request landed on the key's subject (the session clears it before it reads)."""
        self.waiter: asyncio.Future[None] | None = None
        """Set while the session waits for a request: resolved when one lands."""
        self.sub: Any = None
        self.rechecked = False
        """The session read once more while it waited (a store can lag behind the subscribe)."""

    def notify(self) -> None:
        self.arrived = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _landed(self, landed: asyncio.Future[Msg]) -> None:
        if not landed.cancelled():
            self.notify()

    async def close(self) -> None:
        # Dropped once closed: its future's callback is this watch (a cycle for the collector).
        sub, self.sub = self.sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass


def batch_read(replies: list[Msg]) -> tuple[list[StoredMsg], bool]:
    """The requests a batched direct get returned, in order, and whether more remain after them
    (its end-of-batch status says how many); a 404 is no request; another status is its error."""
    msgs: list[StoredMsg] = []
    more = False
    for reply in replies:
        headers = reply.headers or {}
        status = headers.get(STATUS)
        if status == "204":  # end of batch
            more = int(headers.get("Nats-Num-Pending", "0")) > 0
        elif status == "404":
            break
        elif status:
            raise from_api_error(headers.get(DESCRIPTION, "batched direct get failed"), int(status))
        else:
            msgs.append(stored_from_direct(reply))
    return msgs, more


def head_runs_added(record: StoredMsg | None, seq: int, *, runs: int = 0, killed: int = 0) -> tuple[int, int, bytes]:
    """The crash-loop counts of the key's head request ``seq`` once ``runs`` and ``killed`` are added to
    those of its head record ``record`` (none, unreadable, or another request's: they start over),
    and the body of the record that stores them (:meth:`QueueIO.add_head_runs`)."""
    try:
        last = json.loads(record.data) if record is not None else {}
    except ValueError:
        last = {}
    same = isinstance(last, dict) and last.get("seq") == seq
    new_runs = (int(last.get("runs", 0)) if same else 0) + runs
    new_killed = (int(last.get("killed", 0)) if same else 0) + killed
    body = json.dumps({"seq": seq, "runs": new_runs, "killed": new_killed}, separators=(",", ":")).encode()
    return new_runs, new_killed, body


class QueueIO:
    """The NATS side of key sessions for one queue."""

    def __init__(self, nc: Client, config: QueueConfig) -> None:
        self.nc = nc
        self.config = config
        self.names = config.names
        self.step_timeout = min(API_TIMEOUT, max(STEP_TIMEOUT_MIN, config.ack_wait / 10))
        """How long a key session's step waits for its reply before it is sent again (the session
        tries again within its lease): a stream electing a leader does not answer, and a lease of
        a few seconds cannot wait out the API's usual timeout."""
        self.api = JetStreamApi(nc, timeout=self.step_timeout)
        self.fleet_api = JetStreamApi(nc)
        """For what is not a key's step (fleet-wide scans, big replies): the usual timeout."""
        self.publisher = Publisher(nc, self.names)
        self.direct = config.replicas == 1
        self.replicated = config.replicas > 1
        """On a replicated stream the server answers some requests before it has done their work
        (a double ack before the token is removed: docs/architecture.md, "Replicated streams")."""
        # Two reply subscriptions: nats-py hands one subscription's messages to its callback one
        # at a time, so a read's reply would otherwise queue behind thousands of pipelined
        # deletes' replies, and a new key would wait for every busy key's deletes.
        self.mux = RequestMux(nc)
        """Deletes (bulk, pipelined)."""
        self.read_mux = RequestMux(nc)
        """Reads (latency-critical)."""
        self.timeout = self.api.timeout
        self._no_messages: asyncio.Queue[Msg] = asyncio.Queue()
        """The message queue every arrival watch's subscription shares (see :meth:`watch`)."""
        self._subscribing = asyncio.Lock()
        self.rechecks = InboxRechecks(self.last_sequences)
        """The releasing sessions' re-checks, many keys per read (:meth:`request_remains`)."""
        self.acks = AckBarrier(self._plain_ack, self._double_ack)
        """The releasing sessions' token acks, many per reply (:meth:`release_token`, one server)."""
        self._record_delete = f"{self.api.prefix}.STREAM.MSG.DELETE.{self.names.lease_stream}"
        self.forgotten = UnawaitedDeletes(nc, self._record_delete)
        """The records removed without waiting for the answer (:meth:`forget_record`)."""
        self.release_markers = False
        """Whether the inbox stream takes release markers (:meth:`mark_released`): set by the worker
        once its topology check has found (or made) ``allow_rollup_hdrs`` and ``allow_msg_ttl`` on
        it. A queue whose inbox cannot have them is given back the older way (purge, then re-check)."""

    # --- the key's requests ----------------------------------------------------------------------

    async def next_request(self, key: str, from_seq: int, *, requests_only: bool = False) -> StoredMsg | None:
        """The key's first stored message at or after ``from_seq``, or None; with ``requests_only``,
        its first request (a release marker skipped: one lives only before the key's requests).
        On a replicated inbox the stream leader answers (a lagging follower could hide a request
        from the release's re-check)."""
        found = await self._next_message(key, from_seq)
        if requests_only and found is not None and is_release_marker(found.headers):
            found = await self._next_message(key, found.seq + 1)
        return found

    async def _next_message(self, key: str, from_seq: int) -> StoredMsg | None:
        if not self.direct:
            # STREAM.MSG.GET, answered by the leader, through the read mux (no inbox and timer per read).
            payload = b'{"seq":%d,"next_by_subj":%s}' % (max(1, from_seq), json.dumps(self.names.inbox(key)).encode())
            reply = await self._ask(f"{self.api.prefix}.STREAM.MSG.GET.{self.names.inbox_stream}", payload,
                                    f"a read of key {key}'s inbox")
            body = json.loads(reply.data)
            try:
                raise_for_reply(body)
            except MessageNotFound:
                return None
            return stored_from_json(body["message"])
        payload = b'{"seq":%d,"next_by_subj":%s}' % (max(1, from_seq), json.dumps(self.names.inbox(key)).encode())
        return direct_reply(await self._ask(f"{self.api.prefix}.DIRECT.GET.{self.names.inbox_stream}", payload,
                                            f"a read of key {key}'s inbox"))

    async def request_remains(self, key: str, from_seq: int) -> bool:
        """Whether the key's inbox holds a request (not a release marker) at or after ``from_seq``:
        the releasing session's re-check. With direct gets, the re-checks asked in one turn of the
        loop go out as one read (:class:`~keyqueue.jetstream.rechecks.InboxRechecks`); on a
        replicated inbox the stream leader answers each."""
        if not self.direct:
            return await self.next_request(key, from_seq, requests_only=True) is not None
        return await self.rechecks.remains(key, from_seq)

    async def last_sequences(self, keys: list[str]) -> dict[str, int]:
        """Each key's last stored request's inbox sequence (keys without one left out), in one
        batched direct get of the last message of each subject (``multi_last``)."""
        subjects = {self.names.inbox(key): key for key in keys}
        payload = json.dumps({"multi_last": list(subjects), "batch": len(subjects)}).encode()
        sent = await self.read_mux.send(f"{self.api.prefix}.DIRECT.GET.{self.names.inbox_stream}", payload,
                                        multi=True)
        found, _ = batch_read(await wait(sent, self.timeout, "a re-check of the inboxes of keys given back"))
        # A subject whose last message is a release marker holds nothing else (the marker rolled up
        # everything before it): no request there.
        return {subjects[m.subject]: m.seq for m in found if m.subject in subjects and not is_release_marker(m.headers)}

    async def read(self, key: str, from_seq: int, limit: int) -> tuple[list[StoredMsg], bool]:
        """Up to ``limit`` of the key's requests from ``from_seq`` on, in one round trip where the
        stream allows direct gets; the flag says whether more requests remain after them."""
        if not self.direct or limit <= 1:
            one = await self.next_request(key, from_seq)
            return ([one] if one else []), bool(one) and limit > 1
        return await self.read_reply(key, await self.send_read(key, from_seq, limit))

    async def read_reply(self, key: str, sent: asyncio.Future[list[Msg]]) -> tuple[list[StoredMsg], bool]:
        """What a :meth:`send_read` found, once its replies are in (as :meth:`read` returns it)."""
        return batch_read(await wait(sent, self.timeout, f"a read of key {key}'s inbox"))

    async def send_read(self, key: str, from_seq: int, limit: int) -> asyncio.Future[list[Msg]]:
        """:meth:`read` sent now, its replies not awaited (:meth:`read_reply` reads them): a read that
        goes out beside another step (a key's first read beside its acquire) needs no task. Only
        where the stream allows direct gets (:attr:`direct`)."""
        payload = b'{"seq":%d,"batch":%d,"next_by_subj":%s}' % (max(1, from_seq), limit,
                                                                 json.dumps(self.names.inbox(key)).encode())
        return await self.read_mux.send(f"{self.api.prefix}.DIRECT.GET.{self.names.inbox_stream}", payload,
                                        multi=True)

    async def _ask(self, subject: str, body: bytes, what: str, timeout: float | None = None) -> Msg:
        """One request and its reply through the read mux: no timer and no inbox of its own, as
        nats-py's ``request`` would make (a key session's release sends three)."""
        self._require_connection(subject)
        [reply] = await self.read_mux.request(subject, body, timeout=self.timeout if timeout is None else timeout)
        if reply.headers and reply.headers.get(STATUS) == "503":
            raise ConnectionFailed(f"nobody answered {what} (no responders on {subject})")
        return reply

    async def delete(self, seq: int) -> None:
        """Delete a processed request; one already gone (a re-run after a crash) is fine."""
        await self.api.delete_msg(self.names.inbox_stream, seq, no_erase=True)

    async def settle(self, futures: list[asyncio.Future[list[Msg]]]) -> None:
        """Wait for pipelined purges; raise the first real error (a message already gone is fine)."""
        if not futures:
            return
        done, pending = await asyncio.wait(futures, timeout=self.timeout)
        for future in pending:
            future.cancel()
        if pending:
            raise KeyqueueTimeout(f"{len(pending)} delete(s) in {self.names.inbox_stream} unconfirmed")
        for future in done:
            reply = future.result()[0]
            try:
                raise_for_reply(json.loads(reply.data))
            except JetStreamError as e:
                if not message_gone(e):
                    raise

    def confirmed(self, future: asyncio.Future[list[Msg]]) -> bool:
        """Whether a pipelined purge is done and succeeded (its messages are gone), without waiting."""
        if not future.done() or future.cancelled() or future.exception() is not None:
            return False
        try:
            raise_for_reply(json.loads(future.result()[0].data))
        except JetStreamError as e:
            return message_gone(e)
        except (KeyqueueError, ValueError, IndexError):
            return False
        return True

    async def purge_soon(self, key: str, seq: int) -> asyncio.Future[list[Msg]]:
        """Send a purge of the key's requests up to and including ``seq`` without waiting for its
        reply; settle the futures with :meth:`settle`. Once per few requests: no JSON encoder
        for the body."""
        body = b'{"filter":%s,"seq":%d}' % (json.dumps(self.names.inbox(key)).encode(), seq + 1)
        return await self.mux.send(f"{self.api.prefix}.STREAM.PURGE.{self.names.inbox_stream}", body)

    async def purge_through(self, key: str, seq: int) -> int:
        """Remove the key's requests up to and including ``seq``."""
        return await self.api.purge(self.names.inbox_stream, subject=self.names.inbox(key), up_to_seq=seq + 1)

    async def mark_released(self, key: str, last_seq: int, timeout: float | None = None) -> bool:
        """Store the key's release marker if the last message on its inbox subject is still
        ``last_seq`` (0: the subject is empty): one write that removes every message before it
        (``Nats-Rollup: sub``: the requests handled, which all lie at or below ``last_seq``) and
        lives one second (``Nats-TTL``). True if stored; False if a request arrived after
        ``last_seq`` (the compare-and-set lost, nothing was removed). Both checks and the removal
        are one step on the server, under its stream lock: a request stored after the marker is
        never removed by it, and one stored before it makes it fail.

        A marker that lands late (its holder cut off) is harmless: it is stored only if nothing was
        stored after ``last_seq``, and what it removes then are requests its holder handled."""
        subject = self.names.inbox(key)
        self._require_connection(subject)
        future = await self.read_mux.send(subject, b"", headers={
            ROLLUP: "sub", EXPECTED_LAST_SUBJECT_SEQ: str(last_seq), TTL: "1", RELEASED: "1"})
        try:
            parse_pub_ack((await wait(future, self.timeout if timeout is None else timeout,
                                      f"the release marker of key {key}"))[0])
        except WrongLastSequence:
            return False
        return True

    async def watch(self, key: str) -> Watch:
        """Watch the key's inbox subject for the next request that lands (once)."""
        watch = Watch()
        landed: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        landed.add_done_callback(watch._landed)
        # One subscribe at a time: nats-py's subscribe waits for room in its flusher's queue
        # (1,024 entries), so a thousand keys that all start waiting at once would each hold a
        # half-built subscription meanwhile.
        async with self._subscribing:
            # max_msgs=1: nats-py forgets the subscription at its first message (later ones,
            # until the unsubscribe reaches the server, are dropped): the future is set at most once.
            sub = await self.nc.subscribe(self.names.inbox(key), future=landed, max_msgs=1)
            # A future subscription never uses its message queue (an asyncio.Queue: four deques,
            # 3 KB) but nats-py builds one for each: share one empty queue instead, so that ten
            # thousand waiting keys do not hold 30 MB of empty queues.
            sub._pending_queue = self._no_messages
        watch.sub = sub
        return watch

    # --- outputs ---------------------------------------------------------------------------------

    async def dead_letter(self, key: str, msg: StoredMsg, headers: Mapping[str, str], *,
                          dedupe: str | None = None) -> None:
        """Copy a request to the DLQ with the headers saying why (see :mod:`keyqueue.jetstream.dlq_copy`).

        The copy always fits ``max_payload`` and is always sendable; if the server still refuses
        it, the minimal copy is stored instead. Either is deduplicated on the request's inbox
        sequence (or on ``dedupe``: an unkeyed request's), so a copy sent again after a crash or a
        lost acknowledgement is stored once.
        """
        subject = self.names.dlq(key)
        copy = dead_letter_copy(msg, headers, self.nc.max_payload, dedupe=dedupe)
        if not copy.minimal:
            try:
                parse_pub_ack(await self.api._request(subject, copy.data, None, copy.headers))
                return
            except (JetStreamError, nats.errors.BadHeaderError, nats.errors.MaxPayloadError, UnicodeError) as e:
                # Refused (by the stream's limits, say), not lost: a timeout or a lost connection
                # is raised, and the next holder sends the same copy again.
                log.warning("queue %s key %s: the DLQ refused the copy of request %d (%r); storing a "
                            "minimal copy", self.names.queue, key, msg.seq, e)
            copy = minimal_dead_letter_copy(msg, headers, self.nc.max_payload, dedupe=dedupe)
        parse_pub_ack(await self.api._request(subject, copy.data, None, copy.headers))

    async def reply(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        self._require_connection(inbox)
        await self.nc.publish(inbox, body, headers=dict(headers))

    async def progress(self, key: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self._require_connection(self.names.progress(key))
        await self.nc.publish(self.names.progress(key), body, headers=dict(headers) if headers else None)

    # --- lease records (the lock) -----------------------------------------------------------------

    async def compare_and_set(self, subject: str, expected: int, body: bytes, ttl: int,
                              timeout: float | None = None) -> int:
        """Store ``body`` on ``subject`` only if its last record has sequence ``expected`` (0: none),
        removed by the server after ``ttl`` seconds. Returns the new record's sequence; raises
        :class:`~keyqueue.errors.WrongLastSequence` when another record is there."""
        self._require_connection(subject)
        future = await self.read_mux.send(subject, body, headers={EXPECTED_LAST_SUBJECT_SEQ: str(expected),
                                                                  TTL: str(max(1, ttl))})
        wait_for = self.timeout if timeout is None else max(0.001, timeout)
        return parse_pub_ack((await wait(future, wait_for, f"a lease write to {subject}"))[0]).seq

    async def add_head_runs(self, key: str, seq: int, *, runs: int = 0, killed: int = 0) -> tuple[int, int]:
        """Add to the crash-loop counts of the key's head request ``seq`` (``kq.<queue>.head.<key>``,
        a compare-and-set record; the counts of another request start over): ``runs``, sessions of
        redelivered tokens that started on it, and ``killed``, attempts of it that a loop watchdog
        stopped. Returns both counts. Raises ``WrongLastSequence`` if another write came first."""
        subject = self.names.head(key)
        record = await self.last_record(subject)
        new_runs, new_killed, body = head_runs_added(record, seq, runs=runs, killed=killed)
        await self.compare_and_set(subject, record.seq if record is not None else 0, body, HEAD_TTL)
        return new_runs, new_killed

    async def last_record(self, subject: str) -> StoredMsg | None:
        """The live record on ``subject`` in the lease stream, if any (from the leader)."""
        return await self.api.get_msg(self.names.lease_stream, last_by_subject=subject, direct=self.direct)

    async def remove_record(self, seq: int) -> None:
        """Remove one record by sequence: a record since replaced by another holder's is untouched."""
        reply = await self._ask(self._record_delete, b'{"seq":%d,"no_erase":true}' % seq, "a lease record's delete")
        try:
            raise_for_reply(json.loads(reply.data))
        except JetStreamError as e:
            if not message_gone(e):
                raise

    @property
    def unanswered_removals(self) -> bool:
        """Whether a record may be removed without waiting for the answer (:meth:`forget_record`):
        on one server and a lease stream of one replica, where a delete is lost with this worker's
        connection or in a full API queue, and is sent again either way. In a cluster the stream's
        server can restart, or a replicated stream's leader move, with this worker's connection up:
        those removals wait for their answers, as they always have."""
        return not self.replicated and not self.nc._server_info.get("cluster")

    async def forget_record(self, seq: int, ttl: float) -> None:
        """Remove one record by sequence without waiting for the answer (its record expires by
        itself ``ttl`` seconds after its last write). Only where :attr:`unanswered_removals`: the
        answer is looked for as it comes, and a delete not answered within a second is sent again
        (``keyqueue.jetstream.unawaited``: nats-server drops a full API queue's requests, answering
        none). A delete lost in a server killed after it answered is redone by the worker once
        reconnected (``REDELETE_WINDOW``)."""
        self._require_connection(self._record_delete)
        await self.forgotten.send(seq, ttl)

    # --- the token (a scheduling hint) ------------------------------------------------------------

    def _require_connection(self, what: str) -> None:
        # Nothing is queued in the client to be sent after a reconnect: a message that lands
        # late is one its sender no longer stands behind.
        if not self.nc.is_connected:
            if self.nc.is_closed:
                raise ConnectionFailed(f"the connection to NATS is closed: nothing sent to {what}")
            raise disconnected(f"a message to {what}")

    async def keepalive(self, token: Token) -> None:
        """Send ``+WPI`` so the server does not redeliver the token while its holder works."""
        self._require_connection(token.reply)
        await self.nc.publish(token.reply, b"+WPI")

    async def ack(self, token: Token, timeout: float = 5.0) -> None:
        """Double ack: returns once the server confirmed the ack (on one server, the token is gone
        then; on a replicated stream not yet: see :meth:`release_token`)."""
        await self._ask(token.reply, b"+ACK", f"the ack of key {token.key}'s token", timeout)

    async def _plain_ack(self, subject: str) -> None:
        self._require_connection(subject)
        await publish_plain(self.nc, subject, b"+ACK")

    async def _double_ack(self, subject: str, timeout: float) -> None:
        await self._ask(subject, b"+ACK", "the ack of released tokens", timeout)

    async def delete_token(self, token: Token) -> None:
        """Remove the token's message from the token stream by its sequence; returns once the stream
        leader has removed it (a message already gone is fine). The consumer takes a removed
        message as done, and a newer token of the key has another sequence and stays."""
        reply = await self._ask(f"{self.api.prefix}.STREAM.MSG.DELETE.{self.names.token_stream}",
                                b'{"seq":%d,"no_erase":true}' % token.stream_seq,
                                f"the removal of key {token.key}'s token")
        try:
            raise_for_reply(json.loads(reply.data))
        except JetStreamError as e:
            if not message_gone(e):
                raise

    async def token_stored(self, token: Token) -> bool:
        """Whether ``token`` itself (its sequence) is still the key's stored token, as the token
        stream's leader says."""
        stored = await self.api.get_msg(self.names.token_stream, last_by_subject=self.names.token(token.key),
                                        direct=False)
        return stored is not None and stored.seq == token.stream_seq

    async def release_token(self, token: Token, timeout: float = 5.0) -> None:
        """Ack the token, returning once it is gone from the token stream, so that a token published
        from now on for the key is stored (not refused with 10077 by the one being released).

        One server removes the token before it answers a double ack, and handles a consumer's acks in
        order: the tokens released in one turn of the loop are acked together, all but the last with
        a plain ack, and the last one's reply confirms them all (:class:`~keyqueue.jetstream.acks.AckBarrier`).
        A replicated stream answers
        once the consumer's group has applied the ack and removes the token after: a token
        published in between is refused. So there the token is also deleted by its sequence, a
        stream operation the leader answers only once it has applied it."""
        if not self.replicated:
            await self.acks.ack(token.reply, timeout)
            return
        acked, deleted = await asyncio.gather(self.ack(token, timeout), self.delete_token(token),
                                              return_exceptions=True)
        if isinstance(deleted, BaseException):
            raise deleted
        if isinstance(acked, BaseException) and not isinstance(acked, Exception):
            raise acked

    async def nak(self, token: Token, delay: float = 0.0) -> None:
        """Hand the token back for redelivery, after ``delay`` seconds."""
        self._require_connection(token.reply)
        body = b"-NAK" if delay <= 0 else b"-NAK " + json.dumps({"delay": int(delay * 1e9)}).encode()
        await self.nc.publish(token.reply, body)

    async def schedule(self, key: str) -> bool:
        """Publish the key's token; False if it already exists (held or scheduled)."""
        return await self.publisher.schedule(key)

    @property
    def closed(self) -> bool:
        """The connection is closed for good (it will not come back)."""
        return bool(self.nc.is_closed)

    async def wait_connected(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the connection to be up; whether it is."""
        return await wait_connected(self.nc, timeout)

    # --- fleet-wide views ------------------------------------------------------------------------

    async def keys_with_requests(self) -> dict[str, int]:
        subjects = await self.fleet_api.subjects(self.names.inbox_stream, self.names.inbox_prefix + ">")
        return {self.names.key_of(s): n for s, n in subjects.items()}

    async def keys_with_tokens(self) -> set[str]:
        subjects = await self.fleet_api.subjects(self.names.token_stream, self.names.token_prefix + ">")
        return {self.names.key_of(s) for s in subjects}

    async def tokens_waiting(self) -> int:
        """Tokens not yet delivered to any worker (the consumer's num_pending)."""
        info = await self.fleet_api.consumer_info(self.names.token_stream, self.names.consumer)
        return int(info.get("num_pending", 0))


async def requests_waiting(api: JetStreamApi, names: QueueNames) -> int:
    """How many requests a queue's inbox holds, release markers (which live a second after a key is
    given back) left out: the messages are read, so call it on a small or draining inbox."""
    waiting = 0
    async for page in api.pages(names.inbox_stream, names.inbox_prefix + ">"):
        waiting += sum(1 for msg in page if not is_release_marker(msg.headers))
    return waiting


def count_killed_attempts(nc: Client, config: QueueConfig, marks: Sequence[tuple[str, int]], budget: float) -> None:
    """For a loop watchdog, from its own thread while the worker's event loop is blocked: add one
    killed attempt to the head record of each ``(key, inbox sequence)``, on a connection of its own
    to the servers ``nc`` was opened for, within ``budget`` seconds (``TimeoutError`` past it)."""
    target = getattr(nc, "target", None)
    if target is None:
        raise ConnectionFailed("the worker's connection was not opened by keyqueue.jetstream.connect: cannot open "
                               "another to count the blocked attempts")

    async def count() -> None:
        async with asyncio.timeout(budget):
            other = await connect(target, name="keyqueue-loop-watchdog")
            try:
                io = QueueIO(other, config)
                await asyncio.gather(*(io.add_head_runs(key, seq, killed=1) for key, seq in marks))
            finally:
                await other.close()

    asyncio.run(count())
