"""The OpenTelemetry plugin names the exporter distributions the OTEL_* variables ask for."""

from __future__ import annotations

from keyqueue_otel.plugin import exporter_packages


def test_the_hint_names_the_package_of_each_exporter_asked_for() -> None:
    assert exporter_packages({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_TRACES_EXPORTER": "none"}) == [
        "opentelemetry-exporter-prometheus"]
    assert exporter_packages({"OTEL_METRICS_EXPORTER": "prometheus"}) == [
        "opentelemetry-exporter-otlp", "opentelemetry-exporter-prometheus"]  # traces default to otlp
    assert exporter_packages({"OTEL_TRACES_EXPORTER": "zipkin,console", "OTEL_METRICS_EXPORTER": "console"}) == [
        "opentelemetry-exporter-zipkin"]
    assert exporter_packages({}) == ["opentelemetry-exporter-otlp"]
