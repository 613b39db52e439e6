"""keyqueue on OpenTelemetry: traces from enqueue to processing, and request metrics.

Registered through the entry-point group ``keyqueue`` (``otel = "plugins.keyqueue_otel.plugin:plugin"``),
so it is on wherever keyqueue is installed; it records nothing until an OpenTelemetry SDK is
configured (a tracer / meter provider set, by code or by ``OTEL_*`` variables). See
docs/observability.md.
"""

from __future__ import annotations

from plugins.keyqueue_otel.plugin import OtelPlugin, plugin

__all__ = ["OtelPlugin", "plugin"]
