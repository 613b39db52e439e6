"""The OpenTelemetry plugin: a PRODUCER span per enqueue, a CONSUMER span per processing attempt.

Trace context travels in the request's headers (W3C ``traceparent`` / ``tracestate``, through
the globally configured propagator): ``keyqueue_wrap_enqueue`` injects the producer span's
context, ``keyqueue_wrap_process`` extracts it, so the process span is the enqueue span's child
and one trace runs from the producer into the task (spans the task opens are children of the
process span). A batch's process span is parented on its first request and linked to the others.
Each key session is a ``key session <queue>`` span of its own (a trace root, INTERNAL), from the
key's acquisition to its release.

``plugin`` (the entry-point object) uses the global tracer and meter providers and does nothing
while none is configured; ``OtelPlugin(tracer_provider=..., meter_provider=...)`` uses its own
(pass it to ``App(plugins=[...])``, e.g. in tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar

from opentelemetry import metrics as otel_metrics
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from keyqueue import hookimpl

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    from keyqueue import inline_observer
except ImportError:  # a keyqueue before inline observers: its worker queues these hooks, as it did
    def inline_observer(function: _F) -> _F:
        return function

if TYPE_CHECKING:
    from keyqueue import App, Request, RequestContext, TaskRequest, Worker

    from .metrics import Metrics

__all__ = ["INSTRUMENTATION", "OtelPlugin", "configure_from_env", "plugin"]

log = logging.getLogger("keyqueue.otel")

INSTRUMENTATION: Final = "keyqueue"
"""The instrumentation scope name of keyqueue's tracer and meter."""

SYSTEM: Final = "nats"

PROVIDER_RECHECK: Final = 1.0
"""Seconds between two lookups of OpenTelemetry's global providers (each reads the environment): a
provider configured after the worker started is used from at most this much later."""

_CONFIGURE_ENV: Final = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_configured = threading.Lock()
_configure_done = False


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("keyqueue")
    except Exception:
        return "0"


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Set up the OpenTelemetry SDK from the standard ``OTEL_*`` variables, once per process.

    Does nothing (returns False) when a tracer provider is already set (by the application,
    or by ``opentelemetry-instrument``), or when none of ``OTEL_TRACES_EXPORTER``,
    ``OTEL_METRICS_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. The exporters named must be
    installed (``opentelemetry-exporter-otlp`` for ``otlp``, the default).
    """
    global _configure_done
    env = os.environ if environ is None else environ
    with _configured:
        if _configure_done:
            return False
        _configure_done = True
        if not any(env.get(name) for name in _CONFIGURE_ENV):
            return False
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return False
        try:
            from opentelemetry.sdk._configuration import _OTelSDKConfigurator

            _OTelSDKConfigurator().configure()  # type: ignore[no-untyped-call]
        except Exception as exc:
            log.warning("OpenTelemetry is not configured from OTEL_* variables: %s: %s (is the exporter "
                        "installed? pip install %s)", type(exc).__name__, exc, " ".join(exporter_packages(env)))
            return False
        return True


_EXPORTER_PACKAGES: Final = {
    "otlp": "opentelemetry-exporter-otlp",
    "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http",
    "prometheus": "opentelemetry-exporter-prometheus",
    "zipkin": "opentelemetry-exporter-zipkin",
}
"""Exporter names of the ``OTEL_*_EXPORTER`` variables -> the distribution that provides them."""


def exporter_packages(environ: Mapping[str, str]) -> list[str]:
    """The distributions the exporters named by ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
    need (``otlp``, the default, when neither names one the SDK ships, such as ``console``)."""
    names = [name.strip() for variable in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER")
             for name in environ.get(variable, "otlp").split(",")]
    packages = [_EXPORTER_PACKAGES[name] for name in names if name in _EXPORTER_PACKAGES]
    return list(dict.fromkeys(packages)) or [_EXPORTER_PACKAGES["otlp"]]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


class _HeaderGetter(Getter[Mapping[str, str]]):
    """Reads trace context from NATS headers (case-insensitively)."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = _header(carrier, key.lower())
        return [value] if value is not None else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


_GETTER: Final = _HeaderGetter()

_ROOT: Final = trace.set_span_in_context(trace.INVALID_SPAN)
"""A context without a span: key-session spans start traces of their own."""


def _inbox_subject(queue: str, key: str) -> str:
    return f"kq.{queue}.in.{key}"


