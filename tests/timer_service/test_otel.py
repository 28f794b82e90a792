"""OpenTelemetry: a timer's story in one trace, across a real nats-server and a service restart."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import nats
import pytest
from nats.aio.msg import Msg
from opentelemetry import propagate
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind

from tests.timer_adapters_nats.jetstream import wait_until
from tests.timer_service.process import ServiceProcess
from timer_adapters_nats import TimerClient
from timer_core import (
    Instrumentation,
    PublishError,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TraceContext,
)
from timer_core.codec import decode_event
from timer_core.instants import format_timestamp
from timer_service.bootstrap import bootstrap
from timer_service.census import Census
from timer_service.metrics import LATENESS_BUCKETS, PrometheusInstrumentation
from timer_service.otel import OtelInstrumentation
from timer_service.service import TimerService
from timer_service.settings import OTEL_LATENESS_SAMPLE, Settings, SettingsError


class Telemetry:
    """An SDK tracer and meter provider of their own, recording into memory."""

    instrumentation: OtelInstrumentation | None = None

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.metrics = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metrics])

    def instrument(self, inner: Instrumentation, **options: Any) -> OtelInstrumentation:
        """An OtelInstrumentation around ``inner`` on these providers (the last one made is
        ``self.instrumentation``)."""
        self.instrumentation = OtelInstrumentation(
            inner,
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
            **options,
        )
        return self.instrumentation

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    def metric(self, name: str) -> list[Any]:
        """The data points of one metric, as last collected."""
        data = self.metrics.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@contextlib.asynccontextmanager
async def running_service(
    settings: Settings, telemetry: Telemetry, *, timer_spans: bool = False
) -> AsyncIterator[TimerService]:
    """The service in this process, reporting to ``telemetry``; stopped cleanly on exit."""

    def otel(inner: Instrumentation) -> Instrumentation:
        return telemetry.instrument(inner, timer_spans=timer_spans)

    assert settings.broker_url is not None
    stop = asyncio.Event()
    async with bootstrap(settings, settings.broker_url, telemetry=otel) as service:
        task = asyncio.create_task(service.run(stop))
        try:
            yield service
        finally:
            stop.set()
            await task


def settings_for(tmp_path: Path, nats_url: str) -> Settings:
    return Settings(
        db_path=tmp_path / "timer.db",
        broker_url=nats_url,
        http_port=0,
        polling_interval_ms=200,
    )


@attrs.frozen
class Story:
    """What one scheduled-then-fired timer left behind, on every side."""

    client_side: Telemetry
    before: Telemetry
    after: Telemetry
    scheduling: SpanContext
    traced_event: Msg
    plain_event: Msg


async def schedule_restart_fire(tmp_path: Path, nats_url: str, *, timer_spans: bool) -> Story:
    """Schedule a traced and an untraced timer on one service, stop it before they are due,
    let their due time come while it is down, start another service on the same database,
    and consume both events in a span of their own."""
    settings = settings_for(tmp_path, nats_url)
    client_side, before, after = Telemetry(), Telemetry(), Telemetry()
    tracer = client_side.tracer_provider.get_tracer("shop")
    # Far ahead, so the first service cannot fire them however slowly it stops; the time
    # "passes" while it is down (their due time is moved to now in the database, and the
    # timers near: an hour ahead, they were stored far, out of the due-order indexes).
    due = datetime.now(UTC) + timedelta(hours=1)
    tenant, traced_call, plain_call = "tenant-o", "call-traced", "call-plain"
    async with running_service(settings, before, timer_spans=timer_spans) as service:
        async with TimerClient.connect(nats_url) as client:
            with tracer.start_as_current_span("checkout") as checkout:
                await client.schedule(tenant, traced_call, due)
            await client.schedule(tenant, plain_call, due)
        store = service.timer.store

        async def both_stored() -> bool:
            return all(
                [
                    await store.get(TenantId(tenant), ServiceCallId(call)) is not None
                    for call in (traced_call, plain_call)
                ]
            )

        await wait_until(both_stored, what="both timers stored")
    with contextlib.closing(sqlite3.connect(settings.db_path)) as db, db:
        now = format_timestamp(datetime.now(UTC))
        db.execute("UPDATE timer_schedules SET due_at = ?, far_bucket = NULL", (now,))

    nc = await nats.connect(nats_url)
    try:
        subscription = await nc.jetstream().subscribe(
            f"timer.events.{tenant}.>", ordered_consumer=True
        )
        async with running_service(settings, after, timer_spans=timer_spans):
            first = await subscription.next_msg(timeout=30)
            second = await subscription.next_msg(timeout=30)
    finally:
        await nc.close()
    events = {decode_event(m.data).payload.service_call_id: m for m in (first, second)}
    with tracer.start_as_current_span(
        "handle DueTimeReached",
        context=propagate.extract(events[traced_call].headers or {}),
        kind=SpanKind.CONSUMER,
    ):
        pass
    return Story(
        client_side,
        before,
        after,
        checkout.get_span_context(),
        events[traced_call],
        events[plain_call],
    )


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def links_of(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


class TestTraceAcrossRestart:
    async def test_firing_span_links_to_the_scheduling_span(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """Scheduled in a span before a restart, fired after it: the timer.fire span links to
        the scheduling span, the event carries timer.fire's context and the consumer's span
        is its child; the store span links too; an untraced timer's event has no trace
        headers."""
        story = await schedule_restart_fire(tmp_path, nats_url, timer_spans=False)
        scheduling = (story.scheduling.trace_id, story.scheduling.span_id)

        stored = story.before.named("timer.commands.store")
        assert [link for span in stored for link in links_of(span)] == [scheduling]
        assert sum(span.attributes["timer.batch_size"] for span in stored) == 2  # type: ignore[index,misc]
        assert story.before.named("timer.fire") == []

        (fire,) = [span for span in story.after.named("timer.fire") if span.links]
        assert links_of(fire) == [scheduling]
        assert fire.kind is SpanKind.PRODUCER
        assert fire.attributes is not None and fire.attributes["timer.tenant_id"] == "tenant-o"
        assert story.after.named("timer.due") == []
        assert (story.traced_event.headers or {})["traceparent"] == traceparent_of(fire)
        (consumer,) = story.client_side.named("handle DueTimeReached")
        assert consumer.parent is not None and consumer.parent.span_id == fire.context.span_id
        assert set(story.plain_event.headers or {}) == {"Nats-Msg-Id"}

        (received,) = story.before.metric("timer.commands.received")
        assert received.attributes == {"outcome": "stored"} and received.value == 2
        (processed,) = story.after.metric("timer.schedules.processed")
        assert processed.value == 2
        (lateness,) = story.after.metric("timer.firing.lateness")
        assert story.after.instrumentation is not None
        prometheus = story.after.instrumentation.inner
        assert isinstance(prometheus, PrometheusInstrumentation)
        assert sum(prometheus_lateness_counts(prometheus)) == 2
        assert list(lateness.bucket_counts) == one_in(
            OTEL_LATENESS_SAMPLE, prometheus_lateness_counts(prometheus)
        )

    async def test_timer_spans_put_the_whole_story_in_one_trace(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """With timer_spans, the fired timer gets a timer.due span in the scheduling trace,
        a child of and linked to the scheduling span, and the consumer continues it."""
        story = await schedule_restart_fire(tmp_path, nats_url, timer_spans=True)
        scheduling = story.scheduling

        (due_span,) = story.after.named("timer.due")
        assert due_span.kind is SpanKind.PRODUCER
        assert due_span.context.trace_id == scheduling.trace_id
        assert due_span.parent is not None and due_span.parent.span_id == scheduling.span_id
        assert links_of(due_span) == [(scheduling.trace_id, scheduling.span_id)]
        assert due_span.attributes is not None
        assert due_span.attributes["timer.tenant_id"] == "tenant-o"
        assert due_span.attributes["timer.service_call_id"] == "call-traced"
        assert (story.traced_event.headers or {})["traceparent"] == traceparent_of(due_span)
        (consumer,) = story.client_side.named("handle DueTimeReached")
        assert consumer.context.trace_id == scheduling.trace_id
        assert consumer.parent is not None and consumer.parent.span_id == due_span.context.span_id
        assert set(story.plain_event.headers or {}) == {"Nats-Msg-Id"}


class TestMetrics:
    def test_every_prometheus_metric_has_an_opentelemetry_twin(self) -> None:
        """Each Prometheus series has the OpenTelemetry metric of the same name, dots for
        underscores, and a counter for a counter (so dashboards on either agree)."""
        telemetry = Telemetry()
        prometheus = PrometheusInstrumentation()
        otel = telemetry.instrument(prometheus)
        now = datetime(2030, 1, 1, tzinfo=UTC)
        entry = TimerEntry("tenant-a", "call-1", now, now)
        otel.commands_handled([], [])
        otel.command_rejected("timer.commands.x", "bad")
        otel.timers_fired([entry.reach(now)])
        otel.publish_failed(entry, PublishError("down"))
        otel.timer_quarantined(entry, PublishError("down"), 3)
        otel.quarantine_size(1)
        otel.quarantine_oldest(now)
        otel.set_pending(4)
        otel.set_instances(2)
        otel.broker_state_recreated("consumer")
        otel.set_census(Census(now, {"overdue": 1}, 10, now, 0.001))
        otel.set_clock_skew(lambda: 0.25)
        otel.poll_completed(0.01, 1)
        otel.worker_error(RuntimeError("store down"))
        otel.timers_purged(5)
        data = telemetry.metrics.get_metrics_data()
        assert data is not None
        exported = {
            metric.name: type(metric.data).__name__
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }
        kinds = {"counter": "Sum", "histogram": "Histogram", "gauge": "Gauge"}
        for family in prometheus.registry.collect():
            name = family.name.removesuffix("_seconds").removesuffix("_timestamp")
            twin = next(
                (n for n in exported if n.replace(".", "_").removesuffix("_timestamp") == name),
                None,
            )
            assert twin is not None, f"no OpenTelemetry metric for {family.name}"
            assert exported[twin] == kinds[family.type], family.name

    def test_lateness_records_one_timer_in_n_of_each_bucket(self) -> None:
        """timer.firing.lateness is a histogram on the Prometheus buckets that records, in each
        bucket, its first timer and then every Nth, the stride running on across batches (a
        value on a bound counts in the bucket it closes, as in the SDK), while
        timer.schedules.processed counts every timer."""
        telemetry = Telemetry()
        prometheus = PrometheusInstrumentation()
        otel = telemetry.instrument(prometheus, lateness_sample=4)
        now = datetime(2030, 1, 1, tzinfo=UTC)

        def fired(*lateness_s: float) -> list[TimerEntry]:
            due = [now - timedelta(seconds=late) for late in lateness_s]
            return [
                TimerEntry("t", f"c{i}", at, now - timedelta(hours=1)).reach(now)
                for i, at in enumerate(due)
            ]

        otel.timers_fired(fired(1.0, *[0.003] * 6, 2.0))
        otel.timers_fired(fired(*[0.003] * 4, 2.0, 2.0, 1.0, 100.0))
        (lateness,) = telemetry.metric("timer.firing.lateness")
        assert tuple(lateness.explicit_bounds) == LATENESS_BUCKETS
        expected = [0] * (len(LATENESS_BUCKETS) + 1)
        expected[LATENESS_BUCKETS.index(0.005)] = 3  # 10 timers: the 1st, 5th and 9th
        expected[LATENESS_BUCKETS.index(1.0)] = 1  # 2 timers at exactly 1 s: the 1st
        expected[LATENESS_BUCKETS.index(2.5)] = 1  # 3 timers: the 1st
        expected[LATENESS_BUCKETS.index(300.0)] = 1  # 1 timer
        assert list(lateness.bucket_counts) == expected
        assert list(lateness.bucket_counts) == one_in(4, prometheus_lateness_counts(prometheus))
        assert lateness.count == 6
        assert lateness.sum == pytest.approx(3 * 0.003 + 1.0 + 2.0 + 100.0)
        assert (lateness.min, lateness.max) == (pytest.approx(0.003), 100.0)
        (processed,) = telemetry.metric("timer.schedules.processed")
        assert processed.value == 16

        otel.timers_fired(fired(0.003, 0.003))  # the 11th and 12th of their bucket: skipped
        (lateness,) = telemetry.metric("timer.firing.lateness")
        assert lateness.count == 6
        otel.timers_fired(fired(0.003))  # the 13th: recorded
        (lateness,) = telemetry.metric("timer.firing.lateness")
        assert lateness.count == 7
        assert list(lateness.bucket_counts) == one_in(4, prometheus_lateness_counts(prometheus))

    def test_lateness_sample_1_records_every_timer(self) -> None:
        """With lateness_sample=1 the histogram counts every timer, as the Prometheus one does;
        less than 1 is refused."""
        telemetry = Telemetry()
        prometheus = PrometheusInstrumentation()
        otel = telemetry.instrument(prometheus, lateness_sample=1)
        now = datetime(2030, 1, 1, tzinfo=UTC)
        otel.timers_fired(
            [
                TimerEntry("t", f"c{i}", now - timedelta(milliseconds=i), now).reach(now)
                for i in range(50)
            ]
        )
        (lateness,) = telemetry.metric("timer.firing.lateness")
        assert lateness.count == 50
        assert list(lateness.bucket_counts) == prometheus_lateness_counts(prometheus)
        with pytest.raises(ValueError, match="lateness_sample must be 1 or more, not 0"):
            OtelInstrumentation(prometheus, lateness_sample=0)


def prometheus_lateness_counts(prometheus: PrometheusInstrumentation) -> list[int]:
    """The timers in each bucket of the Prometheus lateness histogram (not cumulative)."""
    (family,) = prometheus.lateness.collect()
    cumulative = [int(s.value) for s in family.samples if s.name.endswith("_bucket")]
    return [high - low for low, high in zip([0, *cumulative], cumulative, strict=False)]


def one_in(every: int, counts: list[int]) -> list[int]:
    """Each count's first and then every ``every``-th: the sample of a bucket of ``count``."""
    return [-(-count // every) for count in counts]


class TestSwitch:
    @pytest.mark.parametrize(
        ("environ", "on"),
        [
            ({}, False),
            ({"TIMER_OTEL": "1"}, True),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
            ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "TIMER_OTEL": "0"}, False),
            ({"TIMER_OTEL": "1", "OTEL_SDK_DISABLED": "true"}, False),
        ],
    )
    def test_timer_otel_or_an_otlp_endpoint_turns_it_on(
        self, environ: dict[str, str], on: bool
    ) -> None:
        """TIMER_OTEL decides; unset, an OTLP endpoint turns it on; OTEL_SDK_DISABLED wins."""
        assert Settings.from_environment(environ).otel is on

    def test_timer_otel_lateness_sample_is_read_and_checked(self) -> None:
        """TIMER_OTEL_LATENESS_SAMPLE sets how many timers per bucket the lateness histogram
        records one of (16 unset); 0 is an error that names the variable."""
        assert Settings.from_environment({}).otel_lateness_sample == 16
        assert (
            Settings.from_environment({"TIMER_OTEL_LATENESS_SAMPLE": "1"}).otel_lateness_sample == 1
        )
        with pytest.raises(SettingsError, match="TIMER_OTEL_LATENESS_SAMPLE"):
            Settings.from_environment({"TIMER_OTEL_LATENESS_SAMPLE": "0"})


