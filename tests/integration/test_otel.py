"""The OpenTelemetry plugin against a real nats-server.

Spans go to the SDK's InMemorySpanExporter and metrics to an InMemoryMetricReader, through an
``OtelPlugin`` with its own providers (the global ones are left alone). Most tests run producer
and worker in this process; one runs the worker as a ``keyqueue worker`` subprocess configured
only by OTEL_* variables.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import keyqueue
from keyqueue_otel import OtelPlugin


class Telemetry:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.plugin = OtelPlugin(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        out: dict[str, list[Any]] = {}
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out[metric.name] = list(metric.data.data_points)
        return out


@pytest.fixture
async def setup(nats_url: str) -> AsyncIterator[tuple[keyqueue.App, Telemetry, Any]]:
    telemetry = Telemetry()
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False,
                       plugins=[telemetry.plugin])
    tracer = telemetry.tracer_provider.get_tracer("test")
    failed: set[int] = set()
    inner: dict[int, trace.SpanContext] = {}

    @app.task(key="{order_id}", max_attempts=3, backoff=0.01)
    async def charge(order_id: str, n: int) -> int:
        with tracer.start_as_current_span(f"charging {n}") as span:
            inner[n] = span.get_span_context()
        if n < 0:
            raise keyqueue.Reject("negative")
        if n == 2 and n not in failed:
            failed.add(n)
            raise ValueError("flaky")
        return n

    try:
        yield app, telemetry, charge
    finally:
        await app.close()


async def test_one_trace_runs_from_enqueue_to_processing(setup: tuple[keyqueue.App, Telemetry, Any]) -> None:
    app, telemetry, charge = setup
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("checkout") as root:
        receipts = [await charge.enqueue(order_id="o1", n=n) for n in (1, 2)]
    async with app.worker():
        with pytest.raises(keyqueue.DeadLettered):
            await charge.call(order_id="o2", n=-1, timeout=10)
        await charge.call(order_id="o1", n=3, timeout=10)
    spans = telemetry.spans()
    producers = {s.attributes["messaging.message.id"]: s for s in spans if s.kind == SpanKind.PRODUCER}
    consumers: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        if s.kind == SpanKind.CONSUMER:
            consumers.setdefault(str(s.attributes["messaging.message.id"]), []).append(s)
    assert len(producers) == 4 and len(consumers) == 4

    first, second = (producers[r.request_id] for r in receipts)
    assert first.name == "publish shop" and first.parent is not None
    assert first.parent.span_id == root.get_span_context().span_id  # enqueued inside the caller's span
    assert dict(first.attributes) == {
        "messaging.system": "nats", "messaging.operation": "publish", "messaging.operation.type": "send",
        "messaging.destination.name": "kq.shop.in.o1", "messaging.message.id": receipts[0].request_id,
        "keyqueue.queue": "shop", "keyqueue.key": "o1", "keyqueue.task": "charge",
        "keyqueue.seq": receipts[0].seq, "keyqueue.duplicate": False}

    for receipt, producer in ((receipts[0], first), (receipts[1], second)):
        processes = sorted(consumers[receipt.request_id], key=lambda s: s.start_time or 0)
        for process in processes:
            assert process.name == "process shop"
            assert process.context.trace_id == producer.context.trace_id == root.get_span_context().trace_id
            assert process.parent is not None and process.parent.span_id == producer.context.span_id
            attrs = process.attributes
            assert (attrs["messaging.system"], attrs["messaging.operation"]) == ("nats", "process")
            assert (attrs["keyqueue.queue"], attrs["keyqueue.key"], attrs["keyqueue.task"]) == ("shop", "o1", "charge")
            assert attrs["messaging.destination.name"] == "kq.shop.in.o1"
            assert len(attrs["keyqueue.fencing"]) == 2 and attrs["keyqueue.fencing"][0] >= 1
        assert [p.attributes["keyqueue.attempt"] for p in processes] == ([1] if producer is first else [1, 2])

    failing, retry = sorted(consumers[receipts[1].request_id], key=lambda s: s.start_time or 0)
    assert failing.status.status_code == StatusCode.ERROR and retry.status.status_code != StatusCode.ERROR
    [exception] = [e for e in failing.events if e.name == "exception"]
    assert exception.attributes is not None and exception.attributes["exception.type"] == "ValueError"

    [rejected] = next(c for rid, c in consumers.items() if producers[rid].attributes["keyqueue.key"] == "o2")
    assert rejected.status.status_code == StatusCode.ERROR  # a Reject: dead-lettered at once
    # The publish itself went well: the remote failure is the process span's, not the producer's.
    o2 = next(p for p in producers.values() if p.attributes["keyqueue.key"] == "o2")
    assert o2.status.status_code == StatusCode.UNSET

    # Each key session is a span of its own, from acquisition to release.
    sessions = [s for s in spans if s.name == "key session shop"]
    assert {s.attributes["keyqueue.key"] for s in sessions} == {"o1", "o2"}
    assert all(s.parent is None and s.attributes["keyqueue.outcome"] in ("released", "handed-off") for s in sessions)

    # Spans the task opens are children of its process span.
    charging = {s.name: s for s in spans if s.name.startswith("charging ")}
    [process_1] = consumers[receipts[0].request_id]
    assert charging["charging 1"].parent is not None
    assert charging["charging 1"].parent.span_id == process_1.context.span_id


async def test_metrics_for_a_known_workload(setup: tuple[keyqueue.App, Telemetry, Any]) -> None:
    app, telemetry, charge = setup
    receipts = [await charge.enqueue(order_id="o1", n=n) for n in (1, 2, 3)]
    await charge.options(request_id=receipts[0].request_id).enqueue(order_id="o1", n=1)  # a duplicate
    async with app.worker():
        with pytest.raises(keyqueue.DeadLettered):
            await charge.call(order_id="o2", n=-1, timeout=10)
        async with asyncio.timeout(10):
            while True:
                if sum(p.value for p in telemetry.metrics().get("keyqueue.requests.succeeded", [])) >= 3:
                    break
                await asyncio.sleep(0.02)
    found = telemetry.metrics()

    def total(name: str, **attrs: str) -> float:
        return sum(p.value if hasattr(p, "value") else p.count for p in found.get(name, [])
                   if all(p.attributes.get(k) == v for k, v in attrs.items()))

    task = {"keyqueue.queue": "shop", "keyqueue.task": "charge"}
    assert total("keyqueue.requests.enqueued", **task) == 4  # 3 + the call; not the duplicate
    assert total("keyqueue.requests.succeeded", **task) == 3
    assert total("keyqueue.requests.failed", **task) == 2
    assert total("keyqueue.requests.failed", **{"error.type": "ValueError"}) == 1
    assert total("keyqueue.requests.retried", **task) == 1
    assert total("keyqueue.requests.dead_lettered", **task, **{"keyqueue.reason": "rejected"}) == 1
    assert total("keyqueue.request.wait", **task) == 4  # one per first attempt
    assert total("keyqueue.request.run", **task) == 3
    [run] = found["keyqueue.request.run"]
    assert 0 <= run.min <= run.max < 5
    [held] = found["keyqueue.keys.held"]
    assert held.attributes == {"keyqueue.queue": "shop"} and held.value == 0  # every session released


def test_without_an_sdk_the_entry_point_plugin_records_nothing() -> None:
    from opentelemetry import metrics

    from keyqueue_otel import plugin

    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        assert plugin.tracer() is None
    if type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider":
        assert plugin.meters() is None
    assert OtelPlugin(metrics=False, tracing=False).keyqueue_wrap_enqueue(None, None) is None  # type: ignore[arg-type]


async def test_the_trace_crosses_processes_with_a_worker_configured_from_otel_env(nats_url: str) -> None:
    """A ``keyqueue worker`` subprocess set up only by OTEL_* variables (console exporter) continues
    the trace of an enqueue made in this process."""
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYQUEUE_", "OTEL_"))}
    env.update(KEYQUEUE_URL=nats_url, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none",
               OTEL_LOGS_EXPORTER="none", OTEL_SERVICE_NAME="kq-worker")
    worker = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("keyqueue")), "worker", "examples.quickstart.app:app", "--queue", "shop",
        cwd=root, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert worker.stderr is not None and worker.stdout is not None
    telemetry = Telemetry()
    app = keyqueue.App("shop", url=nats_url, set_as_default=False, autoload_plugins=False,
                       plugins=[telemetry.plugin])

    @app.task(key="{order_id}")
    async def charge(order_id: str, amount: int) -> dict[str, Any]:
        raise AssertionError("runs in the worker")

    try:
        async with asyncio.timeout(30):
            while b"queue shop:" not in await worker.stderr.readline():
                pass
        assert (await charge.call(order_id="t1", amount=3, timeout=20))["charged"] == 3
    finally:
        await app.close()
        if worker.returncode is None:
            worker.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(worker.communicate(), 30)
    [producer] = [s for s in telemetry.spans() if s.kind == SpanKind.PRODUCER]
    text, decoder, spans = out.decode(), json.JSONDecoder(), []
    index = text.find("{")
    while index >= 0:
        span, end = decoder.raw_decode(text, index)
        spans.append(span)
        index = text.find("{", end)
    [process] = [s for s in spans if s["name"] == "process shop"]
    assert process["kind"] == "SpanKind.CONSUMER"
    assert process["context"]["trace_id"] == f"0x{producer.context.trace_id:032x}"
    assert process["parent_id"] == f"0x{producer.context.span_id:016x}"
    assert process["attributes"]["keyqueue.key"] == "t1" and process["attributes"]["keyqueue.attempt"] == 1
    assert process["resource"]["attributes"]["service.name"] == "kq-worker"
