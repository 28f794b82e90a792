"""The host's consumer of DueTimeReached: typed deliveries, acks, redelivery, tenant filter,
durable resume and malformed events, against a real nats-server."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.timer_adapters_nats.jetstream import LONG_POLL_S, PROMPT_STOP_S, polling, wait_until
from timer_adapters_nats import (
    DueEventConsumer,
    DueEventConsumerSettings,
    DueEventDelivery,
    NatsBroker,
    NatsServerProcess,
    NatsSettings,
)
from timer_core import (
    DueTimeReached,
    MessageEnvelope,
    PublishError,
    TimerError,
    Uuid7EnvelopeIds,
    ValidationError,
)
from timer_core.codec import encode_envelope
from timer_core.instants import to_epoch_ms

DUE = datetime(2032, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
FAST = DueEventConsumerSettings(nak_delay_s=0.05, max_nak_delay_s=0.2, fetch_timeout_s=0.2)
_IDS = Uuid7EnvelopeIds()


def due_event(tenant: str = "tenant-a", call: str = "call-1") -> MessageEnvelope[DueTimeReached]:
    """A DueTimeReached envelope as the timer service publishes it."""
    reached = DUE + timedelta(milliseconds=12)
    return MessageEnvelope(
        id=_IDS.new_id(),
        payload=DueTimeReached(tenant, call, DUE, reached),
        timestamp_ms=to_epoch_ms(reached),
        aggregate_id=call,
        correlation_id="trace-1",
    )


async def publish(broker: NatsBroker, *envelopes: MessageEnvelope[DueTimeReached]) -> None:
    """Publish events the way the timer service does (acked by the events stream)."""
    for envelope in envelopes:
        await broker.publisher.publish(envelope)


async def published(broker: NatsBroker, envelope: MessageEnvelope[DueTimeReached]) -> bool:
    """Whether publishing succeeded (JetStream recovers its streams a moment after a start)."""
    try:
        await broker.publisher.publish(envelope)
    except PublishError:
        return False
    return True


async def next_delivery(events: DueEventConsumer, within: float = 10.0) -> DueEventDelivery:
    """The next delivery, failing the test if none comes within ``within`` seconds."""
    return await asyncio.wait_for(anext(events), within)


async def settled_everything(broker: NatsBroker, name: str) -> bool:
    """Whether the consumer has nothing pending and nothing awaiting an ack."""
    await broker.client.flush()
    info = await broker.jetstream.consumer_info(broker.settings.events_stream, name)
    return info.num_pending == 0 and info.num_ack_pending == 0


class TestDeliveries:
    """Decoding and settling one event at a time."""

    async def test_delivery_is_the_typed_envelope(self, broker: NatsBroker) -> None:
        """A published DueTimeReached arrives decoded: the same envelope, id and delivery count."""
        sent = due_event()
        await publish(broker, sent)
        async with broker.due_events("host", settings=FAST) as events:
            delivery = await next_delivery(events)
            async with delivery:
                assert delivery.envelope == sent
                assert isinstance(delivery.event, DueTimeReached)
                assert delivery.event.due_at == DUE
                assert delivery.id == sent.id
                assert delivery.num_delivered == 1
                assert not delivery.redelivered
                assert delivery.subject == "timer.events.tenant-a.call-1"
                assert delivery.stream_sequence == 1

    async def test_ack_on_success_removes_it(self, broker: NatsBroker) -> None:
        """A block that ends normally acks the event: the consumer holds nothing more."""
        await publish(broker, due_event())
        async with broker.due_events("host", settings=FAST) as events:
            delivery = await next_delivery(events)
            async with delivery:
                pass
            assert delivery.settled == "ack"
            await wait_until(lambda: settled_everything(broker, "host"), what="the ack")

    async def test_exception_naks_and_it_is_redelivered(
        self, broker: NatsBroker, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A block that raises naks the event (logged, not raised) and it comes back."""
        sent = due_event()
        await publish(broker, sent)
        async with broker.due_events("host", settings=FAST) as events:
            first = await next_delivery(events)
            with caplog.at_level(logging.ERROR, logger="timer_adapters_nats"):
                async with first:
                    raise RuntimeError("handler broke")
            assert first.settled == "nak"
            assert "handler broke" in caplog.text
            again = await next_delivery(events)
            assert again.id == sent.id
            assert again.num_delivered == 2
            assert again.redelivered
            await again.ack()
            await wait_until(lambda: settled_everything(broker, "host"), what="the ack")

    async def test_explicit_settle_wins_over_the_block(self, broker: NatsBroker) -> None:
        """A term inside the block stays a term: the exit does not ack it again."""
        await publish(broker, due_event(), due_event(call="call-2"))
        async with broker.due_events("host", settings=FAST) as events:
            delivery = await next_delivery(events)
            async with delivery:
                await delivery.term()
            assert delivery.settled == "term"
            following = await next_delivery(events)
            assert following.event.service_call_id == "call-2"
            await following.ack()

    async def test_long_handling_is_kept_from_redelivery(self, broker: NatsBroker) -> None:
        """An event handled for longer than the ack wait is not handed to another reader."""
        await publish(broker, due_event())
        # Keep-alives every half second: a stall of the loop up to a second is tolerated.
        settings = DueEventConsumerSettings(ack_wait_s=1.5, fetch_timeout_s=0.2)
        async with (
            broker.due_events("host", settings=settings) as events,
            broker.due_events("host", settings=settings) as other_reader,
        ):
            delivery = await next_delivery(events)
            async with delivery:
                # The handling lasts over two ack waits while another reader asks.
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(anext(other_reader), 3.5)
            info = await broker.jetstream.consumer_info(broker.settings.events_stream, "host")
            assert info.num_redelivered == 0
            await wait_until(lambda: settled_everything(broker, "host"), what="the ack")


