"""OpenTelemetry for Timer: spans around command batches and firings, and the service's metrics.

Needs the ``otel`` extra (``pip install 'timer-service[otel]'``). :class:`OtelInstrumentation`
is a :class:`timer_core.Instrumentation` any host can give its ``Timer`` and ``NatsBroker``;
:func:`configure` sets up the SDK for ``timer-service`` from the standard ``OTEL_*``
variables (``TIMER_OTEL`` decides whether it is used at all).

Spans:

- ``timer.commands.store`` (CONSUMER) per command batch stored, linked to the span each
  traced ``ScheduleTimer`` was sent from;
- ``timer.fire`` (PRODUCER) per batch of due timers published and marked ``Reached``,
  linked to the scheduling span of each traced timer in it; the ``DueTimeReached`` of a
  traced timer carries its context, so the consumer's span continues the firing's trace;
- with ``timer_spans=True``, instead: a ``timer.due`` span (PRODUCER) per traced timer, a
  child of its scheduling span (and linked to it), from publish to mark, whose context the
  event carries: schedule, firing and consumer in one trace. It costs a span per traced,
  sampled timer (bench/README.md), so it is off by default.

Untraced timers get no span of their own and their events no trace headers.

Metrics cost per batch, not per timer, except ``timer.firing.lateness``: the OpenTelemetry
metrics API has no way to record many values at once (nor an asynchronous histogram), and the
SDK's ``Histogram.record`` costs more than the 5% of a timer's firing this instrumentation may
take. So it records one fired timer in ``lateness_sample`` (16 by default; 1 records every
timer) *in each of its buckets*: the first timer late by a bucket's amount, then every
``lateness_sample``-th, counting on across batches. Each bucket's count is its true count
divided by ``lateness_sample``, rounded up (so the first timer ever that late shows at once),
and the quantiles read from the histogram (p50, p99) are every timer's to within a sample per
bucket; count, sum, min and max are the sample's (firings are counted exactly by
``timer.schedules.processed``, and by the Prometheus histogram). The buckets are the
advisory boundaries, ``LATENESS_BUCKETS``: a view that aggregates otherwise (other
boundaries, an exponential histogram) gets the same sample, stratified by those.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TracerProvider,
    TraceState,
)

from timer_core import (
    BatchObserver,
    Command,
    DueTimeReached,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    TimerEntry,
    TraceContext,
)
from timer_core.instrumentation import NO_INSTRUMENTATION
from timer_service.census import Census
from timer_service.metrics import (
    COUNTED_AS,
    LATENESS_BUCKETS,
    POLL_BUCKETS,
    WorstTenants,
    firing_lateness,
    quarantine_age,
)
from timer_service.settings import OTEL_LATENESS_SAMPLE

__all__ = ["OtelInstrumentation", "configure"]

log = logging.getLogger(__name__)

_SCOPE = "timer_service"


def _span_context(context: TraceContext) -> SpanContext:
    """The remote span a stored trace context names."""
    trace_state = (
        TraceState.from_header([context.tracestate]) if context.tracestate else TraceState()
    )
    return SpanContext(
        trace_id=int(context.trace_id, 16),
        span_id=int(context.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(context.traceparent[53:55], 16)),
        trace_state=trace_state,
    )


def _trace_context(span_context: SpanContext) -> TraceContext:
    """A span's context as Timer carries it (the W3C header values)."""
    state = span_context.trace_state.to_header() if span_context.trace_state else ""
    return TraceContext(
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{int(span_context.trace_flags):02x}",
        state or None,
    )


def _linked(context: TraceContext) -> SpanContext:
    """The span a link points to: trace and span id are enough (no trace state to parse)."""
    return SpanContext(
        trace_id=int(context.trace_id, 16),
        span_id=int(context.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(context.traceparent[53:55], 16)),
    )


