"""keyqueue's metrics in the Prometheus text format, with the OpenTelemetry plugin's names.

Each instrument of ``keyqueue_otel`` (docs/observability.md, "Metrics") is here under the name an
OpenTelemetry-to-Prometheus exporter gives it: dots become underscores, counters end in
``_total``, the unit ``s`` becomes ``_seconds``; attributes become labels the same way
(``keyqueue.queue`` -> ``keyqueue_queue``, ``error.type`` -> ``error_type``). So a dashboard built
on either source reads the same series.

``PrometheusPlugin`` counts a worker's lifecycle hooks into its own registry;
``serve_metrics`` serves a registry on ``/metrics`` from a thread (prometheus-client's server).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from keyqueue.errors import ConfigError, MissingExtra
from keyqueue.plugins.manager import hookimpl, inline_observer

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from keyqueue.app.worker import Worker

__all__ = ["INSTRUMENTS", "PrometheusPlugin", "prometheus_name", "require_client", "serve_metrics"]

INSTRUMENTS: Final = {
    "keyqueue.requests.enqueued": ("counter", "Requests stored (duplicates not counted)", ("task",)),
    "keyqueue.requests.succeeded": ("counter", "Requests processed and removed", ("task",)),
    "keyqueue.requests.failed": ("counter", "Attempts that raised", ("task", "error.type")),
    "keyqueue.requests.retried": ("counter", "Failed attempts that will run again", ("task",)),
    "keyqueue.requests.dead_lettered": ("counter", "Requests moved to the dead-letter queue",
                                        ("task", "keyqueue.reason")),
    "keyqueue.requests.superseded": ("counter", "Requests replaced by a newer one (policy latest)", ("task",)),
    "keyqueue.request.wait": ("histogram", "Seconds from enqueue to the start of the first attempt", ("task",)),
    "keyqueue.request.run": ("histogram", "Seconds the successful attempt ran", ("task",)),
    "keyqueue.keys.held": ("gauge", "Keys this process holds (key sessions open)", ()),
}
"""OpenTelemetry name -> (kind, description, attributes besides ``keyqueue.queue``)."""


def require_client() -> None:
    """Raise ``MissingExtra`` (a ``ConfigError``) saying how to install prometheus-client, if it is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise MissingExtra("Prometheus metrics", "metrics", "prometheus-client") from None


def prometheus_name(otel_name: str, kind: str) -> str:
    """``keyqueue.requests.succeeded`` -> ``keyqueue_requests_succeeded`` (prometheus-client adds
    ``_total`` to counters itself); a histogram in seconds gets ``_seconds``."""
    name = otel_name.replace(".", "_")
    return name + "_seconds" if kind == "histogram" else name


def _label(attribute: str) -> str:
    return attribute.replace(".", "_") if attribute.startswith(("keyqueue.", "error.")) else f"keyqueue_{attribute}"


def make_instruments(registry: CollectorRegistry) -> dict[str, Any]:
    """The instruments of ``INSTRUMENTS``, registered in ``registry``, by OpenTelemetry name."""
    from prometheus_client import Counter, Gauge, Histogram

    kinds: dict[str, Any] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    return {name: kinds[kind](prometheus_name(name, kind), description,
                              ["keyqueue_queue", *map(_label, attributes)], registry=registry)
            for name, (kind, description, attributes) in INSTRUMENTS.items()}


class PrometheusPlugin:
    """Counts a worker's lifecycle hooks into Prometheus instruments (``registry``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        require_client()
        from prometheus_client import CollectorRegistry

        self.registry = registry or CollectorRegistry()
        self.instruments = make_instruments(self.registry)

    def _count(self, name: str, *labels: str) -> None:
        self.instruments[name].labels(*labels).inc()

    @hookimpl
    @inline_observer
    def keyqueue_key_acquired(self, worker: Worker, queue: str) -> None:
        self.instruments["keyqueue.keys.held"].labels(queue).inc()

    @hookimpl
    @inline_observer
    def keyqueue_key_released(self, worker: Worker, queue: str) -> None:
        self.instruments["keyqueue.keys.held"].labels(queue).dec()

    @hookimpl
    @inline_observer
    def keyqueue_request_started(self, queue: str, message_type: str, attempt: int,
                                 enqueued_at: float | None) -> None:
        # From the stored message's timestamp (whatever the request id: a caller's own, a backfill's hash).
        if attempt == 1 and enqueued_at is not None:
            self.instruments["keyqueue.request.wait"].labels(queue, message_type).observe(
                max(0.0, time.time() - enqueued_at))

    @hookimpl
    @inline_observer
    def keyqueue_request_failed(self, queue: str, message_type: str, error: BaseException) -> None:
        self._count("keyqueue.requests.failed", queue, message_type, type(error).__name__)

    @hookimpl
    @inline_observer
    def keyqueue_request_retried(self, queue: str, message_type: str) -> None:
        self._count("keyqueue.requests.retried", queue, message_type)

    @hookimpl
    @inline_observer
    def keyqueue_request_succeeded(self, queue: str, message_type: str, elapsed: float) -> None:
        self._count("keyqueue.requests.succeeded", queue, message_type)
        self.instruments["keyqueue.request.run"].labels(queue, message_type).observe(elapsed)

    @hookimpl
    @inline_observer
    def keyqueue_request_superseded(self, queue: str, message_type: str) -> None:
        self._count("keyqueue.requests.superseded", queue, message_type)

    @hookimpl
    @inline_observer
    def keyqueue_request_dead_lettered(self, queue: str, message_type: str, reason: str) -> None:
        self._count("keyqueue.requests.dead_lettered", queue, message_type, reason)


@contextlib.contextmanager
def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> Iterator[int]:
    """Serve ``registry`` on ``http://host:port/metrics`` (any path, as prometheus-client does) from
    a thread until the block ends; yields the port (the one chosen, for port 0)."""
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
