"""``keyqueue watch QUEUE KEY``: follow a key's live progress (what tasks publish with ``ctx.progress``).

KEY may be a pattern (``KeyPattern``): NATS wildcards as whole tokens, which the server matches,
and shell-style wildcards inside a token, which the server cannot match: their token subscribes
as ``*`` and this command keeps the keys that match.
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import click

from keyqueue.cli.common import connection, follow, require_queue, to_json, url_option
from keyqueue.errors import ConfigError, WireError
from keyqueue.jetstream.api import JetStreamApi
from keyqueue.jetstream.subjects import QueueNames
from keyqueue.wire import CBOR, loads
from keyqueue.wire import headers as H

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["KeyPattern", "watch"]

_SHELL_WILDCARDS: Final = re.compile(r"[*?\[]")
_NOT_IN_TOKEN: Final = re.compile(r"[\s\x00-\x1f\x7f>]")
_WHICH_WORK: Final = ("'*' as a whole token matches one token (orders.*), '>' as the last token matches the rest "
                      "(orders.>, or > for every key), and '*', '?', '[...]' inside a token match within it (acc*)")


@dataclass(frozen=True)
class KeyPattern:
    """A key, or a pattern of keys, as ``watch`` takes it."""

    tokens: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> KeyPattern:
        """``text`` as a pattern; ``ConfigError`` (one line saying which wildcards work) if it is not one."""
        tokens = tuple(text.split("."))
        for index, token in enumerate(tokens):
            if not token:
                problem = "it has an empty token (leading, trailing or doubled '.')"
            elif token == ">" and index < len(tokens) - 1:
                problem = "'>' may only be the last token"
            elif token != ">" and (bad := _NOT_IN_TOKEN.search(token)):
                problem = f"{bad.group()!r} may not be part of a token"
            else:
                continue
            raise ConfigError(f"key pattern {text!r} is not valid: {problem}; {_WHICH_WORK}")
        return cls(tokens)

    @property
    def subject_suffix(self) -> str:
        """What the server matches: a token with shell-style wildcards becomes ``*``."""
        return ".".join("*" if self._shell_style(t) else t for t in self.tokens)

    @property
    def filtered(self) -> bool:
        """Whether the server's matches must be filtered here (some token is shell-style)."""
        return any(self._shell_style(t) for t in self.tokens)

    def matches(self, key: str) -> bool:
        """Whether ``key`` matches, token by token (``>`` takes one or more remaining tokens)."""
        keys = key.split(".")
        if self.tokens[-1] == ">":
            pattern = self.tokens[:-1]
            if len(keys) <= len(pattern):
                return False
            keys = keys[: len(pattern)]
        else:
            pattern = self.tokens
        return len(keys) == len(pattern) and all(fnmatch.fnmatchcase(k, p) for k, p in zip(keys, pattern, strict=True))

    @staticmethod
    def _shell_style(token: str) -> bool:
        return token != "*" and _SHELL_WILDCARDS.search(token) is not None


def _progress_line(msg: Msg) -> str:
    headers = msg.headers or {}
    try:
        value: Any = loads(msg.data, headers.get(H.CONTENT_TYPE, CBOR)) if msg.data else None
    except WireError as exc:
        value = f"<undecodable: {exc}>"
    stamp = datetime.now(UTC).strftime("%H:%M:%S.%f")[:-3]
    key = msg.subject.split(".", 3)[-1]
    return f"{stamp} {key} {headers.get(H.REQUEST_ID, '-')} {to_json(value)}"


@click.command()
@click.argument("queue")
@click.argument("key")
@click.option("--count", type=click.IntRange(1), help="Exit after this many progress messages.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), help="Exit after this many seconds.")
@url_option
def watch(queue: str, key: str, count: int | None, timeout: float | None, url: str | None) -> None:
    """Follow a key's live progress (what tasks publish with ctx.progress(...)).

    KEY may be a pattern, to follow many keys (quote it for the shell): '*' as a whole token
    matches any one token (orders.*), '>' as the last token matches the rest (orders.>, or >
    for every key), and '*', '?' or '[...]' inside a token match within that token, as in the
    shell (acc* matches acc1 and accounts, not acc.1). Runs until Ctrl-C, --count messages or
    --timeout seconds.

    \b
    Examples:
      $ keyqueue watch shop o1
      12:00:01.250 o1 01J... {"step": "authorising"}
      $ keyqueue watch shop 'acc*' --count 10
    """
    pattern = KeyPattern.parse(key)
    names = QueueNames(queue)

    def render(msg: Msg) -> str | None:
        if pattern.filtered and not pattern.matches(names.key_of(msg.subject)):
            return None
        return _progress_line(msg)

    async def run() -> None:
        async with connection(url) as nc:
            await require_queue(JetStreamApi(nc), queue)
            await follow(nc, [names.progress(pattern.subject_suffix)], render, count=count, timeout=timeout,
                         banner=f"watching {queue} {key} (Ctrl-C to stop)")

    asyncio.run(run())