def _tenant_attributes(envelopes: Iterable[MessageEnvelope[Any]]) -> dict[str, Any]:
    """``timer.tenant_id`` when a batch is one tenant's, else the number of tenants."""
    distinct = {envelope.payload.tenant_id for envelope in envelopes}
    if len(distinct) == 1:
        return {"timer.tenant_id": next(iter(distinct))}
    return {"timer.tenant_count": len(distinct)}


class _CommandsObserver(BatchObserver):
    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def finished(self, error: BaseException | None = None) -> None:
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, str(error)))
        self._span.end()


class _FiringObserver(BatchObserver):
    """The batch's ``timer.fire`` span and the ``timer.due`` span of each traced timer in it."""

    __slots__ = ("_batch", "_timers")

    def __init__(self, batch: trace.Span, timers: list[tuple[int, trace.Span]]) -> None:
        self._batch = batch
        self._timers = timers

    def published(self, results: Sequence[PublishError | None]) -> None:
        failed = len(results) - results.count(None)
        self._batch.set_attribute("timer.published", len(results) - failed)
        if failed:
            self._batch.set_attribute("timer.publish_failures", failed)
        for index, span in self._timers:
            error = results[index]
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, str(error)))

    def finished(self, error: BaseException | None = None) -> None:
        if error is not None:
            self._batch.record_exception(error)
            self._batch.set_status(Status(StatusCode.ERROR, str(error)))
        for _, span in self._timers:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, str(error)))
            span.end()
        self._batch.end()


@attrs.define
class _Gauges:
    """The latest values behind the observable gauges."""

    pending: int | None = None
    instances: int | None = None
    quarantined: int | None = None
    quarantined_since: datetime | None = None
    last_poll: float | None = None
    census: Census | None = None
    clock_skew: Callable[[], float | None] | None = None


