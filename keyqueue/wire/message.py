"""Versioned message types and the registry that knows their upgrade chains.

A message type is a frozen dataclass subclassing ``Message``; ``TYPE`` is its name on the wire
(``X-MESSAGE-TYPE``) and ``VERSION`` its version (``X-MESSAGE-VERSION``). Every version after
the first is its own class, which builds itself from the previous version in ``upgrade``::

    registry = Registry()

    @registry.register
    @dataclass(frozen=True)
    class ReviewV1(Message):
        TYPE = "Review"
        VERSION = 1
        repo: str

    @registry.register
    @dataclass(frozen=True)
    class ReviewV2(Message):
        TYPE = "Review"
        VERSION = 2
        repo: str
        branch: str

        @classmethod
        def upgrade(cls, previous: Message) -> Self:
            assert isinstance(previous, ReviewV1)  # the registry passes exactly version 1
            return cls(repo=previous.repo, branch="main")

A process reading a v1 message gets a ``ReviewV2``. There is no global registry: whoever owns
the message types (an app, a test) creates a ``Registry`` and passes it where messages are
decoded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Final, Self, TypeVar

from ulid import ULID

from keyqueue.errors import ConfigError, MalformedBody, UnknownMessageType, UnsupportedVersion
from keyqueue.wire.fields import check_annotations

__all__ = ["Message", "Registry", "new_request_id"]

M = TypeVar("M", bound="Message")

_TYPE_NAME: Final = re.compile(r"[^\x00-\x20\x7f](?:[^\x00-\x1f\x7f]*[^\x00-\x20\x7f])?")


def new_request_id() -> str:
    """A new request id: a ULID string (26 characters, sortable by creation time)."""
    return str(ULID())


@dataclass(frozen=True)
class Message:
    """Base of every message type: a frozen dataclass with a wire name and a version."""

    TYPE: ClassVar[str]
    """The message type's name on the wire (``X-MESSAGE-TYPE``); the same for all its versions."""

    VERSION: ClassVar[int]
    """This class's version (``X-MESSAGE-VERSION``): 1 for the first, then 2, 3, ..."""

    @classmethod
    def upgrade(cls, previous: Message) -> Self:
        """Build this version from an instance of the previous version (``VERSION - 1``).

        Every version after 1 must define it; the registry calls it with an instance of exactly
        the previous version's registered class. An exception raised here makes the message a
        ``MalformedBody``.
        """
        raise NotImplementedError(
            f"{cls.__qualname__} (version {cls.VERSION}) defines no upgrade from version {cls.VERSION - 1}"
        )


class Registry:
    """Message types by name, each a contiguous chain of versions 1..N.

    Chains are checked while they are registered, so a broken chain fails at import time and
    never when a message arrives: the versions of a type must be registered in order (1, then
    2, ...), and a duplicate, a gap, or a version after 1 that does not define ``upgrade`` is a
    ``ConfigError``. Registering the same class again changes nothing.
    """

    def __init__(self) -> None:
        self._chains: dict[str, list[type[Message]]] = {}

    def register(self, cls: type[M]) -> type[M]:
        """Add ``cls`` as the next version of its type; returns ``cls`` (usable as a decorator)."""
        type_name, version = _validate(cls)
        chain = self._chains.get(type_name, [])
        if version <= len(chain) and chain[version - 1] is cls:
            return cls
        if version <= len(chain):
            raise ConfigError(
                f"{type_name} version {version} is registered twice: "
                f"{chain[version - 1].__qualname__} and {cls.__qualname__}"
            )
        if version != len(chain) + 1:
            raise ConfigError(
                f"{cls.__qualname__}: {type_name} version {version} registered after version "
                f"{len(chain)}; register the versions of a type in order, 1, 2, 3, ... without gaps"
            )
        if version > 1 and "upgrade" not in vars(cls):
            raise ConfigError(
                f"{cls.__qualname__} ({type_name} version {version}) must define the classmethod "
                f"upgrade(cls, previous) that builds it from version {version - 1}"
            )
        self._chains[type_name] = [*chain, cls]
        return cls

    def known_types(self) -> tuple[str, ...]:
        """The registered type names, sorted."""
        return tuple(sorted(self._chains))

    def latest(self, type_name: str) -> type[Message]:
        """The newest registered version of ``type_name`` (``UnknownMessageType`` if none)."""
        return self._chain(type_name)[-1]

    def get(self, type_name: str, version: int) -> type[Message]:
        """The class of ``version`` of ``type_name``; ``UnsupportedVersion`` outside 1..latest."""
        chain = self._chain(type_name)
        if not 1 <= version <= len(chain):
            raise UnsupportedVersion(type_name, version, len(chain))
        return chain[version - 1]

    def upgrade(self, msg: Message) -> Message:
        """``msg`` upgraded through each later version to the latest one (``msg`` if it is latest).

        An ``upgrade`` that raises, or returns something other than an instance of its class,
        is a ``MalformedBody`` naming both versions.
        """
        cls = type(msg)
        chain = self._chain(cls.TYPE)
        if self.get(cls.TYPE, cls.VERSION) is not cls:
            raise ConfigError(f"{cls.__qualname__} is not the registered class of {cls.TYPE} v{cls.VERSION}")
        current = msg
        for target in chain[cls.VERSION :]:
            step = f"{cls.TYPE}: upgrading version {current.VERSION} to {target.VERSION}"
            try:
                upgraded = target.upgrade(current)
            except Exception as exc:
                raise MalformedBody(f"{step} failed: {type(exc).__name__}: {exc}") from exc
            if type(upgraded) is not target:
                raise MalformedBody(
                    f"{step} returned {type(upgraded).__qualname__}, not {target.__qualname__}"
                )
            current = upgraded
        return current

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._chains

    def _chain(self, type_name: str) -> list[type[Message]]:
        chain = self._chains.get(type_name)
        if chain is None:
            raise UnknownMessageType(type_name, self.known_types())
        return chain


def _validate(cls: type[Message]) -> tuple[str, int]:
    """Check that ``cls`` can be a message type; return its (TYPE, VERSION)."""
    if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
        raise ConfigError(f"{cls!r} is not a subclass of keyqueue.wire.Message")
    params = vars(cls).get("__dataclass_params__")
    if params is None or not params.frozen:
        raise ConfigError(f"{cls.__qualname__} must be decorated with @dataclass(frozen=True)")
    type_name = getattr(cls, "TYPE", None)
    if not isinstance(type_name, str) or not _TYPE_NAME.fullmatch(type_name):
        raise ConfigError(
            f"{cls.__qualname__}.TYPE must be a non-empty single-line string without surrounding "
            f"spaces (it is a header value), got {type_name!r}"
        )
    version = getattr(cls, "VERSION", None)
    if type(version) is not int or version < 1:
        raise ConfigError(f"{cls.__qualname__}.VERSION must be a positive int, got {version!r}")
    check_annotations(cls)
    return type_name, version
