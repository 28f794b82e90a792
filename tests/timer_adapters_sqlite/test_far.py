"""Timers far ahead kept out of the due-order indexes (schema version 5, timer_core.horizon):
where each timer is stored, how the edge moves, and what a migrated database keeps."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from timer_adapters_sqlite import SqliteTimerStore, schedule_in_transaction
from timer_core import ScheduleTimer, ServiceCallId, TenantId
from timer_core.horizon import edge_for

from .conftest import T0, entry, migrate_to

A = TenantId("tenant-a")
MINUTE = 60.0
DAY = 86_400.0


def _far(raw: sqlite3.Connection) -> dict[str, str | None]:
    """Each timer's far bucket by service call id (None: near)."""
    return dict(raw.execute("SELECT service_call_id, far_bucket FROM timer_schedules"))


def _edge(raw: sqlite3.Connection) -> str | None:
    row = raw.execute("SELECT edge FROM timer_horizon").fetchone()
    return None if row is None else str(row[0])


def _near_index(raw: sqlite3.Connection) -> list[str]:
    """The service call ids in the cross-tenant due index, in its order."""
    return [
        row[0]
        for row in raw.execute(
            "SELECT service_call_id FROM timer_schedules "
            "INDEXED BY idx_timer_schedules_scheduled_due "
            "WHERE state = 'Scheduled' AND far_bucket IS NULL ORDER BY due_at"
        )
    ]


