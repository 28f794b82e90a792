"""The database clock: never ahead of the database, whatever the round trips and this host's
wall clock do; its skew measured, warned about, and used by a Timer over the store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timer_adapters_memory import FakeClock, MemoryEventBus
from timer_adapters_postgres import DatabaseClock, PostgresTimerStore
from timer_adapters_postgres._clock import DRIFT
from timer_core import StoreUnavailable, SystemClock, Timer

T0 = datetime(2030, 1, 1, tzinfo=UTC)


async def _never_read() -> datetime:
    raise AssertionError("the pure tests feed readings through observe()")


def _clock(**options: Any) -> tuple[DatabaseClock, list[float]]:
    """A clock on a hand-moved monotonic clock (``mono[0]``), fed by ``observe``."""
    mono = [0.0]
    clock = DatabaseClock(_never_read, monotonic=lambda: mono[0], **options)
    return clock, mono


# One reading: when it was sent, how far into the round trip the database read its clock
# (0..1), and the round trip.
_reading = st.tuples(st.floats(0.0, 30.0), st.floats(0.0, 1.0), st.floats(0.0, 0.5))


class TestNeverAhead:
    @settings(max_examples=300, deadline=None)
    @given(st.lists(_reading, min_size=1, max_size=12), st.floats(-1.0, 1.0))
    def test_now_never_passes_the_database_clock(
        self, readings: list[tuple[float, float, float]], rate_error: float
    ) -> None:
        """Whatever the round trips, where in them the database read its clock, and a rate
        difference within DRIFT, now() is never later than the database's time."""
        rate = 1 + rate_error * DRIFT  # the database's seconds per monotonic second

        def database_at(mono: float) -> datetime:
            return T0 + timedelta(seconds=mono * rate)

        clock, mono = _clock()
        at = 0.0
        for gap, where, round_trip in readings:
            sent = at + gap
            received = sent + round_trip
            read = database_at(sent + where * round_trip)
            clock.observe(sent, read, received, read.timestamp())
            for probe in (received, received + 0.7, received + gap + 5.0):
                mono[0] = probe
                assert clock.now() <= database_at(probe)
            at = received

    def test_a_tighter_earlier_reading_is_kept(self) -> None:
        """A reading that arrives late (long round trip) does not pull now() back from what an
        earlier, quicker reading already proved."""
        clock, mono = _clock()
        clock.observe(0.0, T0, 0.001, T0.timestamp())
        late = T0 + timedelta(seconds=10)  # read at once, answered 0.5 s later
        clock.observe(10.0, late, 10.5, late.timestamp())
        mono[0] = 10.5
        assert clock.now() > T0 + timedelta(seconds=10.49)

    def test_a_database_clock_set_back_is_followed(self) -> None:
        """When the database's clock is set back (a reading's upper bound is below what the
        clock extrapolated), the new reading is taken as it is."""
        clock, mono = _clock()
        clock.observe(0.0, T0, 0.001, T0.timestamp())
        clock.observe(10.0, T0 + timedelta(seconds=5), 10.001, T0.timestamp() + 5)
        mono[0] = 10.001
        assert clock.now() == T0 + timedelta(seconds=5)

    def test_elapsed_time_is_counted_short_by_the_drift_allowance(self) -> None:
        """Between readings now() advances by the monotonic time less DRIFT of it."""
        clock, mono = _clock()
        clock.observe(0.0, T0, 0.0, T0.timestamp())
        mono[0] = 100.0
        assert clock.now() == T0 + timedelta(seconds=100 * (1 - DRIFT))
        mono[0] = 100.0000001  # a tenth of a microsecond later: not yet the next microsecond
        assert clock.now() == T0 + timedelta(seconds=100 * (1 - DRIFT))

    def test_now_before_the_first_reading_is_refused(self) -> None:
        """A clock never read has no time to give: StoreUnavailable, not the host's clock."""
        clock, _ = _clock()
        with pytest.raises(StoreUnavailable, match="not read yet"):
            clock.now()


