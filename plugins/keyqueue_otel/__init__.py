"""keyqueue on OpenTelemetry: traces from enqueue to processing, and request metrics.

The ``keyqueue-otel`` distribution (this folder's pyproject.toml) registers it through the
entry-point group ``keyqueue`` (``otel = "keyqueue_otel.plugin:plugin"``), so once installed it is
on for every app; it records nothing until an OpenTelemetry SDK is configured (a tracer / meter
provider set, by code or by ``OTEL_*`` variables). See docs/observability.md.
"""

from __future__ import annotations

from .plugin import OtelPlugin, plugin

__all__ = ["OtelPlugin", "plugin"]