class Collector:
    """An OTLP/HTTP receiver on loopback that keeps every export request it is sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        received = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[Any]:
        found = []
        for path, body in list(self.requests):
            if path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        found += list(scope.spans)
        return found

    def metric_names(self) -> set[str]:
        names = set()
        for path, body in list(self.requests):
            if path == "/v1/metrics":
                request = ExportMetricsServiceRequest.FromString(body)
                for resource in request.resource_metrics:
                    for scope in resource.scope_metrics:
                        names |= {metric.name for metric in scope.metrics}
        return names


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector()
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


async def fire_one(nats_url: str, scheduling: TraceContext) -> Msg:
    """Schedules a traced timer 200 ms ahead through the service and returns its event."""
    nc = await nats.connect(nats_url)
    try:
        subscription = await nc.jetstream().subscribe(
            "timer.events.tenant-x.>", ordered_consumer=True
        )
        async with TimerClient.connect(nats_url) as client:
            await client.schedule(
                "tenant-x",
                "call-x",
                datetime.now(UTC) + timedelta(milliseconds=200),
                trace_context=scheduling,
            )
        return await subscription.next_msg(timeout=30)
    finally:
        await nc.close()


def exporter_complaints(output: str) -> list[str]:
    """The lines of a service's log where an OTLP exporter failed or retried."""
    return [
        line
        for line in output.splitlines()
        if "localhost:4318" in line or "Transient error" in line or "Failed to export" in line
    ]