class TestSkew:
    def test_skew_is_host_minus_database_at_the_middle_of_the_round_trip(self) -> None:
        """A host 3 s ahead, measured over a 20 ms round trip, shows +3.000 s."""
        clock, _ = _clock()
        database = T0
        host = T0.timestamp() + 3.0 + 0.010  # at the receive instant, 10 ms after the middle
        clock.observe(5.0, database, 5.020, host)
        assert clock.skew_s == pytest.approx(3.0, abs=1e-6)
        assert clock.round_trip_s == pytest.approx(0.020)

    def test_the_quickest_recent_reading_gives_the_skew(self) -> None:
        """A reading stretched by a slow round trip does not replace the skew a quick one
        measured; once the quick one is old enough, the latest readings decide."""
        clock, _ = _clock()
        host = T0.timestamp() + 3.0
        clock.observe(0.0, T0, 0.002, host + 0.001)  # 2 ms: +3.000
        clock.observe(2.0, T0 + timedelta(seconds=2), 2.4, host + 2.4)  # 400 ms: +3.200
        assert clock.skew_s == pytest.approx(3.0, abs=1e-6)
        for second in range(15):
            at = 4.0 + 2 * second
            clock.observe(at, T0 + timedelta(seconds=at), at + 0.1, host + at + 0.1)
        assert clock.skew_s == pytest.approx(3.05, abs=1e-6)
        assert clock.round_trip_s == pytest.approx(0.1)

    def test_a_warning_past_the_threshold_then_back_within(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Past the threshold one WARNING names the skew (not one per reading); back
        within, one INFO line says so."""
        clock, _ = _clock(skew_warning_s=1.0)
        with caplog.at_level(logging.INFO, logger="timer_adapters_postgres._clock"):
            for second in range(3):
                clock.observe(second, T0 + timedelta(seconds=second), second, T0.timestamp() - 2.5)
            clock.observe(4.0, T0, 4.0, T0.timestamp())
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "-2.500 s off" in warnings[0].getMessage()
        assert "behind" in warnings[0].getMessage()
        assert any("back within" in r.getMessage() for r in caplog.records)

    async def test_the_warning_at_start_names_the_quickest_first_reading(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """start() takes its first readings before it judges the skew: a first round trip
        stretched by a busy host (400 ms: +3.200 s) does not set the skew the one warning
        names; the quick one after it (2 ms: +3.000 s) does."""
        mono = [0.0]
        round_trips = iter([0.4, 0.002, 0.002])

        async def read() -> datetime:
            sent = mono[0]
            mono[0] += next(round_trips)
            return T0 + timedelta(seconds=sent)  # read at the round trip's start

        host_ahead = T0.timestamp() - mono[0] + 3.0
        clock = DatabaseClock(read, monotonic=lambda: mono[0], wall=lambda: host_ahead + mono[0])
        with caplog.at_level(logging.WARNING, logger="timer_adapters_postgres._clock"):
            await clock.start()
            await clock.aclose()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "+3.001 s off" in warnings[0], warnings

    def test_no_warning_within_the_threshold_or_when_turned_off(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """0.5 s off warns nobody at the 1 s default; 30 s off warns nobody with None."""
        quiet, _ = _clock(skew_warning_s=None)
        usual, _ = _clock()
        with caplog.at_level(logging.WARNING, logger="timer_adapters_postgres._clock"):
            usual.observe(0.0, T0, 0.0, T0.timestamp() + 0.5)
            quiet.observe(0.0, T0, 0.0, T0.timestamp() + 30.0)
        assert caplog.records == []


def _database_now(postgres_sql: psycopg.Connection[Any]) -> datetime:
    row = postgres_sql.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value = row[0]
    assert isinstance(value, datetime)
    return value


class TestOnPostgres:
    async def test_the_store_clock_lies_between_two_database_readings(
        self,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """The store's clock, read between two readings of clock_timestamp(), is no later
        than the second and at most a few round trips before the first."""
        store: PostgresTimerStore = await make_started_store()
        clock = store.shared_clock()
        for _ in range(20):
            before = _database_now(postgres_sql)
            now = clock.now()
            after = _database_now(postgres_sql)
            assert now <= after
            assert now >= before - timedelta(milliseconds=250)
            await asyncio.sleep(0.01)
        assert clock.skew_s is not None and abs(clock.skew_s) < 0.25

    async def test_a_timer_over_the_store_decides_by_the_database_clock(
        self, make_started_store: Callable[..., Any], postgres_url: str
    ) -> None:
        """Timer over a PostgresTimerStore uses the store's database clock by default; a clock
        given (FakeClock, SystemClock) still wins."""
        store = PostgresTimerStore(postgres_url, pool_size=2)
        assert Timer(store, MemoryEventBus()).clock is store.shared_clock()
        fake = FakeClock()
        assert Timer(store, MemoryEventBus(), clock=fake).clock is fake
        system = SystemClock()
        assert Timer(store, MemoryEventBus(), clock=system).clock is system

    async def test_the_clock_goes_on_after_the_store_closes(
        self, make_started_store: Callable[..., Any]
    ) -> None:
        """Closing the store stops the refreshes, not the clock: now() still moves on."""
        store: PostgresTimerStore = await make_started_store()
        clock = store.shared_clock()
        await store.aclose()
        first = clock.now()
        await asyncio.sleep(0.01)
        assert clock.now() > first