class _Enqueue:
    """Around one request's publish: its PRODUCER span and the ``enqueued`` metric."""

    def __init__(self, owner: OtelPlugin, tracer: trace.Tracer | None, request: TaskRequest) -> None:
        self.owner = owner
        self.tracer = tracer
        self.request = request
        self.span: trace.Span | None = None

    def __enter__(self) -> None:
        if self.tracer is None:
            return
        r = self.request
        self.span = self.tracer.start_span(
            f"publish {r.queue}", kind=SpanKind.PRODUCER,
            attributes={"messaging.system": SYSTEM, "messaging.operation": "publish",
                        "messaging.operation.type": "send",
                        "messaging.destination.name": _inbox_subject(r.queue, r.key),
                        "messaging.message.id": r.request_id, "keyqueue.queue": r.queue, "keyqueue.key": r.key,
                        "keyqueue.task": r.message_type})
        propagate.inject(r.headers, context=trace.set_span_in_context(self.span))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        receipt = self.request.receipt
        meters = self.owner.meters()
        if meters is not None and receipt is not None and not receipt.duplicate:
            meters.enqueued(self.request.queue, self.request.message_type)
        span = self.span
        if span is None:
            return
        if receipt is not None:
            span.set_attribute("keyqueue.seq", receipt.seq)
            span.set_attribute("keyqueue.duplicate", receipt.duplicate)
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()


