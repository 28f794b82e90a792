"""MemoryEventBus.due_events: the stand-in for NatsBroker.due_events, settling as JetStream does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryDueEventSettings, MemoryTimerClient
from timer_adapters_nats import DueEventConsumerSettings
from timer_core import NotRunning, ValidationError, WaitTimedOut

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


async def fired(timers: MemoryTimerClient, *calls: str) -> None:
    """Schedule ``calls`` due now and wait until each was published."""
    for call in calls:
        await timers.schedule("shop-1", call, T0)
    await timers.wait_for_published(len(calls))


class TestDeliveries:
    async def test_an_acked_event_is_not_delivered_again(self) -> None:
        """A delivery acked by `async with` is settled and the consumer moves on."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1", "order-2")
            async with timers.bus.due_events("billing") as events:
                async with await events.get() as first:
                    assert first.event.service_call_id == "order-1"
                    assert (first.num_delivered, first.redelivered) == (1, False)
                    assert first.subject == "timer.events.shop-1.order-1"
                second = await events.get()
                await second.ack()
                assert events.acked == [first.id, second.id]
                assert events.pending == 0
                with pytest.raises(WaitTimedOut, match="billing"):
                    await events.get(timeout=0.05)

    async def test_a_failing_handler_gets_the_event_again_after_the_nak_delay(self) -> None:
        """A block that raises naks the event; it comes back after the delay, count one higher."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            settings = MemoryDueEventSettings(nak_delay_s=2.0)
            async with timers.bus.due_events("billing", settings=settings) as events:
                async with await events.get() as delivery:
                    raise RuntimeError("payment service down")
                assert delivery.settled == "nak"
                with pytest.raises(WaitTimedOut, match="1 nak'd event"):
                    await events.get(timeout=0.05)  # not before the delay
                timers.clock.advance(2.0)
                again = await events.get()
                assert (again.id, again.num_delivered, again.redelivered) == (delivery.id, 2, True)

    async def test_nak_delays_double_and_max_deliver_gives_the_event_up(self) -> None:
        """The growing nak delay is the settings'; after max_deliver deliveries it stops."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            settings = MemoryDueEventSettings(max_deliver=3, nak_delay_s=1.0)
            async with timers.bus.due_events("billing", settings=settings) as events:
                for delay in (1.0, 2.0):
                    await (await events.get()).nak()
                    timers.clock.advance(delay)
                last = await events.get()
                assert last.num_delivered == 3
                await last.nak()
                assert events.given_up == [last.id]
                assert events.pending == 0

    async def test_a_terminated_event_never_comes_back(self) -> None:
        """term settles a poison event for good."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            async with timers.bus.due_events("billing") as events:
                delivery = await events.get()
                await delivery.term()
                await delivery.ack()  # later settles are no-ops
                assert events.terminated == [delivery.id]
                assert events.acked == []


class TestDurableConsumers:
    async def test_a_durable_consumer_resumes_where_it_stopped(self) -> None:
        """A new `async with` on the same name starts after the acked events."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1", "order-2")
            async with timers.bus.due_events("billing") as events:
                await (await events.get()).ack()
            async with timers.bus.due_events("billing") as events:
                assert (await events.get()).event.service_call_id == "order-2"

    async def test_an_event_left_unsettled_is_handed_back_when_the_reader_leaves(self) -> None:
        """Leaving with a delivery unsettled hands it back at once, as after the ack wait."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            async with timers.bus.due_events("billing") as events:
                first = await events.get()
            async with timers.bus.due_events("billing") as events:
                again = await events.get()
        assert (again.id, again.num_delivered) == (first.id, 2)

    async def test_other_names_and_tenant_filters_read_on_their_own(self) -> None:
        """Each name keeps its own place; a tenant filter hides the other tenants' events."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await timers.schedule("shop-2", "order-9", T0)
            await fired(timers, "order-1")
            async with timers.bus.due_events("audit") as audit:
                assert (await audit.get()).event.tenant_id == "shop-2"
            async with timers.bus.due_events("shop1", tenant_id="shop-1") as shop1:
                assert (await shop1.get()).event.service_call_id == "order-1"

    async def test_deliver_policy_new_skips_what_was_published_before(self) -> None:
        """A consumer created with deliver_policy='new' starts at the next event."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            settings = MemoryDueEventSettings(deliver_policy="new")
            async with timers.bus.due_events("late", settings=settings) as events:
                await timers.schedule("shop-1", "order-2", T0)
                assert (await events.get()).event.service_call_id == "order-2"

    async def test_the_nats_settings_fit_the_stand_in(self) -> None:
        """The NATS adapter's DueEventConsumerSettings work here, so host code is the same."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await fired(timers, "order-1")
            settings = DueEventConsumerSettings(nak_delay_s=5.0)
            async with timers.bus.due_events("billing", settings=settings) as events:
                await (await events.get()).nak()
                timers.clock.advance(timedelta(seconds=5))
                assert (await events.get()).num_delivered == 2


class TestMisuse:
    def test_a_bad_consumer_name_is_a_validation_error(self) -> None:
        """A name NATS would refuse is refused here too, at once."""
        with pytest.raises(ValidationError, match="consumer name"):
            MemoryTimerClient().bus.due_events("billing.v2")

    async def test_reading_a_consumer_not_started_says_how_to_start_it(self) -> None:
        """get outside `async with` raises NotRunning naming the fix."""
        events = MemoryTimerClient().bus.due_events("billing")
        with pytest.raises(NotRunning, match="async with"):
            await events.get(timeout=0.05)
