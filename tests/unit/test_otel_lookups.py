"""The OpenTelemetry plugin looks its global providers up once a second, not on every hook call."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from opentelemetry import trace

otel = importlib.import_module("keyqueue_otel.plugin")  # the module (the package exports an object of that name)


def test_the_global_provider_is_looked_up_once_per_recheck_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[int] = []
    provider: Any = trace.ProxyTracerProvider()

    def get_tracer_provider() -> Any:
        lookups.append(1)
        return provider

    clock = [100.0]
    monkeypatch.setattr(otel.trace, "get_tracer_provider", get_tracer_provider)
    monkeypatch.setattr(otel.time, "monotonic", lambda: clock[0])
    plugin = otel.OtelPlugin(metrics=False)
    assert [plugin.tracer() for _ in range(100)] == [None] * 100
    assert len(lookups) == 1
    # A provider configured meanwhile is seen at the next lookup, PROVIDER_RECHECK later.
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    clock[0] += otel.PROVIDER_RECHECK
    assert plugin.tracer() is not None and len(lookups) == 2
    assert plugin.tracer() is plugin.tracer() and len(lookups) == 2
