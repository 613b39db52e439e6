"""The JetStream API calls keyqueue makes, on nats-py's core client.

keyqueue talks to the ``$JS.API`` subjects directly rather than through nats-py's JetStream
context: it needs fields nats-py does not have (priority groups, ``no_erase`` deletes, batched
direct gets) and it must not log a traceback for every expected 10077 reply. Every error reply
becomes a typed error through :func:`keyqueue.errors.from_api_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from keyqueue.errors import (
    ConnectionFailed,
    JetStreamError,
    KeyqueueTimeout,
    MessageNotFound,
    StreamNotFound,
    from_api_error,
)
from keyqueue.jetstream.connect import CONNECTION_DOWN, disconnected, link_of, not_sent

API_TIMEOUT: Final = 5.0
"""Seconds to wait for a JetStream API reply before raising KeyqueueTimeout."""

LARGE_REPLY: Final = 256 * 1024
"""Bytes from which an API reply is parsed off the event loop."""

STATUS: Final = "Status"
"""Header nats-py sets from the status line of a server status message."""

DESCRIPTION: Final = "Description"
"""Header nats-py sets from the description of a server status message."""


@dataclass(frozen=True, slots=True)
class PubAck:
    """The server's acknowledgement of a JetStream publish."""

    stream: str
    seq: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class StoredMsg:
    """A message read from a stream by sequence or subject."""

    subject: str
    seq: int
    headers: dict[str, str]
    data: bytes
    timestamp: str = ""


RECHECK_FIRST: Final = 0.1
RECHECK_MAX: Final = 2.0
"""Seconds between reads while :func:`wait_stored` waits (the first, then doubling up to this)."""
ARRIVED_RECHECK: Final = 0.005
"""Seconds :func:`wait_stored` waits before reading again a message it saw published but not yet stored."""


async def wait_stored(nc: Client, subject: str, read: Callable[[str], Awaitable[StoredMsg | None]],
                      accept: Callable[[StoredMsg], bool], timeout: float) -> StoredMsg | None:
    """The last message ``read`` finds stored on ``subject`` once ``accept`` takes it, waiting up to
    ``timeout`` seconds; None if none came.

    Subscribes before reading, so a message stored after the read is seen. One published just
    before the subscribe reached the server can still be stored only after that read (the server
    stores asynchronously) and never reach the subscription: so while it waits, it reads again now
    and then (after 0.1 s, then doubling up to 2 s).

    What it returns is always read back from the stream, never taken from the subscription: the
    server hands a publish to subscribers before its stream has stored it (or refused it), so a
    message returned from the wire could be one that every other reader does not see yet, or ever.
    An acceptable message seen arriving makes it read again at once (then after 5 ms, doubling)
    until the stream has it.
    """
    arrivals: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        arrivals.put_nowait(msg)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pause = RECHECK_FIRST
    sub = await nc.subscribe(subject, cb=on_msg)
    try:
        while True:
            stored = await read(subject)
            if stored is not None and accept(stored):
                return stored
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            if await _arrives(arrivals, accept, min(pause, remaining)):
                pause = ARRIVED_RECHECK
            else:
                pause = min(2 * pause, RECHECK_MAX)
    finally:
        await sub.unsubscribe()


