"""FakeClock: time moves only when the test says so, and sleepers wake exactly then."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock
from timer_core import Clock, InvalidTimestamp

START = datetime(2030, 1, 1, tzinfo=UTC)


class TestFakeClockTime:
    """Reading and moving the clocks."""

    def test_is_a_clock(self) -> None:
        """FakeClock satisfies the Clock protocol."""
        assert isinstance(FakeClock(), Clock)

    def test_starts_where_told(self) -> None:
        """The wall clock starts at the given instant and monotonic time at zero."""
        clock = FakeClock(START)
        assert clock.now() == START
        assert clock.now().utcoffset() == timedelta(0)
        assert clock.monotonic() == 0.0

    def test_rejects_naive_start(self) -> None:
        """A naive start instant is rejected, as everywhere in Timer."""
        with pytest.raises(InvalidTimestamp):
            FakeClock(datetime(2030, 1, 1))

    def test_advance_moves_both_clocks(self) -> None:
        """advance moves wall and monotonic time by the same amount, seconds or timedelta."""
        clock = FakeClock(START)
        clock.advance(1.5)
        clock.advance(timedelta(milliseconds=250))
        assert clock.now() == START + timedelta(seconds=1.75)
        assert clock.monotonic() == 1.75

    def test_advance_backwards_is_refused(self) -> None:
        """advance never moves time backwards; set_wall is for jumps."""
        with pytest.raises(ValueError):
            FakeClock(START).advance(-1)

    def test_set_wall_jumps_only_the_wall_clock(self) -> None:
        """set_wall moves the wall clock either way and leaves monotonic time alone."""
        clock = FakeClock(START)
        clock.advance(10)
        clock.set_wall(START - timedelta(hours=1))
        assert clock.now() == START - timedelta(hours=1)
        assert clock.monotonic() == 10.0


class TestFakeClockSleep:
    """Sleeping on the fake monotonic clock."""

    async def test_sleep_waits_for_advance(self) -> None:
        """A sleep returns only once the clock was advanced past its deadline."""
        clock = FakeClock(START)
        sleeper = asyncio.ensure_future(clock.sleep(5))
        await clock.wait_for_sleepers(1)
        clock.advance(4.999)
        await asyncio.sleep(0)
        assert not sleeper.done()
        assert clock.pending_sleeps() == [pytest.approx(0.001)]
        clock.advance(0.001)
        await asyncio.wait_for(sleeper, 1)

    async def test_a_sleep_counts_from_the_call_not_from_its_first_step(self) -> None:
        """A sleep handed to a task ends its seconds after the call, even when the clock
        moves before the task first runs: advancing by what was asked wakes it, and a sleep
        the clock has already passed returns at once without counting as a sleeper."""
        clock = FakeClock(START)
        sleeper = asyncio.ensure_future(clock.sleep(5))
        clock.advance(3)  # before the task's first step
        await clock.wait_for_sleepers(1)
        assert clock.pending_sleeps() == [2.0]
        clock.advance(2)
        await asyncio.wait_for(sleeper, 1)
        passed = asyncio.ensure_future(clock.sleep(1))
        clock.advance(1)
        await asyncio.wait_for(passed, 1)
        assert clock.sleepers == 0

    async def test_zero_sleep_returns_at_once(self) -> None:
        """Sleeping zero or negative seconds does not wait for the clock."""
        clock = FakeClock(START)
        await asyncio.wait_for(clock.sleep(0), 1)
        await asyncio.wait_for(clock.sleep(-3), 1)
        assert clock.sleepers == 0

    async def test_advancing_by_a_computed_delay_wakes_exactly(self) -> None:
        """Advancing by the same float a sleeper slept always wakes it (no rounding drift)."""
        clock = FakeClock(START)
        for delay in (0.1, 0.3, 1 / 3, 0.7, 2.675):
            sleeper = asyncio.ensure_future(clock.sleep(delay))
            await clock.wait_for_sleepers(1)
            clock.advance(delay)
            await asyncio.wait_for(sleeper, 1)

    async def test_set_wall_wakes_nobody(self) -> None:
        """Jumping the wall clock forward does not end sleeps on the monotonic clock."""
        clock = FakeClock(START)
        sleeper = asyncio.ensure_future(clock.sleep(1))
        await clock.wait_for_sleepers(1)
        clock.set_wall(START + timedelta(days=1))
        await asyncio.sleep(0)
        assert not sleeper.done()
        clock.advance(1)
        await asyncio.wait_for(sleeper, 1)

    async def test_advance_wakes_due_sleepers_only(self) -> None:
        """advance wakes the sleepers whose deadline passed and keeps the others waiting."""
        clock = FakeClock(START)
        short = asyncio.ensure_future(clock.sleep(1))
        long = asyncio.ensure_future(clock.sleep(10))
        await clock.wait_for_sleepers(2)
        clock.advance(2)
        await asyncio.wait_for(short, 1)
        assert not long.done()
        assert clock.sleepers == 1
        assert clock.pending_sleeps() == [8.0]
        long.cancel()

    async def test_cancelled_sleep_is_forgotten(self) -> None:
        """A cancelled sleep no longer counts as a sleeper."""
        clock = FakeClock(START)
        sleeper = asyncio.ensure_future(clock.sleep(3))
        await clock.wait_for_sleepers(1)
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        assert clock.sleepers == 0

    async def test_wait_for_sleepers_returns_when_count_reached(self) -> None:
        """wait_for_sleepers blocks until the given number of sleeps are waiting."""
        clock = FakeClock(START)
        waiting = asyncio.ensure_future(clock.wait_for_sleepers(2))
        first = asyncio.ensure_future(clock.sleep(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not waiting.done()
        second = asyncio.ensure_future(clock.sleep(1))
        await asyncio.wait_for(waiting, 1)
        clock.advance(1)
        await asyncio.wait_for(asyncio.gather(first, second), 1)

    async def test_advance_from_another_thread_wakes_the_loop(self) -> None:
        """advance is safe to call from a thread other than the sleeper's loop."""
        clock = FakeClock(START)
        sleeper = asyncio.ensure_future(clock.sleep(1))
        await clock.wait_for_sleepers(1)
        thread = threading.Thread(target=clock.advance, args=(1,))
        thread.start()
        await asyncio.wait_for(sleeper, 1)
        thread.join()