class OtelPlugin:
    """keyqueue's OpenTelemetry plugin (tracing and metrics); see the module's docstring."""

    def __init__(self, *, tracer_provider: trace.TracerProvider | None = None, meter_provider: Any = None,
                 tracing: bool = True, metrics: bool = True) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracing = tracing
        self._tracer: trace.Tracer | None = None
        self._tracer_of: object = None
        self._sessions: dict[tuple[int, str, str], trace.Span] = {}
        """Open key-session spans by (worker, queue, key)."""
        self.metrics = metrics
        self._meters: Metrics | None = None
        self._meters_of: object = None
        self._tracer_now: trace.Tracer | None = None
        self._tracer_until = 0.0
        self._meters_now: Metrics | None = None
        self._meters_until = 0.0
        """What tracer() and meters() answer until these monotonic times (see PROVIDER_RECHECK)."""

    def tracer(self) -> trace.Tracer | None:
        """The tracer, or None while tracing is off or no tracer provider is configured.

        The global provider is looked up again at most every :data:`PROVIDER_RECHECK` seconds: the
        lookup reads the environment, and this is asked several times per request."""
        if not self.tracing:
            return None
        now = time.monotonic()
        if now < self._tracer_until:
            return self._tracer_now
        if self.tracer_provider is None:  # a provider of its own needs no lookup
            self._tracer_until = now + PROVIDER_RECHECK
        provider = self.tracer_provider or trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            self._tracer_now = None
            return None
        if self._tracer_of is not provider:
            self._tracer = trace.get_tracer(INSTRUMENTATION, _version(), tracer_provider=provider)
            self._tracer_of = provider
        self._tracer_now = self._tracer
        return self._tracer

    def meters(self) -> Metrics | None:
        """The instruments, or None while metrics are off or no meter provider is configured (looked
        up again at most every :data:`PROVIDER_RECHECK` seconds, as :meth:`tracer` says)."""
        if not self.metrics:
            return None
        now = time.monotonic()
        if now < self._meters_until:
            return self._meters_now
        if self.meter_provider is None:
            self._meters_until = now + PROVIDER_RECHECK
        provider = self.meter_provider or otel_metrics.get_meter_provider()
        if isinstance(provider, otel_metrics.NoOpMeterProvider) or type(provider).__name__ == "_ProxyMeterProvider":
            self._meters_now = None
            return None
        if self._meters_of is not provider:
            from .metrics import Metrics

            self._meters = Metrics(provider)
            self._meters_of = provider
        self._meters_now = self._meters
        return self._meters

    # --- hooks: tracing ---

    @hookimpl
    def keyqueue_register(self, app: App) -> None:
        if self.tracer_provider is None:
            configure_from_env()

    @hookimpl
    def keyqueue_wrap_enqueue(self, app: App, request: TaskRequest) -> _Enqueue | None:
        tracer = self.tracer()
        if tracer is None and self.meters() is None:
            return None
        return _Enqueue(self, tracer, request)

    @hookimpl
    def keyqueue_wrap_process(self, queue: str, key: str, requests: Sequence[Request],
                              context: RequestContext) -> Any:
        tracer = self.tracer()
        if tracer is None or not requests:
            return None
        return self._process(tracer, queue, key, requests, context)

    @contextlib.contextmanager
    def _process(self, tracer: trace.Tracer, queue: str, key: str, requests: Sequence[Request],
                 context: RequestContext) -> Iterator[trace.Span]:
        parent = propagate.extract(requests[0].headers, getter=_GETTER)
        links = []
        for request in requests[1:]:
            other = trace.get_current_span(propagate.extract(request.headers, getter=_GETTER)).get_span_context()
            if other.is_valid:
                links.append(Link(other))
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM, "messaging.operation": "process", "messaging.operation.type": "process",
            "messaging.destination.name": _inbox_subject(queue, key),
            "messaging.message.id": context.request_id or requests[0].request_id,
            "keyqueue.queue": queue, "keyqueue.key": key, "keyqueue.attempt": context.attempt,
            "keyqueue.fencing": [int(context.fencing[0]), int(context.fencing[1])],
            "keyqueue.seq": requests[0].seq,
        }
        message_type = _header(requests[0].headers, "x-message-type")
        if message_type:
            attributes["keyqueue.task"] = message_type
        if len(requests) > 1:
            attributes["messaging.batch.message_count"] = len(requests)
        with tracer.start_as_current_span(f"process {queue}", context=parent, kind=SpanKind.CONSUMER,
                                          attributes=attributes, links=links) as span:
            yield span

    # --- hooks: metrics ---

    @hookimpl
    @inline_observer
    def keyqueue_key_acquired(self, worker: Worker, queue: str, key: str, fencing: tuple[int, int]) -> None:
        meters = self.meters()
        if meters is not None:
            meters.keys_held(queue, +1)
        tracer = self.tracer()
        if tracer is not None:
            span = tracer.start_span(
                f"key session {queue}", kind=SpanKind.INTERNAL, context=_ROOT,
                attributes={"messaging.system": SYSTEM, "keyqueue.queue": queue, "keyqueue.key": key,
                            "keyqueue.fencing": [int(fencing[0]), int(fencing[1])], "keyqueue.worker": worker.name})
            old = self._sessions.pop((id(worker), queue, key), None)
            if old is not None:
                old.end()
            self._sessions[(id(worker), queue, key)] = span

    @hookimpl
    @inline_observer
    def keyqueue_key_released(self, worker: Worker, queue: str, key: str, outcome: str) -> None:
        meters = self.meters()
        if meters is not None:
            meters.keys_held(queue, -1)
        span = self._sessions.pop((id(worker), queue, key), None)
        if span is not None:
            span.set_attribute("keyqueue.outcome", outcome)
            if outcome not in ("released", "handed-off"):
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end()

    @hookimpl
    @inline_observer
    def keyqueue_request_started(self, queue: str, message_type: str, attempt: int,
                                 enqueued_at: float | None) -> None:
        meters = self.meters()
        if meters is not None and attempt == 1:
            meters.started(queue, message_type, enqueued_at)

    @hookimpl
    @inline_observer
    def keyqueue_request_failed(self, queue: str, message_type: str, error: BaseException) -> None:
        meters = self.meters()
        if meters is not None:
            meters.failed(queue, message_type, type(error).__name__)

    @hookimpl
    @inline_observer
    def keyqueue_request_retried(self, queue: str, message_type: str) -> None:
        meters = self.meters()
        if meters is not None:
            meters.retried(queue, message_type)

    @hookimpl
    @inline_observer
    def keyqueue_request_succeeded(self, queue: str, message_type: str, elapsed: float) -> None:
        meters = self.meters()
        if meters is not None:
            meters.succeeded(queue, message_type, elapsed)

    @hookimpl
    @inline_observer
    def keyqueue_request_superseded(self, queue: str, message_type: str) -> None:
        meters = self.meters()
        if meters is not None:
            meters.superseded(queue, message_type)

    @hookimpl
    @inline_observer
    def keyqueue_request_dead_lettered(self, queue: str, message_type: str, reason: str) -> None:
        meters = self.meters()
        if meters is not None:
            meters.dead_lettered(queue, message_type, reason)


plugin = OtelPlugin()
"""The entry-point plugin: global providers (nothing is recorded until an SDK is configured)."""