async def _arrives(arrivals: asyncio.Queue[Msg], accept: Callable[[StoredMsg], bool], within: float) -> bool:
    """Whether a message ``accept`` takes arrives on ``arrivals`` within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while not accept(StoredMsg((msg := await arrivals.get()).subject, 0, dict(msg.headers or {}), msg.data)):
                pass
    except TimeoutError:
        return False
    return True


def stored_seconds(timestamp: str) -> float | None:
    """A stored message's timestamp (RFC 3339 with up to nanoseconds, the server's wall clock) as
    Unix seconds; None for an empty or unreadable one."""
    try:
        # The server's form (``...:SS.nnnnnnnnnZ``) as it is: Python 3.11 reads it (nanoseconds
        # cut to microseconds, as below), once per request.
        return datetime.datetime.fromisoformat(timestamp).timestamp()
    except ValueError:
        pass
    text = timestamp.strip().replace("Z", "+00:00")
    if not text:
        return None
    base, sep, rest = text.partition(".")
    if sep:
        digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
        text = f"{base}.{digits[:6].ljust(6, '0')}{rest[len(digits):]}"
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


MESSAGE_GONE: Final = frozenset({10057, 10043})
"""JetStream's err_codes for deleting a sequence that holds no message: 10057 ("no message found",
"stream store EOF") below the stream's first sequence or past its last; 10043 ("sequence N not
found") one deleted already between messages still stored (the server's filestore reports it as
not removed, without an error). A delete sent again after its reply was lost gets either."""


def message_gone(error: JetStreamError) -> bool:
    """Whether a delete by sequence failed only because the message is not there (any more)."""
    return error.err_code in MESSAGE_GONE


def raise_for_reply(body: Mapping[str, Any]) -> None:
    """Raise the typed error carried by a JetStream API reply, if any."""
    error = body.get("error")
    if error:
        raise from_api_error(
            str(error.get("description", "JetStream API error")),
            int(error.get("code", 0)),
            int(error.get("err_code", 0)),
        )


_PLAIN_PUB_ACK: Final = re.compile(rb'\{"stream":"([!#-\[\]-~]+)",(?:"domain":"[!#-\[\]-~]*",)?"seq":([0-9]{1,20})\}')
"""The acknowledgement of a publish stored once, as nats-server writes it (``{"stream":"S","seq":7}``):
read without the JSON decoder, which is most of the cost of a publish's reply. Names of printable
ASCII only (no quote, no backslash): any other reply (a duplicate, a refusal, a name that is not
ASCII, another server's spelling) goes to the decoder, which refuses what is not JSON."""


def parse_pub_ack(msg: Msg) -> PubAck:
    """A PubAck from a publish reply, raising the typed error if the publish was refused."""
    plain = _PLAIN_PUB_ACK.fullmatch(msg.data) if not msg.headers else None
    if plain is not None:
        return PubAck(plain[1].decode(), int(plain[2]), False)
    if msg.headers and msg.headers.get(STATUS) == "503":
        raise ConnectionFailed("no JetStream stream answered the publish: the queue's streams do not exist "
                               "(an app's producer or worker creates them; were they deleted?), or (in a "
                               "cluster) the stream has no leader yet: try again in a moment")
    try:
        body = json.loads(msg.data)
    except ValueError as e:
        raise JetStreamError(f"unreadable publish acknowledgement: {msg.data[:100]!r}") from e
    raise_for_reply(body)
    return PubAck(body["stream"], int(body["seq"]), bool(body.get("duplicate", False)))


class JetStreamApi:
    """Typed wrappers over the ``$JS.API`` request subjects used by keyqueue."""

    def __init__(self, nc: Client, *, timeout: float = API_TIMEOUT, prefix: str = "$JS.API") -> None:
        self.nc = nc
        self.timeout = timeout
        self.prefix = prefix

    async def request(self, subject: str, payload: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> dict[str, Any]:
        """Send one API request and return its decoded reply, raising typed errors."""
        data = json.dumps(payload).encode() if payload is not None else b""
        msg = await self._request(f"{self.prefix}.{subject}", data, timeout)
        try:
            # A big reply (a page of 100k subjects) would hold the loop, and every lease, for
            # tens of milliseconds: parse it in a thread.
            body: dict[str, Any] = (json.loads(msg.data) if len(msg.data) < LARGE_REPLY
                                    else await asyncio.to_thread(json.loads, msg.data))
        except ValueError as e:
            raise JetStreamError(f"unreadable reply to {subject}: {msg.data[:100]!r}") from e
        raise_for_reply(body)
        return body

    async def _request(self, subject: str, data: bytes, timeout: float | None,
                       headers: dict[str, str] | None = None) -> Msg:
        if self.nc.is_reconnecting:
            # nats-py would refuse it too, but leave the request's reply future in its map for good.
            raise disconnected(f"the request to {subject}")
        try:
            request = self.nc.request(subject, data, timeout=timeout or self.timeout, headers=headers)
            link = link_of(self.nc)
            # A reply the connection took with it never comes: say so at once, not after the timeout.
            return await (request if link is None else link.until_dropped(request, f"the request to {subject}"))
        except nats.errors.NoRespondersError as e:
            raise ConnectionFailed(
                f"no responders for {subject}: JetStream is not enabled on the server at "
                f"{self.nc.connected_url}, or (in a cluster) it has no leader for this yet: try again in a moment"
            ) from e
        except (TimeoutError, nats.errors.TimeoutError) as e:
            raise KeyqueueTimeout(f"no reply to {subject} within {timeout or self.timeout}s") from e
        except CONNECTION_DOWN as e:
            raise not_sent(e, f"the request to {subject}") from e

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> PubAck:
        """One JetStream publish, awaited: its PubAck, or the typed error of its refusal."""
        return parse_pub_ack(await self._request(subject, data, timeout, headers))

    # --- streams ---------------------------------------------------------------------------------

    async def stream_info(self, stream: str, *, subjects_filter: str | None = None,
                          offset: int = 0) -> dict[str, Any]:
        payload: dict[str, Any] | None = None
        if subjects_filter is not None:
            payload = {"subjects_filter": subjects_filter, "offset": offset}
        return await self.request(f"STREAM.INFO.{stream}", payload)

    async def subjects(self, stream: str, subjects_filter: str) -> dict[str, int]:
        """Every subject matching the filter that holds messages, with its message count."""
        found: dict[str, int] = {}
        offset = 0
        while True:
            info = await self.stream_info(stream, subjects_filter=subjects_filter, offset=offset)
            page = info.get("state", {}).get("subjects") or {}
            found.update(page)
            total = int(info.get("total", 0))
            offset += len(page)
            if not page or offset >= total:
                return found

    async def add_stream(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request(f"STREAM.CREATE.{config['name']}", config)

    async def stream_or_create(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The configuration of stream ``config['name']`` on the server, created from ``config`` if
        it is missing (also when another process creates it at the same moment); the caller checks
        the fields it relies on."""
        name = config["name"]
        try:
            return dict((await self.stream_info(name))["config"])
        except StreamNotFound:
            pass
        try:
            return dict((await self.add_stream(config))["config"])
        except JetStreamError as refused:
            try:
                return dict((await self.stream_info(name))["config"])  # another process created it first
            except StreamNotFound:
                raise refused from None

    async def delete_stream(self, stream: str) -> None:
        await self.request(f"STREAM.DELETE.{stream}")

    async def delete_msg(self, stream: str, seq: int, *, no_erase: bool = True) -> bool:
        """Delete one message by sequence; whether it was there (one already gone is no error);
        ``no_erase`` skips the costly overwrite on disk."""
        try:
            body = await self.request(f"STREAM.MSG.DELETE.{stream}", {"seq": seq, "no_erase": no_erase})
        except JetStreamError as e:
            if message_gone(e):
                return False
            raise
        return bool(body.get("success"))

    async def purge(self, stream: str, *, subject: str | None = None, up_to_seq: int | None = None) -> int:
        """Purge a stream, or one subject, optionally only below ``up_to_seq`` (exclusive)."""
        payload: dict[str, Any] = {}
        if subject is not None:
            payload["filter"] = subject
        if up_to_seq is not None:
            payload["seq"] = up_to_seq
        body = await self.request(f"STREAM.PURGE.{stream}", payload)
        return int(body.get("purged", 0))

    async def get_msg(self, stream: str, *, seq: int | None = None, next_by_subject: str | None = None,
                      last_by_subject: str | None = None, direct: bool = True) -> StoredMsg | None:
        """Read one message; None when there is none.

        With ``next_by_subject`` it is the first message on that subject at or after ``seq``.
        ``direct`` uses the direct-get API (served by any replica with ``allow_direct``), else
        the leader-only ``STREAM.MSG.GET``.
        """
        payload = _given(seq=seq, next_by_subj=next_by_subject, last_by_subj=last_by_subject)
        if direct:
            return direct_reply(await self._request(f"{self.prefix}.DIRECT.GET.{stream}",
                                                    json.dumps(payload).encode(), None))
        try:
            body = await self.request(f"STREAM.MSG.GET.{stream}", payload)
        except MessageNotFound:
            return None
        return stored_from_json(body["message"])

    async def get_batch(self, stream: str, *, seq: int | None = None, batch: int = 1000,
                        next_by_subject: str | None = None, start_time: str | None = None,
                        multi_last: list[str] | None = None, up_to_seq: int | None = None,
                        timeout: float | None = None) -> tuple[list[StoredMsg], int]:
        """Up to ``batch`` messages in one round trip (a batched direct get, nats-server >= 2.11):
        from ``seq`` or from ``start_time`` (RFC 3339) on, optionally only on ``next_by_subject``
        (wildcards allowed); or, with ``multi_last``, the last message of every subject matching
        those filters (at or below ``up_to_seq`` if given). Returns the messages in stream order
        and how many more match after them (0 when the server does not say).

        The stream needs ``allow_direct``; ``StreamNotFound`` if it does not exist.
        """
        payload = _given(batch=batch, seq=seq, next_by_subj=next_by_subject, start_time=start_time,
                         multi_last=multi_last, up_to_seq=up_to_seq)
        subject = f"{self.prefix}.DIRECT.GET.{stream}"
        if self.nc.is_reconnecting:
            raise disconnected(f"the batched read of {stream}")
        replies: asyncio.Queue[Msg] = asyncio.Queue()

        async def received(msg: Msg) -> None:
            replies.put_nowait(msg)

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=received)
        found: list[StoredMsg] = []
        try:
            await self.nc.publish(subject, json.dumps(payload).encode(), reply=inbox)
            async with asyncio.timeout(timeout or self.timeout):
                while True:
                    msg = await replies.get()
                    headers = msg.headers or {}
                    status = headers.get(STATUS)
                    if not status:
                        found.append(stored_from_direct(msg))
                    elif status == "204":  # end of the batch
                        return found, int(headers.get("Nats-Num-Pending", "0") or 0)
                    elif status == "404":
                        return found, 0
                    elif status == "503":
                        await self.stream_info(stream)  # StreamNotFound when that is why
                        raise ConnectionFailed(f"nobody answered the batched read of {stream} (no responders)")
                    else:
                        raise from_api_error(headers.get(DESCRIPTION, "batched direct get failed"), int(status))
        except TimeoutError as e:
            raise KeyqueueTimeout(f"the batched read of {stream} got no end of batch within "
                                  f"{timeout or self.timeout}s") from e
        except CONNECTION_DOWN as e:
            raise not_sent(e, f"the batched read of {stream}") from e
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def pages(self, stream: str, subject_filter: str = ">", *, seq: int = 1, start_time: str | None = None,
                    batch: int = 1000, limit: int | None = None) -> AsyncIterator[list[StoredMsg]]:
        """The messages of ``stream`` on subjects matching ``subject_filter`` in stream order from
        ``seq`` (or from the first stored at or after ``start_time``, RFC 3339), a page at a time,
        at most ``limit`` in all.

        Batched direct gets where the stream allows them; one ``STREAM.MSG.GET`` per message where
        it does not (a replicated stream), which is slower but reads the same messages.
        """
        direct = True
        read = 0
        while limit is None or read < limit:
            want = batch if limit is None else min(batch, limit - read)
            page: list[StoredMsg] = []
            if direct:
                try:
                    page, more = await self.get_batch(stream, seq=None if start_time else seq, batch=want,
                                                      next_by_subject=subject_filter, start_time=start_time)
                except ConnectionFailed:
                    if self.nc.is_closed or self.nc.is_reconnecting:
                        raise
                    direct = False  # nobody answers direct gets: the stream does not allow them
                    continue
            else:
                want = min(want, 100)
                while len(page) < want:
                    if start_time is not None:
                        msg = await self._first_at(stream, start_time, subject_filter)
                        start_time = None
                    else:
                        msg = await self.get_msg(stream, seq=seq, next_by_subject=subject_filter, direct=False)
                    if msg is None:
                        break
                    page.append(msg)
                    seq = msg.seq + 1
                more = int(len(page) == want)
            start_time = None
            if page:
                read += len(page)
                seq = page[-1].seq + 1
                yield page
            if not page or not more:
                return

    async def _first_at(self, stream: str, start_time: str, subject_filter: str) -> StoredMsg | None:
        """The first message stored at or after ``start_time`` (on ``subject_filter``), leader-only."""
        try:
            body = await self.request(f"STREAM.MSG.GET.{stream}", {"start_time": start_time,
                                                                    "next_by_subj": subject_filter})
        except MessageNotFound:
            return None
        return stored_from_json(body["message"])

    # --- consumers -------------------------------------------------------------------------------

    async def consumer_info(self, stream: str, consumer: str) -> dict[str, Any]:
        return await self.request(f"CONSUMER.INFO.{stream}.{consumer}")

    async def add_consumer(self, stream: str, config: Mapping[str, Any]) -> dict[str, Any]:
        name = config["durable_name"]
        return await self.request(f"CONSUMER.CREATE.{stream}.{name}",
                                  {"stream_name": stream, "config": config, "action": "create"})

    async def delete_consumer(self, stream: str, consumer: str) -> None:
        await self.request(f"CONSUMER.DELETE.{stream}.{consumer}")

    async def unpin(self, stream: str, consumer: str, group: str) -> None:
        await self.request(f"CONSUMER.UNPIN.{stream}.{consumer}", {"group": group})

    async def account_info(self) -> dict[str, Any]:
        return await self.request("INFO")


def _given(**fields: Any) -> dict[str, Any]:
    """A request's fields, those not given (None) left out."""
    return {name: value for name, value in fields.items() if value is not None}


def direct_reply(msg: Msg) -> StoredMsg | None:
    """The message a (single) direct get answered with; None for its 404 (no such message)."""
    headers = msg.headers or {}
    status = headers.get(STATUS)
    if status == "404":
        return None
    if status:
        raise from_api_error(headers.get(DESCRIPTION, "direct get failed"), int(status))
    return stored_from_direct(msg)


def stored_from_direct(msg: Msg) -> StoredMsg:
    """A StoredMsg from a direct-get reply (the stream's own headers say where it came from)."""
    headers = msg.headers or {}
    return StoredMsg(
        subject=headers["Nats-Subject"],
        seq=int(headers["Nats-Sequence"]),
        headers={k: v for k, v in headers.items() if not k.startswith("Nats-") or k == "Nats-Msg-Id"},
        data=msg.data,
        timestamp=headers.get("Nats-Time-Stamp", ""),
    )


def stored_from_json(message: Mapping[str, Any]) -> StoredMsg:
    """A StoredMsg from the JSON form ``STREAM.MSG.GET`` returns (base64 headers and data)."""
    import base64

    headers: dict[str, str] = {}
    raw = message.get("hdrs")
    if raw:
        lines = base64.b64decode(raw).decode(errors="replace").split("\r\n")[1:]
        for line in lines:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip()] = value.strip()
    data = base64.b64decode(message.get("data", "")) if message.get("data") else b""
    return StoredMsg(message["subject"], int(message["seq"]), headers, data, message.get("time", ""))