class TestFilterAndResume:
    """Which events a consumer sees, and where a durable one picks up."""

    async def test_tenant_filter_reads_one_tenant(self, broker: NatsBroker) -> None:
        """A consumer for tenant-a gets tenant-a's events and never tenant-b's."""
        await publish(
            broker, due_event("tenant-a", "c1"), due_event("tenant-b", "c2"), due_event("tenant-a")
        )
        async with broker.due_events("a-only", tenant_id="tenant-a", settings=FAST) as events:
            got = []
            for _ in range(2):
                delivery = await next_delivery(events)
                async with delivery:
                    got.append(delivery.event.tenant_id)
            assert got == ["tenant-a", "tenant-a"]
            await wait_until(lambda: settled_everything(broker, "a-only"), what="the acks")
            assert events.filter_subject == "timer.events.tenant-a.>"

    async def test_durable_consumer_resumes_on_a_new_connection(
        self, broker: NatsBroker, settings: NatsSettings
    ) -> None:
        """A new connection with the same consumer name gets what is unacked, not what was acked."""
        first, second = due_event(call="c1"), due_event(call="c2")
        await publish(broker, first, second)
        async with broker.due_events("host", settings=FAST) as events:
            delivery = await next_delivery(events)
            async with delivery:
                assert delivery.id == first.id
        async with NatsBroker(settings) as other, other.due_events("host", settings=FAST) as again:
            delivery = await next_delivery(again)
            assert delivery.id == second.id
            await delivery.ack()

    async def test_iteration_survives_a_server_restart(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> None:
        """The iteration goes on across a server restart and gets the events published after."""
        await publish(broker, due_event(call="before"))
        async with broker.due_events("host", settings=FAST) as events:
            delivery = await next_delivery(events)
            await delivery.ack()
            await broker.client.flush()
            nats_server.stop()
            await wait_until(lambda: not broker.is_connected, what="the disconnect")
            nats_server.start()
            await wait_until(lambda: broker.is_connected, what="the reconnect")
            after = due_event(call="after")
            await wait_until(lambda: published(broker, after), what="JetStream back", within=20)
            delivery = await next_delivery(events, within=20.0)
            assert delivery.id == after.id
            await delivery.ack()

    async def test_events_fetched_but_not_handed_out_go_back_at_exit(
        self, broker: NatsBroker
    ) -> None:
        """Leaving the block hands the rest of a fetched batch back at once, not after ack wait."""
        await publish(broker, due_event(call="c1"), due_event(call="c2"), due_event(call="c3"))
        slow = DueEventConsumerSettings(ack_wait_s=60.0, fetch_timeout_s=0.2, fetch_batch=10)
        async with broker.due_events("host", settings=slow) as events:
            delivery = await next_delivery(events)
            await delivery.ack()
        async with broker.due_events("host", settings=slow) as events:
            rest = [await next_delivery(events, within=20.0) for _ in range(2)]
            assert [d.event.service_call_id for d in rest] == ["c2", "c3"]
            for delivery in rest:
                await delivery.ack()

    async def test_stop_ends_an_iteration_waiting_in_a_long_poll_at_once(
        self, broker: NatsBroker
    ) -> None:
        """stop() ends an iteration waiting in a 30 s long poll, and leaving the block
        withdraws the poll, together in under PROMPT_STOP_S."""
        slow = DueEventConsumerSettings(fetch_timeout_s=LONG_POLL_S)
        async with broker.due_events("host", settings=slow) as events:
            waiting = asyncio.ensure_future(anext(events))
            await wait_until(lambda: polling(broker, "host"), what="the long poll")
            stopping = time.monotonic()
            await events.stop()
            with pytest.raises(StopAsyncIteration):
                await waiting
        took = time.monotonic() - stopping
        assert took < PROMPT_STOP_S, f"stopping took {took:.2f}s"
        assert not await polling(broker, "host")


class TestMalformedAndMisuse:
    """What cannot be read is skipped with a log line; wrong arguments fail at once."""

    async def test_malformed_event_is_terminated_and_skipped(
        self, broker: NatsBroker, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Garbage and a body of another tenant than its subject are terminated; the next
        event is delivered and the consumer ends up with nothing pending."""
        js = broker.jetstream
        await js.publish("timer.events.tenant-a.call-1", b"not json")
        await js.publish("timer.events.tenant-b.call-1", encode_envelope(due_event()))
        good = due_event(call="good")
        await publish(broker, good)
        with caplog.at_level(logging.WARNING, logger="timer_adapters_nats"):
            async with broker.due_events("host", settings=FAST) as events:
                delivery = await next_delivery(events)
                assert delivery.id == good.id
                await delivery.ack()
                await wait_until(lambda: settled_everything(broker, "host"), what="settling")
        malformed = [r for r in caplog.records if "malformed DueTimeReached" in r.getMessage()]
        assert len(malformed) == 2
        assert "not valid JSON" in malformed[0].getMessage()
        assert "tenant-b" in malformed[1].getMessage()

    async def test_missing_consumer_without_provisioning_is_a_clear_error(
        self, broker: NatsBroker
    ) -> None:
        """With provisioning off, a consumer that does not exist fails at start, by name."""
        settings = DueEventConsumerSettings(provision=False)
        with pytest.raises(TimerError, match="nobody"):
            async with broker.due_events("nobody", settings=settings):
                pass

    async def test_unchangeable_setting_is_a_clear_error(self, broker: NatsBroker) -> None:
        """Asking an existing consumer for another deliver policy names it and the way out."""
        async with broker.due_events("host", settings=FAST):
            pass
        new_only = DueEventConsumerSettings(deliver_policy="new")
        with pytest.raises(TimerError, match=r"consumer host .*delete the consumer"):
            async with broker.due_events("host", settings=new_only):
                pass

    def test_bad_names_are_refused(self, broker: NatsBroker) -> None:
        """A consumer name with a dot or a tenant id with a space is refused before any I/O."""
        with pytest.raises(ValueError, match="consumer name"):
            broker.due_events("bad.name")
        with pytest.raises(ValidationError):
            broker.due_events("host", tenant_id="tenant a")
        with pytest.raises(ValueError, match="max_deliver"):
            DueEventConsumerSettings(max_deliver=0)
