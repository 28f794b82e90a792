"""Clock behaviour of the worker, on the fake clock: due times are compared with the wall
clock, sleeping is measured on the monotonic one, so wall-clock jumps never fire early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import ScheduleTimer, SystemClock, TimerWorker
from timer_core.commands import schedule_timer

T0 = datetime(2030, 1, 1, tzinfo=UTC)
POLL = 5.0


def at(seconds: float) -> datetime:
    """The instant ``seconds`` after T0."""
    return T0 + timedelta(seconds=seconds)


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Let the event loop run until ``predicate`` holds (fails after ``within`` real s)."""
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0)


class Rig:
    """A memory store and bus, a fake clock, and one worker over them."""

    def __init__(self) -> None:
        self.store = MemoryTimerStore()
        self.bus = MemoryEventBus()
        self.clock = FakeClock(T0)
        self.worker = TimerWorker(self.store, self.bus, self.clock, polling_interval=POLL)
        self.task: asyncio.Future[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.worker.run())

    async def schedule(self, call: str, due_at: datetime) -> None:
        """Store a timer as the command path would (the wall clock gives registered_at)."""
        await schedule_timer(self.store, ScheduleTimer("tenant-a", call, due_at), self.clock)

    async def asleep(self, seconds: float, *, passes: int = 1) -> None:
        """Wait until the worker has made ``passes`` passes and sleeps ``seconds`` more."""
        await until(
            lambda: self.worker.passes >= passes and self.clock.pending_sleeps() == [seconds]
        )

    def fired(self) -> list[str]:
        return [str(event.payload.service_call_id) for event in self.bus.published]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    rig = Rig()
    await rig.store.start()
    try:
        yield rig
    finally:
        rig.worker.stop()
        if rig.task is not None:
            await asyncio.wait_for(rig.task, 5)


class TestFarPast:
    """A timer whose due time is long gone fires at once."""

    @pytest.mark.parametrize(
        "due_at",
        [
            datetime(1970, 1, 1, 0, 0, 0, 1000, tzinfo=UTC),
            datetime(1, 1, 1, tzinfo=UTC),
            T0 - timedelta(days=3650),
            T0 - timedelta(milliseconds=1),
        ],
    )
    async def test_fires_at_once(self, rig: Rig, due_at: datetime) -> None:
        """Due long ago, it fires on the first pass, without any time passing."""
        await rig.schedule("old", due_at)
        rig.start()
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.due_at == due_at
        assert event.payload.reached_at == T0
        assert rig.clock.monotonic() == 0

    async def test_several_fire_oldest_first_in_one_pass(self, rig: Rig) -> None:
        """Past timers of different ages fire in due order, in one pass, without sleeping."""
        for call, years in [("b", 10), ("c", 1), ("a", 100)]:
            await rig.schedule(call, T0 - timedelta(days=365 * years))
        rig.start()
        await rig.asleep(POLL)
        assert rig.fired() == ["a", "b", "c"]
        # One pass fires all three; the worker then sleeps, once their mark is done.
        assert rig.worker.passes == 1
        assert rig.clock.monotonic() == 0

    async def test_scheduled_in_the_past_while_asleep_fires_when_notified(self, rig: Rig) -> None:
        """A far-past timer arriving while the worker sleeps wakes it and fires at once."""
        rig.start()
        await rig.asleep(POLL)
        await rig.schedule("late", T0 - timedelta(days=1))
        rig.worker.notify_scheduled(T0 - timedelta(days=1))
        await rig.bus.wait_for_published(1)
        assert rig.clock.monotonic() == 0


class TestWallClockBackwards:
    """The wall clock jumping back never makes anything fire before its due time."""

    async def test_jump_back_during_the_sleep_to_a_due_time(self, rig: Rig) -> None:
        """Asleep until a timer is due, the wall clock jumps back an hour: when the sleep ends
        the timer is not due by the wall clock, so it does not fire and the worker sleeps
        again, at most a polling interval."""
        await rig.schedule("t", at(3))
        rig.start()
        await rig.asleep(3.0)
        rig.clock.set_wall(at(-3600))
        rig.clock.advance(3)  # the monotonic sleep ends; the wall clock reads at(-3597)
        await rig.asleep(POLL, passes=2)
        assert rig.fired() == []

    async def test_nothing_fires_until_the_wall_clock_reaches_the_due_time(self, rig: Rig) -> None:
        """After a jump back, the timer fires on the first pass at or after its due time by
        the wall clock, with reachedAt never before dueAt."""
        await rig.schedule("t", at(10))
        rig.start()
        await rig.asleep(POLL)
        rig.clock.set_wall(at(-12))  # 22 s before the due time now
        # Each pass sleeps until the due time by the wall clock, at most a polling interval.
        for passes, sleep in [(2, 5.0), (3, 5.0), (4, 5.0), (5, 2.0)]:
            rig.clock.advance(POLL)
            await rig.asleep(sleep, passes=passes)
            assert rig.fired() == []
        rig.clock.advance(2)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == event.payload.due_at == at(10)

    async def test_jump_back_does_not_refire_a_reached_timer(self, rig: Rig) -> None:
        """A timer fired before the wall clock jumped back is not fired again."""
        await rig.schedule("t", at(1))
        rig.start()
        await rig.asleep(1.0)
        rig.clock.advance(1)
        await rig.bus.wait_for_published(1)
        rig.clock.set_wall(at(-60))
        for passes in range(3, 6):
            await rig.asleep(POLL, passes=passes - 1)
            rig.clock.advance(POLL)
        await rig.asleep(POLL, passes=5)
        assert rig.fired() == ["t"]
        assert len(rig.bus.publish_attempts) == 1


class TestMonotonicSleep:
    """The worker measures its sleeps on the monotonic clock."""

    async def test_wall_clock_jump_does_not_end_a_sleep(self, rig: Rig) -> None:
        """Jumping the wall clock forward an hour leaves the worker's sleep as it was; the
        now-overdue timer fires when the monotonic sleep ends."""
        await rig.schedule("t", at(4))
        rig.start()
        await rig.asleep(4.0)
        rig.clock.set_wall(at(3600))
        for _ in range(50):
            await asyncio.sleep(0)
        assert rig.clock.pending_sleeps() == [4.0]
        assert rig.fired() == []
        rig.clock.advance(4)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(3604)

    async def test_sleep_is_the_time_to_the_due_time_by_the_wall_clock(self, rig: Rig) -> None:
        """How long it sleeps is worked out from the wall clock at the end of each pass, so it
        fires exactly at the due time after a jump."""
        await rig.schedule("t", at(12))
        rig.start()
        await rig.asleep(POLL)
        rig.clock.set_wall(at(4))  # jumps 4 s ahead
        rig.clock.advance(POLL)  # the wall clock reads at(9): 3 s to go
        await rig.asleep(3.0, passes=2)
        assert rig.fired() == []
        rig.clock.advance(3)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == event.payload.due_at == at(12)

    async def test_system_clock_sleeps_on_the_monotonic_clock(self) -> None:
        """The real clock sleeps with the event loop's timer, which is time.monotonic."""
        clock = SystemClock()
        loop = asyncio.get_running_loop()
        assert abs(loop.time() - time.monotonic()) < 0.5
        assert abs(clock.monotonic() - time.monotonic()) < 0.5
        before = time.monotonic()
        await clock.sleep(0.05)
        assert time.monotonic() - before >= 0.05
