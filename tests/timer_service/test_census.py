"""The census of pending timers: buckets by due time, the oldest overdue timer, its gauges."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.timer_service.test_otel import Telemetry
from timer_adapters_memory import MemoryCommandSource, MemoryEventBus, MemoryTimerStore
from timer_adapters_nats import NatsBroker
from timer_core import (
    CommandOutcome,
    EnvelopeId,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    Timer,
    TimerEntry,
    TimerOperation,
)
from timer_core.instants import to_epoch_ms
from timer_service.bootstrap import nats_settings
from timer_service.census import take_census, tenant_census
from timer_service.metrics import PrometheusInstrumentation
from timer_service.service import COUNTS_QUIET_S, TimerService, pending_count_pace
from timer_service.settings import Settings, SettingsError

NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)


def timer(tenant: str, call: str, due_in_s: float) -> TimerEntry:
    """A Scheduled timer due ``due_in_s`` seconds from NOW (negative: overdue)."""
    return TimerEntry(
        tenant_id=TenantId(tenant),
        service_call_id=ServiceCallId(call),
        due_at=NOW + timedelta(seconds=due_in_s),
        registered_at=NOW - timedelta(days=1),
    )


@pytest.fixture
async def store() -> MemoryTimerStore:
    """A store holding timers in every bucket: 3 overdue (the oldest 90 s), 2 within a minute,
    1 within an hour, 1 within a day, 2 later."""
    store = MemoryTimerStore()
    await store.start()
    await store.apply(
        [
            timer("a", "o1", -90),
            timer("a", "o2", -1),
            timer("b", "o3", 0),
            timer("b", "m1", 0.001),
            timer("a", "m2", 60),
            timer("a", "h1", 61),
            timer("c", "d1", 86_400),
            timer("c", "l1", 86_400.001),
            timer("c", "l2", 10 * 86_400),
        ]
    )
    return store


class TestCensus:
    async def test_timers_fall_into_their_buckets(self, store: MemoryTimerStore) -> None:
        """Each pending timer is counted in exactly one bucket by its due time."""
        census = await take_census(store, NOW, cap=100)
        assert census.counts == {"overdue": 3, "1m": 2, "1h": 1, "1d": 1, "later": 2}
        assert census.oldest_overdue_s == 90.0

    async def test_buckets_stop_at_the_cap(self, store: MemoryTimerStore) -> None:
        """A bucket with more timers than the cap reads as the cap, and says so."""
        census = await take_census(store, NOW, cap=2)
        assert census.counts["overdue"] == 2
        assert census.capped("overdue")
        assert not census.capped("1h")

    async def test_nothing_overdue_reads_zero(self) -> None:
        """With no overdue timer the oldest overdue age is 0, not negative."""
        store = MemoryTimerStore()
        await store.start()
        await store.apply([timer("a", "later", 30)])
        census = await take_census(store, NOW, cap=10)
        assert census.oldest_overdue_s == 0.0
        assert census.counts["overdue"] == 0

    async def test_tenants_with_counts_and_oldest(self, store: MemoryTimerStore) -> None:
        """The tenant census counts each tenant's pending and overdue timers."""
        rows, more = await tenant_census(store, NOW, tenants=2, cap=100)
        assert [(r.tenant_id, r.pending, r.overdue) for r in rows] == [("a", 4, 2), ("b", 2, 1)]
        assert more
        assert rows[0].waited_s(NOW) == 90.0

    async def test_tenant_scope_limits_the_tenant_census(self, store: MemoryTimerStore) -> None:
        """With a scope, only those tenants are counted."""
        rows, more = await tenant_census(
            store, NOW, tenants=10, cap=100, only=[TenantId("c"), TenantId("zz")]
        )
        assert [(r.tenant_id, r.pending) for r in rows] == [("c", 3)]
        assert not more


