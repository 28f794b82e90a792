"""MemoryTimerClient: TimerClient's calls, driving a real in-memory Timer, for a host's tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryTimerClient
from timer_core import (
    EnvelopeId,
    InvalidIdentifier,
    InvalidTimestamp,
    TimerScheduler,
    TimerState,
    ValidationError,
)

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


async def place_order(timers: TimerScheduler, order: str) -> EnvelopeId:
    """A host's own code: an order gets a thirty-minute payment timeout."""
    return await timers.schedule(
        "shop-1", order, datetime.now(UTC) + timedelta(minutes=30), correlation_id=order
    )


class TestScheduling:
    async def test_a_timer_fires_when_the_fake_clock_reaches_it(self) -> None:
        """Scheduled through the client, the timer fires at its due time and not before."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            due = T0 + timedelta(minutes=30)
            await timers.schedule("shop-1", "order-17", due, correlation_id="req-1")
            timers.clock.advance(timedelta(minutes=29, seconds=59))
            await timers.clock.wait_for_sleepers(1)
            assert timers.bus.published == []
            timers.clock.advance(1)
            (event,) = await timers.bus.wait_for_published(1)
        assert (event.payload.service_call_id, event.payload.due_at) == ("order-17", due)
        assert event.correlation_id == "req-1"

    async def test_schedule_returns_once_the_timer_is_stored(self) -> None:
        """When schedule returns, the timer is in the store, correlated to the envelope id."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            envelope_id = await timers.schedule("shop-1", "order-1", T0 + timedelta(hours=1))
            stored = await timers.timer.get("shop-1", "order-1")
            assert timers.commands.acked[-1].id == envelope_id
        assert stored is not None and stored.state is TimerState.SCHEDULED
        assert stored.correlation_id == envelope_id  # the default: a new trace

    async def test_cancel_before_the_due_time_means_no_event(self) -> None:
        """A timer cancelled before it is due never fires."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await timers.schedule("shop-1", "order-1", T0 + timedelta(seconds=10))
            await timers.cancel("shop-1", "order-1", causation_id="paid-1")
            timers.clock.advance(60)
            await timers.clock.wait_for_sleepers(1)
            assert timers.bus.published == []
            assert await timers.timer.get("shop-1", "order-1") is None
            assert timers.commands.acked[-1].causation_id == "paid-1"

    async def test_host_code_typed_on_the_protocol_runs_against_it(self) -> None:
        """A host function taking a TimerScheduler schedules through the memory client."""
        async with MemoryTimerClient() as timers:
            envelope_id = await place_order(timers, "order-9")
            stored = await timers.timer.get("shop-1", "order-9")
        assert stored is not None and stored.correlation_id == "order-9"
        assert envelope_id == timers.commands.acked[0].id


class TestBadInput:
    @pytest.mark.parametrize(
        ("tenant", "call", "due", "error"),
        [
            ("shop 1", "order-1", T0, InvalidIdentifier),
            ("shop-1", "", T0, InvalidIdentifier),
            ("shop-1", "order-1", datetime(2030, 1, 1), InvalidTimestamp),
            (
                "shop-1",
                "order-1",
                datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
                InvalidTimestamp,
            ),
        ],
        ids=["tenant", "call", "naive", "year-9999"],
    )
    async def test_bad_input_is_a_validation_error_and_sends_nothing(
        self, tenant: str, call: str, due: datetime, error: type[ValidationError]
    ) -> None:
        """Bad ids and due times raise a ValidationError before any command is sent."""
        async with MemoryTimerClient() as timers:
            with pytest.raises(error):
                await timers.schedule(tenant, call, due)
            assert timers.commands.deliveries == 0
            assert timers.commands.pending == 0

    async def test_a_client_not_started_says_so(self) -> None:
        """Scheduling outside ``async with`` fails at once instead of waiting forever."""
        with pytest.raises(RuntimeError, match="not running"):
            await MemoryTimerClient().schedule("shop-1", "order-1", T0)

    async def test_a_store_failure_is_redelivered_and_schedule_waits_for_it(self) -> None:
        """While the store fails the command is redelivered; schedule returns once stored."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            timers.store.fail_next(2, methods=["apply"])
            await timers.schedule("shop-1", "order-1", T0 + timedelta(hours=1))
            assert timers.commands.deliveries == 3
            assert await timers.timer.get("shop-1", "order-1") is not None
