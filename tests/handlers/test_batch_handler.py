"""Timer(store, batch_handler=...): the due timers found together, handed to one call."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryTimerStore
from timer_core import (
    ConfigurationError,
    DueTimeReached,
    HandlerSettings,
    MessageEnvelope,
    Timer,
    TimerState,
    ValidationError,
)

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
Event = MessageEnvelope[DueTimeReached]


class TestBatchHandler:
    async def test_the_timers_due_together_come_in_one_call_and_are_marked(self) -> None:
        """Five timers due together reach the batch handler in one call; returning None
        marks them all Reached."""
        calls: list[list[str]] = []

        async def on_due(events: Sequence[Event]) -> None:
            calls.append([str(e.payload.service_call_id) for e in events])

        clock = FakeClock(T0)
        async with Timer(MemoryTimerStore(), batch_handler=on_due, clock=clock) as timer:
            for n in range(5):
                await timer.schedule("shop-1", f"order-{n}", T0 + timedelta(seconds=1))
            await timer.wait_until_idle()
            clock.advance(1)
            await timer.wait_until_idle()
            states = [(await timer.get("shop-1", f"order-{n}")) for n in range(5)]
        assert len(calls) == 1 and sorted(calls[0]) == [f"order-{n}" for n in range(5)]
        assert all(s is not None and s.state is TimerState.REACHED for s in states)

    async def test_one_timers_outcome_fails_only_that_timer(self) -> None:
        """An exception in one timer's place of the outcomes retries that timer alone; the
        others of the call are marked."""
        calls: list[list[str]] = []

        async def on_due(events: Sequence[Event]) -> list[BaseException | None]:
            calls.append([str(e.payload.service_call_id) for e in events])
            return [
                RuntimeError("refused") if e.payload.service_call_id == "order-1" else None
                for e in events
            ]

        clock = FakeClock(T0)
        settings = HandlerSettings(max_attempts=2, retry_delay_s=1.0, jitter=0.0)
        async with Timer(
            MemoryTimerStore(), batch_handler=on_due, handler_settings=settings, clock=clock
        ) as timer:
            for n in range(3):
                await timer.schedule("shop-1", f"order-{n}", T0 + timedelta(seconds=1))
            await timer.wait_until_idle()
            clock.advance(1.0)
            await timer.wait_until_idle()
            clock.advance(1.0)
            await timer.wait_until_idle()
            (quarantined,) = timer.quarantined
            reached = {
                n: (await timer.get("shop-1", f"order-{n}")).state  # type: ignore[union-attr]
                for n in range(3)
            }
        assert calls[1:] == [["order-1"]]
        assert quarantined.entry.service_call_id == "order-1"
        assert "RuntimeError: refused" in quarantined.error
        assert reached == {0: TimerState.REACHED, 1: TimerState.SCHEDULED, 2: TimerState.REACHED}

    async def test_outcomes_of_the_wrong_length_fail_the_call(self) -> None:
        """A list of outcomes that does not match the timers fails every timer of the call,
        naming the mistake."""

        async def on_due(events: Sequence[Event]) -> list[BaseException | None]:
            return []

        settings = HandlerSettings(max_attempts=1)
        async with Timer(
            MemoryTimerStore(), batch_handler=on_due, handler_settings=settings, clock=FakeClock(T0)
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.wait_until_idle()
            (quarantined,) = timer.quarantined
        assert "returned 0 outcomes for 1 timers" in quarantined.error

    def test_a_plain_function_is_refused_as_a_batch_handler(self) -> None:
        """A batch handler must be async: a plain function is refused when the Timer is
        made, naming the fix; so are a handler and a batch handler together."""

        def on_due(events: Sequence[Event]) -> None:
            return None

        with pytest.raises(ConfigurationError, match="async def"):
            Timer(MemoryTimerStore(), batch_handler=on_due)  # type: ignore[arg-type]

        async def handler(event: Event) -> None:
            return None

        async def batch(events: Sequence[Event]) -> None:
            return None

        with pytest.raises(ConfigurationError, match="not both"):
            Timer(MemoryTimerStore(), handler=handler, batch_handler=batch)


class TestBatchSizes:
    """How many timers a call gets: up to the Timer's batch_size, 1,000 unless given; and
    max_concurrency calls at once."""

    async def _calls_for(self, due: int, **settings: object) -> list[int]:
        sizes: list[int] = []

        async def on_due(events: Sequence[Event]) -> None:
            sizes.append(len(events))

        clock = FakeClock(T0)
        async with Timer(
            MemoryTimerStore(),
            batch_handler=on_due,
            clock=clock,
            **settings,  # type: ignore[arg-type]
        ) as timer:
            for n in range(due):
                await timer.schedule(f"shop-{n % 7}", f"order-{n}", T0 + timedelta(seconds=1))
            await timer.wait_until_idle()
            clock.advance(1)
            await timer.wait_until_idle()
            assert await timer.store.count_scheduled() == 0
        return sizes

    async def test_a_call_takes_up_to_a_thousand_timers_by_default(self) -> None:
        """2,500 due timers come in calls of 1,000, 1,000 and 500, not 25 calls of 100."""
        assert sorted(await self._calls_for(2500), reverse=True) == [1000, 1000, 500]

    async def test_the_timers_batch_size_caps_a_call(self) -> None:
        """``Timer(batch_size=...)`` is the most timers a call gets."""
        sizes = await self._calls_for(250, batch_size=100)
        assert max(sizes) == 100 and sum(sizes) == 250

    def test_a_batch_size_that_is_not_a_count_is_refused(self) -> None:
        """A batch size of the wrong type is refused when the Timer is made."""

        async def on_due(events: Sequence[Event]) -> None:
            return None

        with pytest.raises(ValidationError, match="batch_size"):
            Timer(MemoryTimerStore(), batch_handler=on_due, batch_size="1000")  # type: ignore[arg-type]

    async def test_max_concurrency_counts_calls_not_timers(self) -> None:
        """With ``max_concurrency=2``, two calls of many timers each run at once, and a third
        waits for a place."""
        running = 0
        most = 0
        release = asyncio.Event()
        sizes: list[int] = []

        async def on_due(events: Sequence[Event]) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            sizes.append(len(events))
            await release.wait()
            running -= 1

        clock = FakeClock(T0)
        settings = HandlerSettings(max_concurrency=2)
        async with Timer(
            MemoryTimerStore(),
            batch_handler=on_due,
            handler_settings=settings,
            batch_size=10,
            clock=clock,
        ) as timer:
            for n in range(30):
                await timer.schedule("shop-1", f"order-{n:02d}", T0 + timedelta(seconds=1))
            await timer.wait_until_idle()
            clock.advance(1)
            # The third call waits for a place while the first two run.
            while len(sizes) < 2:
                await asyncio.sleep(0)
            for _ in range(50):
                await asyncio.sleep(0)
            assert sizes == [10, 10] and most == 2
            release.set()
            await timer.wait_until_idle()
            assert await timer.store.count_scheduled() == 0
        assert sizes == [10, 10, 10] and most == 2
