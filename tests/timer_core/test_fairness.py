"""Tenant fairness: one tenant's backlog of due timers never makes another tenant wait for it.

The full figure (a 50,000-timer storm, lateness measured on the wall clock) is
``python -m timer_bench fairness``'s; here a scaled-down storm is drained at one fake instant
on each store, and the order of the publishes shows who waited for whom.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import pytest_asyncio

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import DueCursor, TenantId, TimerEntry, TimerStore, firing
from timer_core.firing import FiringPipeline

T = datetime(2030, 1, 1, tzinfo=UTC)
STORM = "a-storm"  # sorts before the quiet tenant: in plain due order it would go first
QUIET = "z-quiet"
BATCH = 100


@pytest_asyncio.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TimerStore]:
    """A started store of each kind, empty."""
    make: Callable[[], TimerStore]
    if request.param == "memory":
        make = MemoryTimerStore
    elif request.param == "sqlite":
        make = lambda: SqliteTimerStore(tmp_path / "timer.db")  # noqa: E731
    else:
        url: str = request.getfixturevalue("fresh_postgres_url")
        make = lambda: PostgresTimerStore(url, listen=False)  # noqa: E731
    async with make() as opened:
        yield opened


def timer(tenant: str, call: str, due: datetime) -> TimerEntry:
    return TimerEntry(tenant_id=tenant, service_call_id=call, due_at=due, registered_at=T)


class TestStorm:
    async def test_a_storm_does_not_make_another_tenant_wait(self, store: TimerStore) -> None:
        """3,000 timers of one tenant due at one instant, and another tenant's 10 due at that
        instant and in the 2 s after: the other tenant's are all published within the first
        two batches, each tenant's in its own due order, none before it was due."""
        storm = [timer(STORM, f"s{i:05d}", T) for i in range(3000)]
        quiet = [timer(QUIET, f"q{i}", T + timedelta(seconds=0.2 * i)) for i in range(10)]
        for start in range(0, len(storm), 500):
            await store.apply(storm[start : start + 500])
        await store.apply(quiet)
        clock, bus = FakeClock(T + timedelta(seconds=2)), MemoryEventBus()

        report = await FiringPipeline(store, bus, clock, batch_size=BATCH).drain()

        published = [event.payload for event in bus.published]
        assert report.fired == len(published) == 3010
        order = [(str(p.tenant_id), str(p.service_call_id)) for p in published]
        quiet_at = [i for i, (tenant, _) in enumerate(order) if tenant == QUIET]
        assert len(quiet_at) == 10 and max(quiet_at) < 2 * BATCH, quiet_at
        for tenant, timers in ((STORM, storm), (QUIET, quiet)):
            mine = [p for p in published if p.tenant_id == tenant]
            assert [p.service_call_id for p in mine] == [
                t.service_call_id for t in sorted(timers, key=DueCursor.of)
            ]
        assert all(p.reached_at >= p.due_at for p in published)
        assert await store.count_scheduled() == 0

    async def test_few_due_timers_come_in_plain_due_order(self, store: TimerStore) -> None:
        """With fewer due than a batch holds, timers of all tenants fire in global due order."""
        timers = [
            timer(f"tenant-{i % 3}", f"c{i:02d}", T + timedelta(seconds=i)) for i in range(30)
        ]
        await store.apply(timers)
        bus = MemoryEventBus()
        await FiringPipeline(
            store, bus, FakeClock(T + timedelta(minutes=1)), batch_size=BATCH
        ).drain()
        assert [e.payload.service_call_id for e in bus.published] == [
            t.service_call_id for t in timers
        ]


class TestManyTenants:
    async def test_a_drain_keeps_a_bounded_number_of_tenant_cursors(
        self, store: TimerStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A backlog over more tenants than a drain keeps cursors for: each drain ends once
        it passes that many (the store never gets more cursors than that plus a batch), and
        drain after drain fires every timer once, each tenant's in due order, none early."""
        monkeypatch.setattr(firing, "_MAX_TENANT_CURSORS", 30)
        monkeypatch.setattr(firing, "READ_AHEAD", 20)  # pages read ahead of a batch's size
        timers = [
            timer(f"tenant-{i % 100:03d}", f"c{i:04d}", T - timedelta(seconds=i % 7))
            for i in range(300)
        ]
        await store.apply(timers)
        cursors: list[int] = []
        find = store.find_due_by_tenant

        async def counting(
            now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
        ) -> list[TimerEntry]:
            cursors.append(len(after))
            return await find(now, limit, after=after)

        monkeypatch.setattr(store, "find_due_by_tenant", counting)
        bus, clock = MemoryEventBus(), FakeClock(T)
        fired = [(await FiringPipeline(store, bus, clock, batch_size=20).drain()).fired]
        assert 0 < fired[0] < len(timers)  # the first drain stopped at the cap
        while fired[-1]:
            fired.append((await FiringPipeline(store, bus, clock, batch_size=20).drain()).fired)
        assert max(cursors) <= 30 + 20
        published = [event.payload for event in bus.published]
        assert sorted(p.service_call_id for p in published) == sorted(
            t.service_call_id for t in timers
        )
        for tenant in {t.tenant_id for t in timers}:
            mine = [p for p in published if p.tenant_id == tenant]
            assert [p.service_call_id for p in mine] == [
                t.service_call_id
                for t in sorted((t for t in timers if t.tenant_id == tenant), key=DueCursor.of)
            ]
        assert all(p.reached_at >= p.due_at for p in published)
        assert await store.count_scheduled() == 0