class OtelInstrumentation(Instrumentation):
    """Traces and metrics through the OpenTelemetry API, then whatever ``inner`` does.

    ``inner`` (e.g. the service's :class:`~timer_service.metrics.PrometheusInstrumentation`)
    sees every call as if it were used alone. The providers default to the global ones;
    ``timer_spans`` adds a ``timer.due`` span per traced timer (see the module docstring).
    The metrics are the Prometheus ones under OpenTelemetry names: ``timer.commands.received``
    (attribute ``outcome``), ``timer.schedules.processed``, ``timer.publish.failures``,
    ``timer.quarantined``, ``timer.worker.errors``, ``timer.polling.duration`` and
    ``timer.firing.lateness`` (histograms, seconds), ``timer.timers.pending``,
    ``timer.instances.sharing``, ``timer.timers.quarantined``, ``timer.oldest_quarantined``
    and ``timer.last_poll.timestamp``, ``timer.timers.due`` (attribute ``due``) and
    ``timer.oldest_overdue``, ``timer.census.cap``, ``timer.census.duration`` (gauges; set
    the first two with :meth:`set_pending` and :meth:`set_instances`, the census ones with
    :meth:`set_census`).
    ``timer.instances.sharing``, ``timer.timers.quarantined``, ``timer.clock.skew`` and
    ``timer.last_poll.timestamp`` (gauges; set the first two with :meth:`set_pending` and
    :meth:`set_instances`, the skew's source with :meth:`set_clock_skew`).
    ``timer.firing.lateness`` records one fired timer in ``lateness_sample`` (see the module
    docstring); the rest count every timer.
    """

    def __init__(
        self,
        inner: Instrumentation = NO_INSTRUMENTATION,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        timer_spans: bool = False,
        lateness_sample: int = OTEL_LATENESS_SAMPLE,
    ) -> None:
        if lateness_sample < 1:
            raise ValueError(f"lateness_sample must be 1 or more, not {lateness_sample}")
        self.inner = inner
        self.timer_spans = timer_spans
        self.lateness_sample = lateness_sample
        # Per lateness bucket, how many of its timers fired since its last recorded one
        # (modulo lateness_sample; 0: record the next). It runs on across batches, so a
        # bucket's timers count alike whatever the size of the batch they fired in.
        self._lateness_skipped = [0] * (len(LATENESS_BUCKETS) + 1)
        self._tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, meter_provider=meter_provider)
        self._commands = meter.create_counter(
            "timer.commands.received",
            unit="{command}",
            description="Commands received, by outcome (stored, ignored, stale, rejected).",
        )
        self._processed = meter.create_counter(
            "timer.schedules.processed",
            unit="{timer}",
            description="Timers fired: DueTimeReached acknowledged and marked Reached.",
        )
        self._publish_failures = meter.create_counter(
            "timer.publish.failures",
            unit="{event}",
            description="DueTimeReached publishes not acknowledged (the timer stays Scheduled).",
        )
        self._quarantines = meter.create_counter(
            "timer.quarantined",
            unit="{timer}",
            description="Timers quarantined: their publish kept failing while others' did not.",
        )
        self._worker_errors = meter.create_counter(
            "timer.worker.errors",
            unit="{pass}",
            description="Worker passes that failed as a whole; retried with backoff.",
        )
        self._purged = meter.create_counter(
            "timer.timers.purged",
            unit="{timer}",
            description="Fired timers (and cancel tombstones) deleted by retention.",
        )
        self._broker_state_recreated = meter.create_counter(
            "timer.broker_state.recreated",
            unit="{object}",
            description="Streams and consumers found missing while running and recreated.",
        )
        self._polling = meter.create_histogram(
            "timer.polling.duration",
            unit="s",
            description="Duration of one worker pass (find due, publish, mark).",
            explicit_bucket_boundaries_advisory=POLL_BUCKETS,
        )
        self._lateness = meter.create_histogram(
            "timer.firing.lateness",
            unit="s",
            description=(
                "Firing lateness: reachedAt - max(dueAt, registeredAt), recorded for one "
                "fired timer in "
                f"{lateness_sample} of each bucket."
            ),
            explicit_bucket_boundaries_advisory=LATENESS_BUCKETS,
        )
        self._gauges = _Gauges()
        self._worst_tenants = WorstTenants()
        meter.create_observable_gauge(
            "timer.tenant.lateness.worst",
            callbacks=[self._observe_worst_tenants],
            unit="s",
            description=(
                f"Highest firing lateness of each of the {self._worst_tenants.top} tenants whose "
                "timers fired latest in the last 1-2 minutes (attribute tenant)."
            ),
        )
        meter.create_observable_gauge(
            "timer.timers.pending",
            callbacks=[self._observe_pending],
            unit="{timer}",
            description="Timers stored and still Scheduled.",
        )
        meter.create_observable_gauge(
            "timer.instances.sharing",
            callbacks=[self._observe_instances],
            unit="{instance}",
            description="Instances sharing the tenants, this one included.",
        )
        meter.create_observable_gauge(
            "timer.timers.quarantined",
            callbacks=[self._observe_quarantined],
            unit="{timer}",
            description="Timers quarantined now (left out of every pass until retried).",
        )
        meter.create_observable_gauge(
            "timer.oldest_quarantined",
            callbacks=[self._observe_oldest_quarantined],
            unit="s",
            description="How long the longest-quarantined timer has been held (0 when none is).",
        )
        meter.create_observable_gauge(
            "timer.timers.due",
            callbacks=[self._observe_due],
            unit="{timer}",
            description=(
                "Pending timers by when they are due (attribute due: overdue, 1m, 1h, 1d, "
                "later), each counted up to the census cap."
            ),
        )
        meter.create_observable_gauge(
            "timer.oldest_overdue",
            callbacks=[self._from_census(lambda census: census.oldest_overdue_s)],
            unit="s",
            description="How long the oldest pending timer has been overdue (0 when none is).",
        )
        meter.create_observable_gauge(
            "timer.census.cap",
            callbacks=[self._from_census(lambda census: census.cap)],
            unit="{timer}",
            description="The count at which each census bucket stops (TIMER_CENSUS_CAP).",
        )
        meter.create_observable_gauge(
            "timer.census.duration",
            callbacks=[self._from_census(lambda census: census.duration_s)],
            unit="s",
            description="How long the last census took.",
        )
        meter.create_observable_gauge(
            "timer.clock.skew",
            callbacks=[self._observe_clock_skew],
            unit="s",
            description=(
                "This host's wall clock minus the clock that decides due times (PostgreSQL's); "
                "positive: the host is ahead."
            ),
        )
        meter.create_observable_gauge(
            "timer.last_poll.timestamp",
            callbacks=[self._observe_last_poll],
            unit="s",
            description="Unix time of the last completed worker pass.",
        )
        self._forward_other_hooks()

    def _forward_other_hooks(self) -> None:
        # A hook added to Instrumentation later still reaches ``inner`` unchanged.
        for name, value in vars(Instrumentation).items():
            if callable(value) and not name.startswith("_") and name not in vars(type(self)):
                setattr(self, name, getattr(self.inner, name))

    # -- gauges -------------------------------------------------------------------------------

    def set_pending(self, count: int) -> None:
        """Report how many timers are stored and still ``Scheduled``."""
        self._gauges.pending = count

    def _observe_pending(self, options: CallbackOptions) -> Iterable[Observation]:
        pending = self._gauges.pending
        return () if pending is None else (Observation(pending),)

    def broker_state_recreated(self, what: str) -> None:
        """Count a stream or consumer (``what``) found missing and recreated."""
        self._broker_state_recreated.add(1, {"what": what})

    def set_instances(self, count: int) -> None:
        """Report how many instances share the tenants, this one included."""
        self._gauges.instances = count

    def _observe_instances(self, options: CallbackOptions) -> Iterable[Observation]:
        instances = self._gauges.instances
        return () if instances is None else (Observation(instances),)

    def set_census(self, census: Census) -> None:
        """Report a census of pending timers (``timer.timers.due``, ``timer.oldest_overdue``)."""
        self._gauges.census = census

    def _observe_worst_tenants(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(late, {"tenant": t}) for t, late in self._worst_tenants.worst()]

    def _observe_due(self, options: CallbackOptions) -> Iterable[Observation]:
        census = self._gauges.census
        if census is None:
            return ()
        return [Observation(count, {"due": bucket}) for bucket, count in census.counts.items()]

    def _from_census(
        self, value: Callable[[Census], float]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A gauge callback observing ``value`` of the latest census (nothing before one)."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            census = self._gauges.census
            return () if census is None else (Observation(value(census)),)

        return observe

    def set_clock_skew(self, read: Callable[[], float | None]) -> None:
        """Report the clock skew (seconds, host minus the deciding clock) that ``read()``
        gives when the gauge is observed (None: nothing to report)."""
        self._gauges.clock_skew = read

    def _observe_clock_skew(self, options: CallbackOptions) -> Iterable[Observation]:
        read = self._gauges.clock_skew
        skew = None if read is None else read()
        return () if skew is None else (Observation(skew),)

    def _observe_quarantined(self, options: CallbackOptions) -> Iterable[Observation]:
        quarantined = self._gauges.quarantined
        return () if quarantined is None else (Observation(quarantined),)

    def _observe_oldest_quarantined(self, options: CallbackOptions) -> Iterable[Observation]:
        return (Observation(quarantine_age(self._gauges.quarantined_since)),)

    def _observe_last_poll(self, options: CallbackOptions) -> Iterable[Observation]:
        last = self._gauges.last_poll
        return () if last is None else (Observation(last),)

    # -- spans --------------------------------------------------------------------------------

    def commands_started(self, envelopes: Sequence[MessageEnvelope[Command]]) -> BatchObserver:
        links = [
            Link(_span_context(envelope.trace_context))
            for envelope in envelopes
            if envelope.trace_context is not None
        ]
        attributes: dict[str, Any] = {"timer.batch_size": len(envelopes)}
        attributes.update(_tenant_attributes(envelopes))
        span = self._tracer.start_span(
            "timer.commands.store", kind=SpanKind.CONSUMER, attributes=attributes, links=links
        )
        inner = self.inner.commands_started(envelopes)
        return _span_then(_CommandsObserver(span), inner)

    def firing_started(self, envelopes: list[MessageEnvelope[DueTimeReached]]) -> BatchObserver:
        start = time.time_ns()
        attributes: dict[str, Any] = {"timer.batch_size": len(envelopes)}
        attributes.update(_tenant_attributes(envelopes))
        traced = [
            (index, envelope.trace_context)
            for index, envelope in enumerate(envelopes)
            if envelope.trace_context is not None
        ]
        if not self.timer_spans:
            # One span for the batch, linked to every scheduling span (as far as the SDK's
            # link limit goes); traced timers' events carry its context.
            links = [Link(_linked(context)) for _, context in traced]
            batch = self._tracer.start_span(
                "timer.fire",
                kind=SpanKind.PRODUCER,
                attributes=attributes,
                links=links,
                start_time=start,
            )
            if traced:
                carried = _trace_context(batch.get_span_context())
                for index, _ in traced:
                    envelopes[index] = envelopes[index].with_trace_context(carried)
            return _span_then(_FiringObserver(batch, []), self.inner.firing_started(envelopes))
        batch = self._tracer.start_span("timer.fire", attributes=attributes, start_time=start)
        timers: list[tuple[int, trace.Span]] = []
        for index, context in traced:
            envelope = envelopes[index]
            remote = _span_context(context)
            payload = envelope.payload
            span = self._tracer.start_span(
                "timer.due",
                context=trace.set_span_in_context(NonRecordingSpan(remote)),
                kind=SpanKind.PRODUCER,
                links=[Link(remote)],
                attributes={
                    "timer.tenant_id": payload.tenant_id,
                    "timer.service_call_id": payload.service_call_id,
                    "messaging.message.id": str(envelope.id),
                },
                start_time=start,
            )
            timers.append((index, span))
            envelopes[index] = envelope.with_trace_context(_trace_context(span.get_span_context()))
        return _span_then(_FiringObserver(batch, timers), self.inner.firing_started(envelopes))

    # -- metrics, then the inner instrumentation ---------------------------------------------

    def command_handled(self, envelope: MessageEnvelope[Command], outcome: str) -> None:
        self._commands.add(1, {"outcome": COUNTED_AS[outcome]})
        self.inner.command_handled(envelope, outcome)

    def commands_handled(
        self, envelopes: Sequence[MessageEnvelope[Command]], outcomes: Sequence[str]
    ) -> None:
        for outcome, count in collections.Counter(outcomes).items():
            self._commands.add(count, {"outcome": COUNTED_AS[outcome]})
        self.inner.commands_handled(envelopes, outcomes)

    def command_rejected(self, subject: str, reason: str) -> None:
        self._commands.add(1, {"outcome": "rejected"})
        self.inner.command_rejected(subject, reason)

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self._processed.add(len(entries))
        record = self._lateness.record
        every = self.lateness_sample
        amounts = firing_lateness(entries)
        self._worst_tenants.observe(entries, amounts)
        if every == 1:
            for lateness in amounts:
                record(lateness)
        else:
            skipped = self._lateness_skipped
            for lateness in amounts:
                # The bucket the SDK counts it in: upper bounds inclusive.
                bucket = bisect_left(LATENESS_BUCKETS, lateness)
                if skipped[bucket]:
                    skipped[bucket] = (skipped[bucket] + 1) % every
                else:
                    record(lateness)
                    skipped[bucket] = 1
        self.inner.timers_fired(entries)

    def publish_failed(self, entry: TimerEntry, error: PublishError) -> None:
        self._publish_failures.add(1)
        self.inner.publish_failed(entry, error)

    def timer_quarantined(self, entry: TimerEntry, error: PublishError, failures: int) -> None:
        self._quarantines.add(1)
        self.inner.timer_quarantined(entry, error, failures)

    def quarantine_size(self, count: int) -> None:
        self._gauges.quarantined = count
        self.inner.quarantine_size(count)

    def quarantine_oldest(self, since: datetime | None) -> None:
        self._gauges.quarantined_since = since
        self.inner.quarantine_oldest(since)

    def poll_completed(self, duration_s: float, fired: int) -> None:
        self._polling.record(duration_s)
        self._gauges.last_poll = time.time()
        self.inner.poll_completed(duration_s, fired)

    def worker_error(self, error: BaseException) -> None:
        self._worker_errors.add(1)
        self.inner.worker_error(error)

    def timers_purged(self, count: int) -> None:
        self._purged.add(count)
        self.inner.timers_purged(count)


class _Both(BatchObserver):
    __slots__ = ("_first", "_second")

    def __init__(self, first: BatchObserver, second: BatchObserver) -> None:
        self._first = first
        self._second = second

    def published(self, results: Sequence[PublishError | None]) -> None:
        self._first.published(results)
        self._second.published(results)

    def finished(self, error: BaseException | None = None) -> None:
        self._first.finished(error)
        self._second.finished(error)


def _span_then(span: BatchObserver, inner: BatchObserver) -> BatchObserver:
    """One observer telling ``span`` first, then ``inner`` (left out when it does nothing)."""
    if type(inner) is BatchObserver:
        return span
    return _Both(span, inner)


# -- timer-service's setup ---------------------------------------------------------------------


def _signal_endpoint(env: Mapping[str, str], signal: str, protocol: str) -> str | None:
    """Where OTLP sends one signal (``traces`` or ``metrics``), as the SDK would resolve it
    from ``env``: the per-signal variable, else the general one (with ``/v1/<signal>``
    appended over HTTP); ``None`` when neither is set, so that signal is not exported."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if own:
        return own
    general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not general:
        return None
    if protocol == "grpc":
        return general
    return f"{general.rstrip('/')}/v1/{signal}"


def _otlp_exporters(protocol: str) -> tuple[Any, Any]:
    """The OTLP span and metric exporter classes of ``protocol`` (``grpc`` or HTTP)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter, OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter, HttpMetricExporter


def configure(
    environ: Mapping[str, str] | None = None,
) -> tuple[TracerProvider, MeterProvider, Callable[[], None]]:
    """SDK providers for ``timer-service``, set as the global ones, and a shutdown function.

    The resource comes from ``OTEL_SERVICE_NAME`` (default ``timer-service``) and
    ``OTEL_RESOURCE_ATTRIBUTES``. Each signal is exported by OTLP only when an endpoint is
    configured for it: spans with ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, metrics with ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` (protocol from ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    ``http/protobuf`` by default, or ``grpc``). A signal without an endpoint is made (events
    still carry the firing's trace context) but not exported, never sent to the SDK's
    default ``localhost:4318``.
    """
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if environ is None else environ
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "timer-service"})
    tracer_provider = SdkTracerProvider(resource=resource)
    readers: list[MetricReader] = []
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip().lower()
    traces_to = _signal_endpoint(env, "traces", protocol)
    metrics_to = _signal_endpoint(env, "metrics", protocol)
    if traces_to is None and metrics_to is None:
        log.info("OpenTelemetry on, but no OTLP endpoint is configured: nothing is exported")
    else:
        span_exporter, metric_exporter = _otlp_exporters(protocol)
        if traces_to is not None:
            tracer_provider.add_span_processor(
                BatchSpanProcessor(span_exporter(endpoint=traces_to))
            )
        if metrics_to is not None:
            readers.append(PeriodicExportingMetricReader(metric_exporter(endpoint=metrics_to)))
        log.info(
            "OpenTelemetry on: spans %s, metrics %s (OTLP %s)",
            f"to {traces_to}" if traces_to else "not exported (no traces endpoint set)",
            f"to {metrics_to}" if metrics_to else "not exported (no metrics endpoint set)",
            protocol,
        )
    meter_provider = SdkMeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    return tracer_provider, meter_provider, shutdown