class TestCensusGauges:
    async def test_prometheus_gauges_follow_the_census(self, store: MemoryTimerStore) -> None:
        """timer_timers_due has one series per bucket, no tenant label; the oldest is set."""
        metrics = PrometheusInstrumentation()
        metrics.census_taken(await take_census(store, NOW, cap=100))
        text = generate_latest(metrics.registry).decode()
        assert 'timer_timers_due{due="overdue"} 3.0' in text
        assert 'timer_timers_due{due="later"} 2.0' in text
        assert "timer_oldest_overdue_seconds 90.0" in text
        assert "timer_census_cap 100.0" in text
        assert "tenant" not in "".join(x for x in text.splitlines() if "timers_due" in x)

    async def test_opentelemetry_gauges_follow_the_census(self, store: MemoryTimerStore) -> None:
        """timer.timers.due (attribute due) and timer.oldest_overdue report the census."""
        telemetry = Telemetry()
        otel = telemetry.instrument(PrometheusInstrumentation())
        otel.set_census(await take_census(store, NOW, cap=100))
        points = {p.attributes["due"]: p.value for p in telemetry.metric("timer.timers.due")}
        assert points == {"overdue": 3, "1m": 2, "1h": 1, "1d": 1, "later": 2}
        (oldest,) = telemetry.metric("timer.oldest_overdue")
        assert oldest.value == 90.0


class TestCensusSettings:
    def test_interval_and_cap_are_read(self) -> None:
        """TIMER_CENSUS_INTERVAL and TIMER_CENSUS_CAP are read; 0 turns the census off."""
        settings = Settings.from_environment(
            {"TIMER_CENSUS_INTERVAL": "0", "TIMER_CENSUS_CAP": "5000"}
        )
        assert (settings.census_interval_s, settings.census_cap) == (0.0, 5000)
        assert Settings.from_environment({}).census_interval_s == 30.0

    def test_a_sub_second_interval_is_refused(self) -> None:
        """An interval below one second (but not 0) is refused naming the variable."""
        with pytest.raises(SettingsError, match="TIMER_CENSUS_INTERVAL"):
            Settings.from_environment({"TIMER_CENSUS_INTERVAL": "200ms"})


class TestPendingCountPace:
    def test_a_cheap_count_runs_every_five_seconds(self) -> None:
        """A count that takes milliseconds is repeated every 5 s, as before."""
        assert pending_count_pace(0.004) == 5.0

    def test_a_costly_count_takes_one_percent_of_the_time(self) -> None:
        """A count that took 2.9 s (10M timers on SQLite) waits 290 s for the next."""
        assert pending_count_pace(2.9) == pytest.approx(290.0)


class CountingStore(MemoryTimerStore):
    """The memory store, noting when each write ended and each count began (monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[float] = []
        self.counted: list[float] = []

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        outcomes = await super().apply(operations)
        self.applied.append(time.monotonic())
        return outcomes

    async def count_scheduled(self) -> int:
        self.counted.append(time.monotonic())
        return await super().count_scheduled()


class TestPendingCountWaitsForQuietCommands:
    async def test_no_count_while_commands_are_being_stored(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """The pending count (a read of the whole table) never starts within
        COUNTS_QUIET_S of a stored batch of commands, nor of the service's start; once the
        commands stop, it runs."""
        settings = Settings(db_path=tmp_path / "timer.db", broker_url=nats_url, http_port=0)
        instrumentation = PrometheusInstrumentation()
        broker = NatsBroker(nats_settings(settings, nats_url), instrumentation=instrumentation)
        store, source = CountingStore(), MemoryCommandSource()
        timer = Timer(store, MemoryEventBus(), commands=source)
        service = TimerService(settings, broker, timer, instrumentation)
        due = datetime.now(UTC) + timedelta(days=1)
        async with service:
            began = time.monotonic()
            running = asyncio.create_task(service.run(asyncio.Event()))
            try:
                for i in range(12):  # a batch every 0.2 s for about two seconds
                    source.send(
                        MessageEnvelope(
                            id=EnvelopeId.generate(),
                            payload=ScheduleTimer("a", f"call-{i}", due),
                            timestamp_ms=to_epoch_ms(datetime.now(UTC)),
                            aggregate_id=ServiceCallId(f"call-{i}"),
                        )
                    )
                    await source.wait_until_drained()
                    await asyncio.sleep(0.2)
                async with asyncio.timeout(30):
                    while not [at for at in store.counted if at > store.applied[-1]]:
                        await asyncio.sleep(0.05)
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
        assert store.counted[0] - began >= COUNTS_QUIET_S
        for counted in store.counted:
            before = [at for at in store.applied if at <= counted]
            assert not before or counted - before[-1] >= COUNTS_QUIET_S
        assert instrumentation.pending._value.get() == 12
