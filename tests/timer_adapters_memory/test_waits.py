"""The test kit never hangs: every wait helper has a timeout and fails saying what it waited for."""

from __future__ import annotations

import inspect
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import (
    FakeClock,
    MemoryCommandSource,
    MemoryEventBus,
    MemoryTimerClient,
    MemoryTimerStore,
)
from timer_adapters_nats import TimerClient
from timer_core import NotRunning, Timer, WaitTimedOut

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


class TestEveryWaitHasATimeout:
    def test_every_public_wait_of_the_kit_takes_a_timeout_with_a_default(self) -> None:
        """Each async wait helper of the memory package has a `timeout` keyword with a default."""
        helpers = [
            FakeClock.wait_for_sleepers,
            MemoryEventBus.wait_for_published,
            MemoryCommandSource.wait_until_drained,
            MemoryTimerClient.wait_for_published,
            MemoryTimerClient.wait_until_idle,
            Timer.wait_until_idle,
        ]
        for helper in helpers:
            parameter = inspect.signature(helper).parameters["timeout"]
            assert parameter.default is not inspect.Parameter.empty, helper
            assert parameter.default is not None, helper


class TestForgettingTheClock:
    async def test_a_test_that_forgets_clock_advance_fails_within_the_timeout(self) -> None:
        """Waiting for an event the fake clock never reaches fails, naming the sleep to advance."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await timers.schedule("shop-1", "order-1", T0 + timedelta(minutes=30))
            with pytest.raises(WaitTimedOut) as caught:
                await timers.wait_for_published(1, timeout=0.3)
        message = str(caught.value)
        assert "0 published" in message
        assert "clock.advance(1800)" in message

    async def test_the_bus_alone_fails_with_what_it_saw(self) -> None:
        """A bare bus's wait fails after its timeout, saying how many events it saw."""
        bus = MemoryEventBus()
        with pytest.raises(WaitTimedOut, match="waited for 2 published event"):
            await bus.wait_for_published(2, timeout=0.05)

    async def test_waiting_for_sleepers_nobody_makes_fails(self) -> None:
        """Waiting for a sleeper that never comes fails, saying how many were asleep."""
        clock = FakeClock(T0)
        with pytest.raises(WaitTimedOut, match="0 waiting"):
            await clock.wait_for_sleepers(1, timeout=0.05)
        assert clock._watchers == []  # the abandoned wait left nothing behind

    async def test_a_command_source_nobody_runs_never_drains(self) -> None:
        """Waiting for a source that no Timer runs fails, saying what is pending."""
        source = MemoryCommandSource()
        source.send(b"{}")
        with pytest.raises(WaitTimedOut, match="1 command"):
            await source.wait_until_drained(timeout=0.05)


class TestIdle:
    async def test_nothing_published_means_something_only_after_wait_until_idle(self) -> None:
        """wait_until_idle returns once the worker has fired what is due and sleeps."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            await timers.schedule("shop-1", "due-now", T0)
            await timers.schedule("shop-1", "later", T0 + timedelta(seconds=10))
            await timers.wait_until_idle()
            assert [e.payload.service_call_id for e in timers.bus.published] == ["due-now"]
            timers.clock.advance(9.999)
            await timers.wait_until_idle()
            assert len(timers.bus.published) == 1
            timers.clock.advance(0.001)
            await timers.wait_for_published(2)

    async def test_wait_until_idle_on_a_timer_not_running_says_so(self) -> None:
        """A Timer not started cannot become idle: the wait says so at once."""
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0))
        with pytest.raises(NotRunning, match="this Timer is new"):
            await timer.wait_until_idle(timeout=0.05)


class TestParity:
    def test_memory_client_has_every_call_of_timer_client_with_the_same_arguments(self) -> None:
        """Each public call of TimerClient (but connect) is on MemoryTimerClient, same signature."""
        calls = [
            name
            for name, member in inspect.getmembers(TimerClient, inspect.isfunction)
            if not name.startswith("_")
        ]
        assert {"schedule", "cancel", "send", "send_many"} <= set(calls)
        for name in calls:
            ours = inspect.signature(getattr(MemoryTimerClient, name))
            theirs = inspect.signature(getattr(TimerClient, name))
            assert list(ours.parameters) == list(theirs.parameters), name
            for parameter in theirs.parameters.values():
                assert ours.parameters[parameter.name].default == parameter.default, name

    async def test_send_many_stores_prepared_envelopes_in_order(self) -> None:
        """Prepared envelopes sent together are stored in order; one None result each."""
        async with MemoryTimerClient(clock=FakeClock(T0)) as timers:
            schedule = timers.schedule_envelope("shop-1", "order-1", T0 + timedelta(hours=1))
            cancel = timers.cancel_envelope("shop-1", "order-1")
            assert await timers.send_many([schedule, cancel]) == [None, None]
            assert await timers.timer.get("shop-1", "order-1") is None
            assert [e.id for e in timers.commands.acked] == [schedule.id, cancel.id]
