"""W3C trace context over a real nats-server: in with ScheduleTimer, out with DueTimeReached."""

from __future__ import annotations

from datetime import timedelta

import attrs
from hypothesis import given
from opentelemetry.sdk.trace import TracerProvider

from tests.timer_adapters_nats.jetstream import read_stream, wait_until
from tests.timer_adapters_nats.test_end_to_end import T0, StoringHandler, running
from timer_adapters_memory import FakeClock, MemoryTimerStore
from timer_adapters_nats import NatsBroker, TimerClient
from timer_core import (
    DueTimeReached,
    MessageEnvelope,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TraceContext,
)
from timer_core.codec import _encode_envelope, decode_command, encode_envelope
from timer_core.events import build_due_event
from timer_core.firing import FiringPipeline
from timer_core.testing import strategies as ts

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def schedule_and_fire(
    broker: NatsBroker, client: TimerClient, **schedule: object
) -> tuple[MemoryTimerStore, list[dict[str, str]], list[dict[str, str]]]:
    """Schedule one timer through the broker, fire it; the stored timer and both headers."""
    clock = FakeClock(T0)
    store = MemoryTimerStore()
    await store.start()
    handler = StoringHandler(store, clock)
    due = T0 + timedelta(seconds=5)
    command_id = await client.schedule("tenant-t", "call-t", due, **schedule)  # type: ignore[arg-type]
    source = broker.command_source()
    async with running(source.run(handler)):
        await wait_until(lambda: handler.deliveries[command_id] == 1, what="the command")
        await source.stop()
    clock.set_wall(due)
    report = await FiringPipeline(store, broker.publisher, clock, batch_size=10).fire()
    assert len(report.fired) == 1
    commands = [m.headers for m in await read_stream(broker.jetstream, "TIMER_COMMANDS")]
    events = [m.headers for m in await read_stream(broker.jetstream, "TIMER_EVENTS")]
    return store, commands, events


class TestTraceContextAcrossTheTimer:
    async def test_trace_headers_are_stored_and_carried_to_the_event(
        self, broker: NatsBroker
    ) -> None:
        """A ScheduleTimer's trace headers are kept with the timer and sent with its event."""
        client = TimerClient(broker, clock=FakeClock(T0))
        context = TraceContext(TRACEPARENT, "vendor=opaque")
        store, commands, events = await schedule_and_fire(broker, client, trace_context=context)
        stored = await store.get(TenantId("tenant-t"), ServiceCallId("call-t"))
        assert stored is not None and stored.trace_context == context
        assert commands[0]["traceparent"] == TRACEPARENT
        assert events[0]["traceparent"] == TRACEPARENT
        assert events[0]["tracestate"] == "vendor=opaque"

    async def test_without_context_the_headers_are_unchanged(self, broker: NatsBroker) -> None:
        """No active span, no trace context: the command carries no header, the event
        only its Nats-Msg-Id."""
        client = TimerClient(broker, clock=FakeClock(T0))
        store, commands, events = await schedule_and_fire(broker, client)
        assert set(commands[0]) == set()
        assert set(events[0]) == {"Nats-Msg-Id"}
        stored = await store.get(TenantId("tenant-t"), ServiceCallId("call-t"))
        assert stored is not None and stored.trace_context is None

    async def test_client_sends_the_current_span(self, broker: NatsBroker) -> None:
        """TimerClient.schedule inside an OpenTelemetry span sends that span's context."""
        tracer = TracerProvider().get_tracer("test")
        client = TimerClient(broker, clock=FakeClock(T0))
        with tracer.start_as_current_span("request") as span:
            store, commands, _ = await schedule_and_fire(broker, client)
        span_context = span.get_span_context()
        parent = (
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
            f"-{int(span_context.trace_flags):02x}"
        )
        assert commands[0]["traceparent"] == parent
        stored = await store.get(TenantId("tenant-t"), ServiceCallId("call-t"))
        assert stored is not None and stored.trace_context == TraceContext(parent)

    async def test_an_invalid_traceparent_is_ignored_not_dead_lettered(
        self, broker: NatsBroker
    ) -> None:
        """A command with a malformed traceparent header is stored, without a trace context."""
        client = TimerClient(broker, clock=FakeClock(T0))
        envelope = client.schedule_envelope("tenant-t", "call-t", T0)
        await broker.client.publish(
            client.subjects.commands(envelope.tenant_id),
            encode_envelope(envelope),
            headers={"traceparent": "00-not-a-trace-01", "Nats-Msg-Id": str(envelope.id)},
        )
        store = MemoryTimerStore()
        await store.start()
        handler = StoringHandler(store, FakeClock(T0))
        source = broker.command_source()
        async with running(source.run(handler)):
            await wait_until(lambda: handler.deliveries[envelope.id] == 1, what="the command")
            await source.stop()
        stored = await store.get(TenantId("tenant-t"), ServiceCallId("call-t"))
        assert stored is not None and stored.trace_context is None


class TestNothingChangesOnTheWire:
    @given(ts.timer_entries(), ts.utc_datetimes(), ts.trace_contexts())
    def test_event_body_is_the_same_with_or_without_a_context(
        self, entry: TimerEntry, reached: object, context: TraceContext
    ) -> None:
        """A DueTimeReached's JSON is byte-identical whether its timer had a trace context."""
        plain = attrs.evolve(entry, trace_context=None, state="Scheduled", reached_at=None)
        traced = attrs.evolve(plain, trace_context=context)
        at = max(plain.due_at, reached)  # type: ignore[call-overload]
        plain_event = build_due_event(plain, at)
        traced_event = build_due_event(traced, at)
        assert traced_event.trace_context == context
        assert plain_event.trace_context is None
        assert encode_envelope(traced_event) == encode_envelope(plain_event)
        assert _encode_envelope(traced_event) == _encode_envelope(plain_event)

    @given(ts.command_envelopes(), ts.trace_contexts())
    def test_command_body_is_the_same_with_or_without_a_context(
        self, envelope: MessageEnvelope[DueTimeReached], context: TraceContext
    ) -> None:
        """A command's JSON does not carry the trace context; decoding it gives none."""
        traced = attrs.evolve(envelope, trace_context=context)
        assert encode_envelope(traced) == encode_envelope(envelope)
        assert decode_command(encode_envelope(traced)).trace_context is None