class TestExport:
    async def test_an_otlp_endpoint_turns_it_on_and_gets_spans_and_metrics(
        self, service: ServiceProcess, nats_url: str, collector: Collector
    ) -> None:
        """timer-service with OTEL_EXPORTER_OTLP_ENDPOINT set exports the store and firing
        spans (linked to the scheduling span) and the metrics to it by OTLP/HTTP."""
        service.env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            OTEL_SERVICE_NAME="timer-under-test",
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_METRIC_EXPORT_INTERVAL="200",
        )
        service.start()
        await asyncio.to_thread(service.wait_healthy)
        scheduling = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        event = await fire_one(nats_url, scheduling)
        assert (event.headers or {})["traceparent"] != scheduling.traceparent

        def exported() -> bool:
            names = {span.name for span in collector.spans()}
            return {"timer.commands.store", "timer.fire"} <= names and (
                "timer.schedules.processed" in collector.metric_names()
            )

        await wait_until(exported, within=30, what="spans and metrics at the collector")
        assert service.terminate() == 0
        fire = [span for span in collector.spans() if span.name == "timer.fire" and span.links]
        assert [link.span_id.hex() for link in fire[0].links] == [scheduling.span_id]
        assert (event.headers or {})["traceparent"].startswith(
            f"00-{fire[0].trace_id.hex()}-{fire[0].span_id.hex()}-"
        )

    @pytest.mark.parametrize(
        ("signal", "log_line"),
        [
            ("traces", "spans to {url}/v1/traces, metrics not exported"),
            ("metrics", "spans not exported (no traces endpoint set), metrics to {url}/v1/metrics"),
        ],
    )
    async def test_one_signals_endpoint_alone_exports_that_signal_only(
        self,
        service: ServiceProcess,
        nats_url: str,
        collector: Collector,
        signal: str,
        log_line: str,
    ) -> None:
        """With only OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or only ..._METRICS_ENDPOINT) set,
        that signal goes to it, the other goes nowhere (not to the SDK's default
        localhost:4318, no exporter warning), and the start-up log says so."""
        service.env.update(
            {f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT": f"{collector.url}/v1/{signal}"},
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_METRIC_EXPORT_INTERVAL="200",
        )
        service.start()
        await asyncio.to_thread(service.wait_healthy)
        await fire_one(
            nats_url, TraceContext("00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01")
        )

        def arrived() -> bool:
            if signal == "traces":
                return "timer.fire" in {span.name for span in collector.spans()}
            return "timer.schedules.processed" in collector.metric_names()

        await wait_until(arrived, within=30, what=f"the {signal} at their endpoint")
        assert service.terminate() == 0
        output = service.output()
        assert log_line.format(url=collector.url) in output
        assert exporter_complaints(output) == []
        assert {path for path, _ in collector.requests} == {f"/v1/{signal}"}
