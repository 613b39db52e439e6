"""How a task's arguments and result travel: one versioned CBOR message each way.

A request is a message whose ``X-MESSAGE-TYPE`` is the task's name, ``X-MESSAGE-VERSION`` the
task's version, and whose body is a CBOR map from parameter name to value (defaults applied, so
the message says exactly what runs). Values must be plain (``keyqueue.wire.check_plain``); a
parameter annotated with a frozen dataclass travels as that dataclass's fields. A reply carries
the result as one CBOR value (a dataclass result as its fields) and ``X-KQ-Status``.

A receiver reads the headers first: an unknown task, a version newer than the task's, or a
malformed body is a ``WireError``, which the worker dead-letters at once. Older versions are
upgraded through the task's ``upgrades`` (version ``v`` -> ``v + 1``, in order).
"""

from __future__ import annotations

import dataclasses
import inspect
import string
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final

from keyqueue.errors import (
    Cancelled,
    ConfigError,
    DeadLettered,
    Expired,
    MalformedBody,
    RemoteError,
    Superseded,
    UnsupportedVersion,
)
from keyqueue.jetstream.subjects import UNKEYED, validate_key
from keyqueue.tasks.argument_types import ArgumentTypes
from keyqueue.tasks.context import Context
from keyqueue.wire import CBOR, check_plain, decode_envelope_fields, dumps, from_fields, loads, to_fields
from keyqueue.wire import headers as H

__all__ = [
    "CANCELLED_BY",
    "EXPIRED_BY",
    "ArgumentCodec",
    "KeyMaker",
    "Upgrade",
    "check_upgrades",
    "decode_arguments",
    "decode_result",
    "encode_result",
    "result_headers",
    "takes_context",
    "upgrade_arguments",
]

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns the arguments of version ``v`` of a task into those of version ``v + 1``."""

_CONTEXT_NAME: Final = "ctx"

EXPIRED_BY: Final = "(expired)"
"""``X-KQ-Superseded-By`` of the reply to a request whose ``expires`` time passed before it started."""

CANCELLED_BY: Final = "(cancelled)"
"""``X-KQ-Superseded-By`` of the reply to a request cancelled before it started (status ``superseded``,
so the key session removes it like a superseded request); no request id has a space, so none is confused with it."""


def takes_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s first parameter receives the ``Context``.

    It does when annotated ``Context`` (or a subclass; a string annotation ending in ``Context``
    counts when it cannot be resolved) or, unannotated, when it is named ``ctx``.
    """
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return False
    first = params[0]
    annotation = _hints(fn).get(first.name, first.annotation)
    if annotation is inspect.Parameter.empty:
        return first.name == _CONTEXT_NAME
    if isinstance(annotation, str):
        return annotation.strip("'\"").rsplit(".", 1)[-1] == "Context"
    return isinstance(annotation, type) and issubclass(annotation, Context)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation naming something not importable here: go without hints
        return {}


def _dataclass_type(hint: Any) -> type | None:
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


# --- arguments -----------------------------------------------------------------------------------


