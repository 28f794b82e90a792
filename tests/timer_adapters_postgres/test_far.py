"""Timers due past the far edge (schema version 7): written far, moved near by the advance,
and never left far below the edge by a writer racing an advance."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import sqlalchemy as sa

from tests.timer_adapters_postgres.test_schema import connect, migrate_by_hand
from timer_adapters_postgres import (
    MIGRATIONS,
    PostgresTimerStore,
    metadata,
    schedule_in_transaction,
)
from timer_adapters_postgres._schema import FAR_EDGE_LOCK
from timer_core import ScheduleTimer, ServiceCallId, TenantId, TimerEntry
from timer_core.horizon import edge_for

T = TenantId("tenant-a")
# Every test's budget for an event that takes milliseconds on a quiet machine.
BUDGET_S = 30.0


def entry(call: str, due_at: datetime) -> TimerEntry:
    registered = datetime(2026, 1, 1, tzinfo=UTC)
    return TimerEntry(T, ServiceCallId(call), due_at=due_at, registered_at=registered)


def rows(sql: psycopg.Connection[Any]) -> dict[str, tuple[datetime, datetime | None]]:
    """Every timer's due time and far bucket, by service call id."""
    found = sql.execute("SELECT service_call_id, due_at, far_bucket FROM timer_schedules")
    return {call: (due, bucket) for call, due, bucket in found.fetchall()}


def stored_edge(sql: psycopg.Connection[Any]) -> datetime | None:
    row = sql.execute("SELECT edge FROM timer_horizon").fetchone()
    return None if row is None else row[0]


def far_below_the_edge(sql: psycopg.Connection[Any]) -> list[str]:
    """Timers that break the invariant: far, yet due before the stored edge."""
    found = sql.execute(
        "SELECT service_call_id FROM timer_schedules, timer_horizon "
        "WHERE far_bucket IS NOT NULL AND due_at < edge"
    )
    return [call for (call,) in found.fetchall()]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (polling) until ``condition()`` holds, at most BUDGET_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BUDGET_S
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"waited {BUDGET_S} s for {what}")
        await asyncio.sleep(0.01)