class TestWhereTimersGo:
    async def test_before_any_find_every_timer_is_near(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """Without an edge (no find yet, or a database from before the layout) nothing is
        far: the first find sets the edge."""
        await store.apply([entry(call="soon", due_in=5), entry(call="weeks", due_in=21 * DAY)])
        assert _edge(raw) is None
        assert _far(raw) == {"soon": None, "weeks": None}
        await store.find_due(T0, 10)
        assert _edge(raw) == "2030-01-01T12:30:00.000Z" == edge_for(T0).isoformat()[:19] + (".000Z")

    async def test_timers_at_or_after_the_edge_are_far_by_bucket(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """Once the edge is set, a timer due at or after it is written far with its
        10-minute bucket and is in neither due index; one due before it is near."""
        await store.find_due(T0, 10)  # edge 12:30
        await store.apply(
            [
                entry(call="before-edge", due_in=30 * MINUTE - 0.001),
                entry(call="at-edge", due_in=30 * MINUTE),
                entry(call="weeks", due_in=21 * DAY + 9 * MINUTE),
            ]
        )
        assert _far(raw) == {
            "before-edge": None,
            "at-edge": "2030-01-01T12:3",
            "weeks": "2030-01-22T12:0",
        }
        assert _near_index(raw) == ["before-edge"]

    async def test_reschedules_and_marks_follow_the_edge(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """A reschedule is near or far by its new due time; a mark leaves no far bucket."""
        await store.find_due(T0, 10)
        await store.apply([entry(call="a", due_in=5), entry(call="b", due_in=DAY)])
        await store.apply([entry(call="a", due_in=DAY), entry(call="b", due_in=5)])
        assert _far(raw) == {"a": "2030-01-02T12:0", "b": None}
        far = entry(call="a", due_in=DAY)
        assert await store.mark_reached([far.reach(far.due_at)]) == 1
        assert _far(raw) == {"a": None, "b": None}

    async def test_a_hosts_transaction_writes_far_timers_too(
        self, store: SqliteTimerStore, db_path: Path, raw: sqlite3.Connection
    ) -> None:
        """schedule_in_transaction reads the same edge: a timer a host writes in its own
        transaction is far when it is due past the edge, and is found once due."""
        await store.find_due(T0, 10)
        engine = sa.create_engine(f"sqlite:///{db_path}")
        try:
            with engine.begin() as connection:
                command = ScheduleTimer(A, ServiceCallId("host"), T0 + timedelta(days=1))
                schedule_in_transaction(connection, command, now=T0)
        finally:
            engine.dispose()
        assert _far(raw) == {"host": "2030-01-02T12:0"}
        found = await store.find_due(T0 + timedelta(days=1), 10)
        assert [e.service_call_id for e in found] == ["host"]


class TestTheEdge:
    async def test_a_find_past_the_edge_moves_every_timer_before_it_in_batches(
        self, db_path: Path, raw: sqlite3.Connection
    ) -> None:
        """A find at or past the edge first moves near every far timer due before the new
        edge, a batch a transaction, then raises the edge with the last batch."""
        async with SqliteTimerStore(db_path) as store:
            store.move_batch = 3
            await store.find_due(T0, 10)
            timers = [entry(f"tenant-{i % 3}", f"t{i}", due_in=DAY + i) for i in range(10)]
            later = entry(call="later", due_in=2 * DAY)
            await store.apply([*timers, later])
            before = store.transactions_committed
            found = await store.find_due(T0 + timedelta(days=1, seconds=20), 100)
            assert [e.service_call_id for e in found] == [f"t{i}" for i in range(10)]
            assert store.transactions_committed - before == 4  # 3 + 3 + 3 + (1 and the edge)
            assert _edge(raw) == "2030-01-02T12:30:00.000Z"
            assert _far(raw)["later"] == "2030-01-03T12:0"
            assert sum(bucket is None for bucket in _far(raw).values()) == 10

    async def test_the_edge_never_moves_back(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """A find with an earlier now (another clock, a test's) leaves the edge where it is,
        and still sees what is due at its now."""
        await store.find_due(T0 + timedelta(days=2), 10)
        edge = _edge(raw)
        await store.apply([entry(call="early", due_in=5)])
        assert [e.service_call_id for e in await store.find_due(T0 + timedelta(seconds=5), 10)] == [
            "early"
        ]
        assert _edge(raw) == edge

    async def test_a_second_store_on_the_file_finds_what_the_first_moved(
        self, db_path: Path, raw: sqlite3.Connection
    ) -> None:
        """Two store objects (two processes) share the edge in the file: one that last knew
        an older edge finds the timers the other moved, and moves the rest."""
        async with SqliteTimerStore(db_path) as first, SqliteTimerStore(db_path) as second:
            await second.find_due(T0, 10)
            await first.find_due(T0, 10)
            await first.apply([entry(call="a", due_in=DAY), entry(call="b", due_in=3 * DAY)])
            assert [
                e.service_call_id for e in await first.find_due(T0 + timedelta(days=1), 10)
            ] == ["a"]
            found = await second.find_due(T0 + timedelta(days=3), 10)
            assert [e.service_call_id for e in found] == ["a", "b"]
        assert _edge(raw) == "2030-01-04T12:30:00.000Z"

    async def test_the_next_due_time_and_counts_span_near_and_far(
        self, store: SqliteTimerStore
    ) -> None:
        """next_due_at, the pending count (in slices) and a tenant's count see far timers."""
        store.count_slice = 2
        await store.find_due(T0, 10)
        await store.apply([entry(call=f"far{i}", due_in=DAY + i) for i in range(5)])
        assert await store.next_due_at() == T0 + timedelta(days=1)
        await store.apply([entry("tenant-b", "near", due_in=5)])
        assert await store.next_due_at() == T0 + timedelta(seconds=5)
        assert await store.count_scheduled() == 6
        assert await store.count_scheduled_for_tenant(A) == 5
        assert await store.cancel(A, ServiceCallId("far0"))
        assert await store.count_scheduled() == 5


class TestMigration:
    async def test_a_version_4_database_keeps_its_timers_near(self, db_path: Path) -> None:
        """Timers stored before the layout stay near (in the due indexes) and fire as
        before; timers written after the first find may be far."""
        connection = sqlite3.connect(db_path, isolation_level=None)
        try:
            migrate_to(connection, 4)
            connection.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at) "
                "VALUES ('tenant-a', 'old', '2030-01-05T11:00:00.000Z', '2030-01-01T12:00:00.000Z')"
            )
        finally:
            connection.close()
        async with SqliteTimerStore(db_path) as store:
            await store.find_due(T0, 10)
            await store.schedule(entry(call="new", due_in=4 * DAY))
            raw = sqlite3.connect(db_path)
            try:
                assert _far(raw) == {"old": None, "new": "2030-01-05T12:0"}
                assert _near_index(raw) == ["old"]
            finally:
                raw.close()
            found = await store.find_due(T0 + timedelta(days=4), 10)
            assert [e.service_call_id for e in found] == ["old", "new"]


class TestCensusOfFarTimers:
    async def test_counts_by_due_range_are_exact_across_buckets(
        self, store: SqliteTimerStore
    ) -> None:
        """Counts by due range see far timers exactly, ranges ending inside a bucket
        included, near and far together, each count capped."""
        await store.find_due(T0, 10)  # edge 12:30
        near = [entry(call=f"n{i}", due_in=i * MINUTE) for i in range(1, 4)]
        # Far: three in the 13:00 bucket (13:01, 13:05, 13:09), two at 13:10 and one a day on.
        far = [entry(call=f"f{i}", due_in=m * MINUTE) for i, m in enumerate((61, 65, 69, 70, 70.5))]
        far.append(entry("tenant-b", "day", due_in=DAY))
        await store.apply([*near, *far])

        def at(minutes: float) -> datetime:
            return T0 + timedelta(minutes=minutes)

        count = store.count_scheduled_due
        assert await count(after=None, until=None, cap=100) == 9
        assert await count(after=None, until=at(3), cap=100) == 3
        assert await count(after=at(62), until=at(69), cap=100) == 2  # 13:05, 13:09
        assert await count(after=at(61), until=at(70), cap=100) == 3  # 13:05, 13:09, 13:10
        assert await count(after=at(2), until=at(65), cap=100) == 3  # n3, 13:01, 13:05
        assert await count(after=at(69), until=None, cap=100) == 3
        assert await count(after=None, until=None, cap=4) == 4
        assert await count(after=None, until=None, cap=100, tenant_id=A) == 8
        assert await count(after=at(62), until=at(70), cap=100, tenant_id=A) == 3
        assert await count(after=None, until=at(3), cap=100, tenant_id=A) == 3

    async def test_tenants_and_their_earliest_due_times_include_far_ones(
        self, store: SqliteTimerStore
    ) -> None:
        """A tenant whose timers are all far is listed with its earliest; a tenant's page
        of timers by due time runs from near into far in order."""
        await store.find_due(T0, 10)
        await store.apply(
            [
                entry("tenant-a", "near", due_in=5),
                entry("tenant-a", "far", due_in=DAY),
                entry("tenant-b", "later", due_in=3 * DAY),
                entry("tenant-b", "far", due_in=2 * DAY),
            ]
        )
        tenants = await store.pending_tenants(limit=10)
        assert [(t.tenant_id, t.earliest_due_at) for t in tenants] == [
            ("tenant-a", T0 + timedelta(seconds=5)),
            ("tenant-b", T0 + timedelta(days=2)),
        ]
        assert await store.oldest_scheduled_due_at(TenantId("tenant-b")) == T0 + timedelta(days=2)
        page = await store.scheduled_for_tenant(A, due_from=None, due_until=None, limit=10)
        assert [e.service_call_id for e in page] == ["near", "far"]
        page = await store.scheduled_for_tenant(
            TenantId("tenant-b"), due_from=None, due_until=None, limit=1
        )
        assert [e.service_call_id for e in page] == ["far"]