class ArgumentCodec:
    """A task function's parameters (less the context): arguments to a message body and back."""

    def __init__(self, fn: Callable[..., Any], task: str) -> None:
        self.task = task
        self.takes_context = takes_context(fn)
        params = list(inspect.signature(fn).parameters.values())
        if self.takes_context:
            params = params[1:]
        self.signature = inspect.Signature(params)
        hints = _hints(fn)
        self.dataclass_params: dict[str, type] = {
            p.name: cls
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and (cls := _dataclass_type(hints.get(p.name))) is not None
        }
        self.result_dataclass = _dataclass_type(hints.get("return"))
        self.types = ArgumentTypes(task, self.signature.parameters, hints)
        # to_call's fast path, for functions whose parameters all take plain values by name (most):
        # the names in order (True for keyword-only ones), which are required, and all of them.
        simple = not self.dataclass_params and all(
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        self._plan: tuple[tuple[str, bool], ...] | None = (
            tuple((p.name, p.kind is p.KEYWORD_ONLY) for p in params) if simple else None)
        self._names = frozenset(p.name for p in params)
        self._required = frozenset(p.name for p in params if p.default is p.empty)

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        """Bind call arguments like a call to the function would, and check them against the annotations.

        ``TypeError`` if they do not fit the signature or an argument does not fit its annotation
        (see ``argument_types``; defaults are not checked).
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.task}(): {exc}") from None
        self.types.check(bound.arguments)
        bound.apply_defaults()
        return bound

    def to_fields(self, bound: inspect.BoundArguments) -> dict[str, Any]:
        """The body's field map: plain values only (``MalformedBody`` naming the argument)."""
        fields: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            plain = to_fields(value) if name in self.dataclass_params and dataclasses.is_dataclass(value) else value
            check_plain(plain, CBOR, path=f"{self.task}: argument {name!r}")
            fields[name] = plain
        return fields

    def encode(self, fields: Mapping[str, Any]) -> bytes:
        return dumps(dict(fields), CBOR)

    def to_call(self, fields: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments for the function from a decoded field map.

        ``MalformedBody`` if the fields do not fit the function's signature.
        """
        plan = self._plan
        if plan is not None and self._required <= fields.keys() <= self._names:
            # Every field names a parameter and every required one is there, so the call binds:
            # the same arguments as below, without building and checking a BoundArguments.
            args: list[Any] = []
            kwargs: dict[str, Any] = {}
            positional = True  # as below: positional until the first parameter left out
            for name, keyword_only in plan:
                if name not in fields:
                    positional = positional and keyword_only
                elif positional and not keyword_only:
                    args.append(fields[name])
                else:
                    kwargs[name] = fields[name]
            return args, kwargs
        return self._to_call(fields)

    def _to_call(self, fields: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        remaining = dict(fields)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        positional = True  # positional until the first gap, so a following *args can be filled
        for param in self.signature.parameters.values():
            if param.name not in remaining:
                positional = positional and param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
                continue
            value = remaining.pop(param.name)
            if param.name in self.dataclass_params and isinstance(value, dict):
                value = from_fields(self.dataclass_params[param.name], value)
            if param.kind is param.POSITIONAL_ONLY or (param.kind is param.POSITIONAL_OR_KEYWORD and positional):
                args.append(value)
            elif param.kind is param.VAR_POSITIONAL:
                if not isinstance(value, list | tuple):
                    raise MalformedBody(f"{self.task}: *{param.name} must be an array, not {type(value).__name__}")
                args.extend(value)
            elif param.kind is param.VAR_KEYWORD:
                if not isinstance(value, dict):
                    raise MalformedBody(f"{self.task}: **{param.name} must be a map, not {type(value).__name__}")
                kwargs.update(value)
            else:
                kwargs[param.name] = value
        if remaining:
            raise MalformedBody(f"{self.task}: unexpected argument(s) {', '.join(sorted(remaining))}")
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise MalformedBody(f"{self.task}: the arguments do not fit its signature: {exc}") from None
        return args, kwargs


def decode_arguments(
    task: str, version: int, upgrades: Mapping[int, Upgrade], headers: Mapping[str, str], body: bytes
) -> dict[str, Any]:
    """The arguments of a request of ``task``, upgraded to ``version``; ``WireError`` if unreadable."""
    envelope, fields = decode_envelope_fields(headers, body)
    return upgrade_arguments(task, version, upgrades, envelope.version, fields)


def upgrade_arguments(
    task: str, version: int, upgrades: Mapping[int, Upgrade], received: int, fields: dict[str, Any]
) -> dict[str, Any]:
    """``fields``, the arguments of version ``received`` of ``task``, upgraded to ``version``.

    ``UnsupportedVersion`` if ``received`` is newer than ``version``, ``MalformedBody`` if an
    upgrade fails.
    """
    if received > version:
        raise UnsupportedVersion(task, received, version)
    for step in range(received, version):
        try:
            upgraded = upgrades[step](dict(fields))
        except Exception as exc:
            raise MalformedBody(f"{task}: upgrading version {step} to {step + 1} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(upgraded, dict):
            raise MalformedBody(
                f"{task}: the upgrade from version {step} returned {type(upgraded).__name__}, not a dict"
            )
        fields = upgraded
    return fields


def check_upgrades(task: str, version: int, upgrades: Mapping[int, Upgrade]) -> None:
    """Raise ``ConfigError`` unless ``upgrades`` covers exactly versions 1 .. ``version - 1``."""
    if type(version) is not int or version < 1:
        raise ConfigError(f"task {task}: version must be a positive int, got {version!r}")
    wanted = set(range(1, version))
    if set(upgrades) != wanted:
        shown = ", ".join(f"{v}: <v{v} -> v{v + 1}>" for v in sorted(wanted)) or "none"
        raise ConfigError(
            f"task {task} is version {version}, so it needs upgrades for versions {sorted(wanted) or 'none'} "
            f"(upgrades={{{shown}}}), got {sorted(upgrades)}"
        )


# --- keys ----------------------------------------------------------------------------------------


class KeyMaker:
    """A task's key: a template over its arguments (``"{order_id}"``), a callable returning one, or
    None for an unkeyed task (every request's key is then :data:`~keyqueue.jetstream.subjects.UNKEYED`)."""

    def __init__(self, key: str | Callable[..., str] | None, task: str, parameters: tuple[str, ...] | None) -> None:
        self.task = task
        self.unkeyed = key is None
        """No key: the task's requests go to the queue's work stream and run without exclusivity."""
        self.template: str | None = None
        self.function: Callable[..., str] | None = None
        if isinstance(key, str):
            self.template = key
            self._check_template(key, parameters)
        elif callable(key):
            self.function = key
        elif key is not None:
            raise ConfigError(f"task {task}: key must be a template string or a callable, not {key!r}")

    def _check_template(self, template: str, parameters: tuple[str, ...] | None) -> None:
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ConfigError(f"task {self.task}: key template {template!r} is not valid: {exc}") from None
        for _, field, _, _ in parsed:
            if field is None:
                continue
            root = field.split(".", 1)[0].split("[", 1)[0]
            if not root or root.isdigit():
                raise ConfigError(
                    f"task {self.task}: key template {template!r} must name arguments, like '{{order_id}}'"
                )
            if parameters is not None and root not in parameters:
                raise ConfigError(
                    f"task {self.task}: key template {template!r} names {root!r}, which is not one of its "
                    f"parameters ({', '.join(parameters) or 'none'})"
                )

    def make(self, values: Mapping[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The key for one request: ``values`` fill the template, ``args``/``kwargs`` go to a callable."""
        if self.unkeyed:
            return UNKEYED
        if self.function is not None:
            key = self.function(*args, **kwargs)
        else:
            assert self.template is not None
            try:
                key = self.template.format_map(values)
            except (KeyError, AttributeError, IndexError, ValueError) as exc:
                raise ConfigError(f"task {self.task}: key template {self.template!r} failed: {exc!r}") from None
        if not isinstance(key, str):
            raise ConfigError(f"task {self.task}: the key function returned {type(key).__name__}, not str")
        return validate_key(key)


# --- results -------------------------------------------------------------------------------------


def encode_result(value: Any, task: str) -> bytes:
    """A task's return value as a reply body (``MalformedBody`` if it is not plain)."""
    plain = to_fields(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value
    return dumps(plain, CBOR, path=f"the result of {task}")


def result_headers(task: str, version: int) -> dict[str, str]:
    """Headers of a result reply (the session adds the status and the request id)."""
    return {H.CONTENT_TYPE: CBOR, H.MESSAGE_TYPE: f"{task}.result", H.MESSAGE_VERSION: str(version)}


def decode_result(headers: Mapping[str, str], body: bytes, request_id: str, result_type: type | None = None) -> Any:
    """The result a reply carries, or the typed error it reports.

    ``Superseded`` (policy ``latest``), ``Cancelled`` (cancelled before it started), ``DeadLettered``
    (with the remote error's type name and message), ``RemoteError`` for any other failure status.
    """
    status = headers.get(H.STATUS, "")
    error_type = headers.get(H.ERROR_TYPE, "")
    message = headers.get(H.ERROR_MESSAGE, "")
    if status == H.STATUS_OK:
        if not body:
            return None
        value = loads(body, headers.get(H.CONTENT_TYPE, CBOR).split(";", 1)[0].strip().lower())
        if result_type is not None and isinstance(value, dict):
            return from_fields(result_type, value)
        return value
    if status == H.STATUS_SUPERSEDED:
        if headers.get(H.SUPERSEDED_BY) == CANCELLED_BY:
            raise Cancelled(request_id)
        if headers.get(H.SUPERSEDED_BY) == EXPIRED_BY:
            raise Expired(request_id)
        raise Superseded(request_id, headers.get(H.SUPERSEDED_BY, "unknown"))
    if status == H.STATUS_DEAD_LETTERED:
        reason = headers.get(H.DLQ_REASON, "")
        raise DeadLettered(error_type or "DeadLettered", message or f"dead-lettered ({reason})", request_id,
                           reason=reason or "")
    raise RemoteError(error_type or "RemoteError", message or f"the worker replied with status {status!r}", request_id)