class TestFarTimers:
    """Timers far ahead are kept out of the due-order indexes until the edge comes near."""

    async def test_start_sets_the_edge_from_the_database_clock(
        self, make_started_store: Callable[..., Any], postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A store started on a database without an edge sets one 20-30 minutes past the
        database's now, on a 10-minute boundary."""
        store: PostgresTimerStore = await make_started_store(listen=False)
        row = postgres_sql.execute("SELECT now()").fetchone()
        assert row is not None
        now = row[0]
        edge = stored_edge(postgres_sql)
        assert edge is not None and store.far_edge == edge
        assert now + timedelta(minutes=19) <= edge <= now + timedelta(minutes=31)
        assert edge.timestamp() % 600 == 0

    async def test_a_far_timer_fires_after_an_advance(
        self, make_started_store: Callable[..., Any], postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A timer due days past the edge is written far; a find at its due time moves the
        edge past it first and claims it; one due before the edge is written near."""
        store: PostgresTimerStore = await make_started_store(listen=False)
        edge = store.far_edge
        assert edge is not None
        due = edge + timedelta(days=3, seconds=7)
        await store.apply([entry("far", due), entry("near", edge - timedelta(seconds=1))])
        stored = rows(postgres_sql)
        assert stored["far"][1] == datetime.fromtimestamp(due.timestamp() // 600 * 600, UTC)
        assert stored["near"][1] is None
        assert await store.find_due(due - timedelta(milliseconds=1), 10) == [
            entry("near", edge - timedelta(seconds=1))
        ]
        found = await store.find_due(due, 10)
        assert [e.service_call_id for e in found] == ["near", "far"]
        assert rows(postgres_sql)["far"][1] is None
        assert store.far_edge == stored_edge(postgres_sql) == edge_for(due)
        assert far_below_the_edge(postgres_sql) == []

    async def test_the_edge_only_moves_forward(
        self, make_started_store: Callable[..., Any], postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A store whose edge is behind the stored one (another instance raised it) never
        lowers it, and learns the higher one."""
        ahead: PostgresTimerStore = await make_started_store(listen=False)
        behind: PostgresTimerStore = await make_started_store(listen=False)
        first = ahead.far_edge
        assert first is not None and behind.far_edge == first
        week = first + timedelta(days=7)
        await ahead.find_due(week, 10)
        assert stored_edge(postgres_sql) == edge_for(week)
        # ``behind`` still knows the first edge: a find past it advances to a lower target.
        await behind.find_due(first + timedelta(minutes=1), 10)
        assert stored_edge(postgres_sql) == edge_for(week)
        assert behind.far_edge == edge_for(week)
        await behind.find_due(week + timedelta(days=1), 10)
        assert stored_edge(postgres_sql) == edge_for(week + timedelta(days=1))

    async def test_a_host_transaction_writes_far_timers_far(
        self,
        postgres_url: str,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """schedule_in_transaction judges the edge as the store does, and a reschedule moves
        a timer between near and far."""
        store: PostgresTimerStore = await make_started_store(listen=False)
        edge = store.far_edge
        assert edge is not None
        engine = sa.create_engine(postgres_url)
        try:
            with engine.begin() as conn:
                command = ScheduleTimer(T, ServiceCallId("host"), due_at=edge + timedelta(days=1))
                schedule_in_transaction(conn, command, now=edge - timedelta(hours=1))
        finally:
            engine.dispose()
        assert rows(postgres_sql)["host"][1] is not None
        await store.schedule(entry("host", edge - timedelta(minutes=1)))
        assert rows(postgres_sql)["host"][1] is None
        await store.schedule(entry("host", edge + timedelta(minutes=1)))
        assert rows(postgres_sql)["host"][1] == edge

    async def test_next_due_is_exact_across_near_and_far(
        self, make_started_store: Callable[..., Any], postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """next_due_at is the earliest of the near timers and the lowest far bucket's, even
        when a near timer (written before there was an edge) is due after a far one."""
        store: PostgresTimerStore = await make_started_store(listen=False)
        edge = store.far_edge
        assert edge is not None
        await store.apply([entry("far-late", edge + timedelta(days=2))])
        await store.apply([entry("far-early", edge + timedelta(days=1, seconds=3))])
        assert await store.next_due_at() == edge + timedelta(days=1, seconds=3)
        postgres_sql.execute(
            "UPDATE timer_schedules SET far_bucket = NULL WHERE service_call_id = 'far-late'"
        )
        assert await store.next_due_at() == edge + timedelta(days=1, seconds=3)
        await store.schedule(entry("near", edge - timedelta(minutes=5)))
        assert await store.next_due_at() == edge - timedelta(minutes=5)


class TestAdvanceRaces:
    """No writer commits a timer far below the edge, whichever of it and an advance goes
    first: the writers hold the edge's lock shared, the advance takes it exclusive."""

    async def test_a_writer_holding_an_old_edge_keeps_the_edge_where_it_read_it(
        self,
        postgres_url: str,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """A host transaction wrote a timer far under the current edge and has not committed:
        a find an hour past the edge (another store) moves what is committed but leaves the
        edge, so once the host commits its timer is found."""
        store: PostgresTimerStore = await make_started_store(listen=False)
        edge = store.far_edge
        assert edge is not None
        due = edge + timedelta(minutes=5)
        later = edge + timedelta(hours=1)
        engine = sa.create_engine(postgres_url)
        try:
            with engine.connect() as conn:
                conn.begin()
                command = ScheduleTimer(T, ServiceCallId("racing"), due_at=due)
                schedule_in_transaction(conn, command, now=edge - timedelta(hours=1))
                await store.apply([entry("committed", due)])
                found = await store.find_due(later, 10)
                assert [e.service_call_id for e in found] == ["committed"]
                # The committed one was moved near, but the edge stays while the host holds
                # the edge's lock.
                assert rows(postgres_sql)["committed"][1] is None
                assert stored_edge(postgres_sql) == store.far_edge == edge
                conn.commit()
        finally:
            engine.dispose()
        assert far_below_the_edge(postgres_sql) == []
        assert [e.service_call_id for e in await store.find_due(later, 10)] == [
            "committed",
            "racing",
        ]
        assert stored_edge(postgres_sql) == edge_for(later)

    async def test_a_writer_waiting_for_an_advance_reads_the_raised_edge(
        self,
        postgres_url: str,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """An insert that starts while an advance holds the edge's lock waits for it and then
        writes its timer near under the raised edge (the edge is read after the lock, not in
        the insert's own snapshot)."""
        writer: PostgresTimerStore = await make_started_store(listen=False)
        edge = writer.far_edge
        assert edge is not None
        raised = edge + timedelta(hours=1)
        conninfo = sa.make_url(postgres_url).set(drivername="postgresql")
        with psycopg.connect(conninfo.render_as_string(hide_password=False)) as advance:
            # An advance's last transaction, stopped after the edge's rise.
            advance.execute("SELECT pg_advisory_xact_lock(%s)", (FAR_EDGE_LOCK,))
            advance.execute("UPDATE timer_horizon SET edge = %s", (raised,))
            scheduling = asyncio.create_task(
                writer.schedule(entry("racing", edge + timedelta(minutes=5)))
            )
            await until(
                lambda: waiting_for_the_edge(postgres_sql) or scheduling.done(),
                "the insert to wait for the edge's lock",
            )
            assert not scheduling.done()
            advance.commit()
        await asyncio.wait_for(scheduling, BUDGET_S)
        assert rows(postgres_sql)["racing"][1] is None
        assert far_below_the_edge(postgres_sql) == []

    async def test_concurrent_writers_and_advances_keep_the_invariant(
        self,
        postgres_url: str,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """Two stores scheduling timers just past the edge while a third and host
        transactions on their own threads race finds that advance it: every timer is found
        at the end and none was ever left far below the edge."""
        stores: list[PostgresTimerStore] = [
            await make_started_store(listen=False) for _ in range(3)
        ]
        edge = stores[0].far_edge
        assert edge is not None
        steps = 12
        stop = threading.Event()
        hosts_wrote: list[str] = []

        def host_writes() -> None:
            engine = sa.create_engine(postgres_url)
            try:
                n = 0
                while not stop.is_set():
                    with engine.begin() as conn:
                        # Due just past wherever the edge was when this ran.
                        current = conn.execute(
                            sa.text("SELECT edge FROM timer_horizon")
                        ).scalar_one()
                        call = ServiceCallId(f"host-{n}")
                        command = ScheduleTimer(T, call, due_at=current + timedelta(seconds=1))
                        schedule_in_transaction(conn, command, now=edge)
                    hosts_wrote.append(call)
                    n += 1
            finally:
                engine.dispose()

        async def store_writes(store: PostgresTimerStore, name: str) -> None:
            for n in range(steps * 4):
                current = stored_edge(postgres_sql)
                assert current is not None
                await store.schedule(entry(f"{name}-{n}", current + timedelta(seconds=1)))

        async def advances() -> None:
            for n in range(1, steps + 1):
                found = await stores[2].find_due(edge + timedelta(minutes=10 * n), 1)
                await stores[2].release_claims(found)
                assert far_below_the_edge(postgres_sql) == []

        host = threading.Thread(target=host_writes)
        host.start()
        try:
            await asyncio.gather(
                store_writes(stores[0], "a"), store_writes(stores[1], "b"), advances()
            )
        finally:
            stop.set()
            host.join(BUDGET_S)
        assert far_below_the_edge(postgres_sql) == []
        written = set(rows(postgres_sql))
        assert {f"{s}-{n}" for s in "ab" for n in range(steps * 4)} | set(hosts_wrote) <= written
        end = edge + timedelta(days=1)
        claimed: list[TimerEntry] = []
        while batch := await stores[0].find_due(end, 1000):
            claimed += batch
            await stores[0].mark_reached([e.reach(end) for e in batch])
        assert {e.service_call_id for e in claimed} == written


def waiting_for_the_edge(sql: psycopg.Connection[Any]) -> bool:
    """Whether some session waits for the far edge's advisory lock."""
    found = sql.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    ).fetchone()
    return bool(found and found[0])


class TestMigrationToFarTimers:
    """Schema version 7 comes to a database version 6 made: its timers stay near and fire."""

    async def test_version_6_timers_stay_near_and_fire(self, fresh_postgres_url: str) -> None:
        """Timers of a version 6 database, due long ago and in a year, are near after the
        migration; both are found when due, and next_due_at sees the later one."""
        with connect(fresh_postgres_url) as conn:
            migrate_by_hand(conn, [m for m in MIGRATIONS if m.version <= 6])
            conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES ('tenant-a', 'past', '2020-01-01Z', '2020-01-01Z'),"
                " ('tenant-a', 'year', now() + interval '365 days', '2020-01-01Z')"
            )
        async with PostgresTimerStore(fresh_postgres_url, listen=False) as store:
            with connect(fresh_postgres_url) as conn:
                assert rows(conn)["past"][1] is None and rows(conn)["year"][1] is None
                assert stored_edge(conn) is not None
                year = rows(conn)["year"][0]
            assert await store.count_scheduled() == 2
            (past,) = await store.find_due(datetime(2021, 1, 1, tzinfo=UTC), 10)
            assert past.service_call_id == "past"
            await store.mark_reached([past.reach(datetime(2021, 1, 1, tzinfo=UTC))])
            await store.schedule(entry("far", year + timedelta(days=1)))
            next_due = await store.next_due_at()
            assert next_due is not None and abs(next_due - year) < timedelta(milliseconds=1)
            found = await store.find_due(year + timedelta(days=1, seconds=1), 10)
            assert [e.service_call_id for e in found] == ["year", "far"]


class TestMetadata:
    """The exported metadata makes a schema the writers work on, far edge function included."""

    async def test_create_all_makes_the_far_edge_function(self, fresh_postgres_url: str) -> None:
        """After metadata.create_all (a host's Alembic), a host transaction writes a timer
        past the edge far and one before it near."""
        engine = sa.create_engine(fresh_postgres_url)
        try:
            metadata.create_all(engine)
            edge = datetime(2030, 1, 1, tzinfo=UTC)
            with engine.begin() as conn:
                conn.execute(
                    sa.text("INSERT INTO timer_horizon (id, edge) VALUES (1, :e)"), {"e": edge}
                )
                for call, due in (("far", edge + timedelta(days=1)), ("near", edge)):
                    command = ScheduleTimer(T, ServiceCallId(call), due_at=due - timedelta(0, 1))
                    schedule_in_transaction(conn, command, now=edge - timedelta(days=1))
            with connect(fresh_postgres_url) as sql:
                stored = rows(sql)
            assert stored["far"][1] == edge + timedelta(days=1) - timedelta(minutes=10)
            assert stored["near"][1] is None
            metadata.drop_all(engine)
        finally:
            engine.dispose()
