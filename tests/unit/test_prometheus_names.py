"""Prometheus metrics carry the OpenTelemetry plugin's names (docs/observability.md) in Prometheus form."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from keyqueue.app.heartbeat import WorkerRecord, record_subject
from keyqueue.metrics.prometheus import INSTRUMENTS, PrometheusPlugin, prometheus_name


def test_every_otel_instrument_has_its_prometheus_twin() -> None:
    from keyqueue_otel.metrics import INSTRUMENTS as OTEL

    assert set(INSTRUMENTS) == set(OTEL)
    assert prometheus_name("keyqueue.requests.succeeded", "counter") == "keyqueue_requests_succeeded"
    assert prometheus_name("keyqueue.request.wait", "histogram") == "keyqueue_request_wait_seconds"


def test_the_plugin_counts_hooks_into_the_named_series() -> None:
    plugin = PrometheusPlugin(CollectorRegistry())
    plugin.keyqueue_request_succeeded(queue="shop", message_type="charge", elapsed=0.25)
    plugin.keyqueue_request_failed(queue="shop", message_type="charge", error=ValueError("x"))
    plugin.keyqueue_request_dead_lettered(queue="shop", message_type="charge", reason="max-attempts")
    plugin.keyqueue_key_acquired(worker=None, queue="shop")  # type: ignore[arg-type]
    text = generate_latest(plugin.registry).decode()
    assert 'keyqueue_requests_succeeded_total{keyqueue_queue="shop",keyqueue_task="charge"} 1.0' in text
    assert ('keyqueue_requests_failed_total{error_type="ValueError",keyqueue_queue="shop",'
            'keyqueue_task="charge"} 1.0') in text
    assert ('keyqueue_requests_dead_lettered_total{keyqueue_queue="shop",keyqueue_reason="max-attempts",'
            'keyqueue_task="charge"} 1.0') in text
    assert 'keyqueue_request_run_seconds_count{keyqueue_queue="shop",keyqueue_task="charge"} 1.0' in text
    assert 'keyqueue_keys_held{keyqueue_queue="shop"} 1.0' in text


def test_a_heartbeat_record_round_trips_and_keeps_unknown_fields() -> None:
    record = WorkerRecord(name="h.example:1/2", host="h.example", pid=1, version="0.1.0", queues=["shop"], slots=4,
                          used=1, started=1.0, heartbeat=2.0, interval=5.0)
    assert WorkerRecord.decode(record.encode()) == record
    newer = WorkerRecord.decode(record.encode()[:-1] + b',"zone":"eu"}')
    assert newer is not None and newer.extra == {"zone": "eu"}
    assert WorkerRecord.decode(b"not json") is None and WorkerRecord.decode(b"{}") is None
    subject = record_subject("shop", record.name)
    assert subject.startswith("kq.shop.role.worker.") and "." not in subject[len("kq.shop.role.worker."):]
