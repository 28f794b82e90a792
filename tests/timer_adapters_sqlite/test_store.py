"""SqliteTimerStore behaviour on a real database file, beyond the shared conformance suite."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from pathlib import Path

import attrs
import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import (
    CommandOutcome,
    DueCursor,
    PositionedOperation,
    StoreError,
    StoreUnavailable,
    TimerEntry,
    TimerKey,
    TimerState,
    TraceContext,
)

from .conftest import T0, entry


class TestLifecycle:
    async def test_constructor_touches_nothing(self, db_path: Path) -> None:
        """Building a store does no I/O: the database file appears only at start."""
        store = SqliteTimerStore(db_path)
        assert not await asyncio.to_thread(db_path.exists)
        await store.start()
        try:
            assert await asyncio.to_thread(db_path.exists)
        finally:
            await store.aclose()

    async def test_start_is_idempotent(self, store: SqliteTimerStore) -> None:
        """A second start on a started store keeps it working."""
        await store.start()
        assert await store.schedule(entry()) is CommandOutcome.SCHEDULED

    async def test_calls_before_start_are_unavailable(self, db_path: Path) -> None:
        """Using a store that was never started raises StoreUnavailable, not a crash."""
        store = SqliteTimerStore(db_path)
        with pytest.raises(StoreUnavailable, match="not started"):
            await store.schedule(entry())
        with pytest.raises(StoreUnavailable):
            await store.next_due_at()

    async def test_closed_store_is_unavailable_until_started_again(self, db_path: Path) -> None:
        """After aclose every call raises StoreUnavailable; start opens it again."""
        store = SqliteTimerStore(db_path)
        await store.start()
        await store.schedule(entry())
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await store.get(entry().tenant_id, entry().service_call_id)
        with pytest.raises(StoreUnavailable):
            await store.schedule(entry(call="call-2"))
        await store.start()
        try:
            assert await store.get(entry().tenant_id, entry().service_call_id) is not None
        finally:
            await store.aclose()

    async def test_close_finishes_queued_writes(self, db_path: Path) -> None:
        """Writes queued before aclose are committed and their callers resolved."""
        store = SqliteTimerStore(db_path)
        await store.start()
        calls = [asyncio.ensure_future(store.schedule(entry(call=f"c{i}"))) for i in range(50)]
        await asyncio.sleep(0)
        await store.aclose()
        assert [await call for call in calls] == [CommandOutcome.SCHEDULED] * 50
        connection = sqlite3.connect(db_path)
        try:
            assert connection.execute("SELECT count(*) FROM timer_schedules").fetchone() == (50,)
        finally:
            connection.close()

    async def test_async_with_starts_and_closes(self, db_path: Path) -> None:
        """``async with`` starts the store and closes it on exit."""
        async with SqliteTimerStore(db_path) as store:
            await store.schedule(entry())
        with pytest.raises(StoreUnavailable):
            await store.count_scheduled()

    @pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
    async def test_connections_get_the_pragmas(self, db_path: Path, synchronous: str) -> None:
        """Every connection runs in WAL with the chosen synchronous level, foreign keys on."""
        store = SqliteTimerStore(db_path, synchronous=synchronous, busy_timeout_ms=1234)
        await store.start()
        try:
            with store.engine.connect() as connection:
                pragma = connection.exec_driver_sql
                assert pragma("PRAGMA journal_mode").scalar() == "wal"
                assert (
                    pragma("PRAGMA synchronous").scalar() == {"NORMAL": 1, "FULL": 2}[synchronous]
                )
                assert pragma("PRAGMA busy_timeout").scalar() == 1234
                assert pragma("PRAGMA foreign_keys").scalar() == 1
        finally:
            await store.aclose()

    def test_bad_settings_are_refused(self, db_path: Path) -> None:
        """Unknown modes, synchronous levels and pragma injections fail at construction."""
        with pytest.raises(ValueError, match="mode"):
            SqliteTimerStore(db_path, mode="hosted")
        with pytest.raises(ValueError, match="synchronous"):
            SqliteTimerStore(db_path, synchronous="OFF")
        with pytest.raises(ValueError, match="busy_timeout_ms"):
            SqliteTimerStore(db_path, busy_timeout_ms=-1)


class TestApply:
    async def test_outcomes_follow_the_order_of_operations(self, store: SqliteTimerStore) -> None:
        """Later operations of one apply see earlier ones, one outcome each, in order."""
        timer = entry()
        outcomes = await store.apply(
            [TimerKey(timer.tenant_id, timer.service_call_id), timer, timer, timer.key, timer.key]
        )
        assert outcomes == [
            CommandOutcome.CANCEL_NOOP,
            CommandOutcome.SCHEDULED,
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCELLED,
            CommandOutcome.CANCEL_NOOP,
        ]
        assert await store.get(timer.tenant_id, timer.service_call_id) is None

    async def test_reschedule_replaces_due_correlation_and_registration(
        self, store: SqliteTimerStore
    ) -> None:
        """A Scheduled timer scheduled again takes the new due_at, correlation and registered_at."""
        await store.schedule(entry(due_in=10, correlation="first"))
        later = entry(due_in=99, correlation=None)
        later = later.__class__(
            tenant_id=later.tenant_id,
            service_call_id=later.service_call_id,
            due_at=later.due_at,
            registered_at=T0 + timedelta(seconds=5),
        )
        assert await store.schedule(later) is CommandOutcome.SCHEDULED
        assert await store.get(later.tenant_id, later.service_call_id) == later

    async def test_reached_timer_is_never_rearmed(self, store: SqliteTimerStore) -> None:
        """Scheduling a Reached timer changes nothing, in a batch with new keys too."""
        fired = entry(call="fired")
        await store.schedule(fired)
        await store.mark_reached([fired.reach(T0 + timedelta(seconds=1))])
        before = await store.get(fired.tenant_id, fired.service_call_id)
        outcomes = await store.apply(
            [entry(call="new"), entry(call="fired", due_in=500), entry(call="new", due_in=1)]
        )
        assert outcomes == [
            CommandOutcome.SCHEDULED,
            CommandOutcome.IGNORED_REACHED,
            CommandOutcome.SCHEDULED,
        ]
        after = await store.get(fired.tenant_id, fired.service_call_id)
        assert after == before
        assert after is not None and after.state is TimerState.REACHED
        assert await store.cancel(fired.tenant_id, fired.service_call_id) == (
            CommandOutcome.CANCEL_NOOP
        )

    async def test_reached_entries_are_refused(self, store: SqliteTimerStore) -> None:
        """apply takes Scheduled entries only; nothing of a refused batch is written."""
        with pytest.raises(ValueError, match="Scheduled"):
            await store.apply([entry(call="ok"), entry(call="bad").reach(T0)])
        assert await store.count_scheduled() == 0

    async def test_missing_correlation_is_stored_as_null(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """A timer without a correlation id has a NULL column and comes back with None."""
        await store.schedule(entry())
        assert raw.execute("SELECT correlation_id FROM timer_schedules").fetchall() == [(None,)]
        stored = await store.get(entry().tenant_id, entry().service_call_id)
        assert stored is not None and stored.correlation_id is None

    async def test_timestamps_are_stored_as_iso_text(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """Instants are written as YYYY-MM-DDTHH:MM:SS.sssZ text and read back exactly."""
        timer = entry(due_in=1.2345)
        await store.schedule(timer)
        row = raw.execute("SELECT due_at, registered_at, typeof(due_at) FROM timer_schedules")
        assert row.fetchone() == ("2030-01-01T12:00:01.235Z", "2030-01-01T12:00:00.000Z", "text")
        assert await store.get(timer.tenant_id, timer.service_call_id) == timer


class TestGroupCommit:
    async def test_concurrent_schedules_share_transactions(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """Many concurrent callers are written in fewer transactions than calls, all stored."""
        before = store.transactions_committed
        outcomes = await asyncio.gather(
            *(store.schedule(entry(call=f"call-{i}")) for i in range(300))
        )
        assert outcomes == [CommandOutcome.SCHEDULED] * 300
        assert store.transactions_committed - before < 300
        assert raw.execute("SELECT count(*) FROM timer_schedules").fetchone() == (300,)

    async def test_each_caller_returns_after_its_commit(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """When a schedule call returns, another connection already sees its timer."""

        async def schedule_and_look(call: str) -> bool:
            await store.schedule(entry(call=call))
            found = raw.execute(
                "SELECT 1 FROM timer_schedules WHERE service_call_id = ?", (call,)
            ).fetchone()
            return found is not None

        assert all(await asyncio.gather(*(schedule_and_look(f"c{i}") for i in range(200))))

    async def test_concurrent_batches_keep_their_own_order(self, store: SqliteTimerStore) -> None:
        """Each caller's operations apply in its order even when groups are merged."""

        async def churn(call: str) -> list[CommandOutcome]:
            timer = entry(call=call)
            return await store.apply([timer, timer.key, timer.key, timer])

        results = await asyncio.gather(*(churn(f"c{i}") for i in range(100)))
        assert (
            results
            == [
                [
                    CommandOutcome.SCHEDULED,
                    CommandOutcome.CANCELLED,
                    CommandOutcome.CANCEL_NOOP,
                    CommandOutcome.SCHEDULED,
                ]
            ]
            * 100
        )
        assert await store.count_scheduled() == 100


def rows_in_file_alone(db_path: Path) -> int:
    """Timers in a copy of the database file without its WAL (what checkpoints copied)."""
    copy = db_path.with_name("copy.db")
    copy.write_bytes(db_path.read_bytes())
    alone = sqlite3.connect(copy)
    try:
        (rows,) = alone.execute("SELECT count(*) FROM timer_schedules").fetchone()
    except sqlite3.DatabaseError:  # no table copied back yet, or copied mid-checkpoint
        return 0
    finally:
        alone.close()
    return int(rows)


class TestCheckpoints:
    async def test_commits_are_checkpointed_beside_the_writer(self, db_path: Path) -> None:
        """After commits, the checkpointer thread copies the WAL back into the database file.

        The writer's own checkpoint only starts past thousands of pages, so a database file
        holding the rows after a few small commits was written by the checkpointer.
        """
        async with SqliteTimerStore(db_path) as store:
            for batch in range(5):
                await store.apply([entry(call=f"b{batch}-{i}") for i in range(50)])
            deadline = asyncio.get_running_loop().time() + 10
            while rows_in_file_alone(db_path) < 250:
                assert asyncio.get_running_loop().time() < deadline, "the WAL was not copied back"
                await asyncio.sleep(0.01)
            assert store.checkpoints_completed > 0

    async def test_the_wal_stays_bounded_under_sustained_writes(self, db_path: Path) -> None:
        """Back-to-back batches do not grow the WAL past its limit (checkpoints keep up)."""
        async with SqliteTimerStore(db_path) as store:
            for batch in range(40):
                await store.apply([entry(call=f"b{batch}-{i:04d}") for i in range(500)])
            wal = db_path.with_name(db_path.name + "-wal")
            assert wal.stat().st_size <= 64 * 1024 * 1024
            assert store.checkpoints_completed > 0


class TestTenantIsolation:
    async def test_due_query_returns_only_the_tenants_timers(self, store: SqliteTimerStore) -> None:
        """The seed's isolation test: a tenant's due query never returns another tenant's."""
        await store.schedule(entry(tenant="tenant-a", call="same-id"))
        await store.schedule(entry(tenant="tenant-b", call="same-id"))
        due = await store.find_due_for_tenant("tenant-a", T0, 100)
        assert [(t.tenant_id, t.service_call_id) for t in due] == [("tenant-a", "same-id")]

    async def test_tenant_scoped_calls_never_cross_tenants(self, store: SqliteTimerStore) -> None:
        """get, list, correlation lookup and cancel of one tenant leave the other alone."""
        await store.schedule(entry(tenant="tenant-b", call="x", correlation="trace"))
        a, x = "tenant-a", "x"
        assert await store.get(a, x) is None
        assert await store.list_for_tenant(a) == []
        assert await store.find_by_correlation(a, "trace") == []
        assert await store.cancel(a, x) is CommandOutcome.CANCEL_NOOP
        assert await store.get("tenant-b", x) is not None


class TestQueries:
    async def test_find_due_orders_across_tenants_and_pages(self, store: SqliteTimerStore) -> None:
        """find_due is in (due_at, tenant, service call) order and continues after a cursor."""
        timers = [
            entry(tenant="t-b", call="c1", due_in=1),
            entry(tenant="t-a", call="c2", due_in=1),
            entry(tenant="t-a", call="c1", due_in=1),
            entry(tenant="t-a", call="c0", due_in=0),
            entry(tenant="t-a", call="late", due_in=60),
        ]
        await store.apply(timers)
        now = T0 + timedelta(seconds=1)
        first = await store.find_due(now, 2)
        rest = await store.find_due(now, 10, after=DueCursor.of(first[-1]))
        keys = [(t.tenant_id, t.service_call_id) for t in first + rest]
        assert keys == [("t-a", "c0"), ("t-a", "c1"), ("t-a", "c2"), ("t-b", "c1")]

    async def test_tenant_due_query_breaks_ties_by_service_call(
        self, store: SqliteTimerStore
    ) -> None:
        """Timers of one tenant due at the same instant come in service call order."""
        await store.apply([entry(call=c) for c in ("b", "c", "a")])
        due = await store.find_due_for_tenant("tenant-a", T0, 10)
        assert [t.service_call_id for t in due] == ["a", "b", "c"]

    async def test_next_due_at_ignores_reached_timers(self, store: SqliteTimerStore) -> None:
        """next_due_at is the earliest Scheduled due time, None when nothing is pending."""
        assert await store.next_due_at() is None
        early, late = entry(call="early", due_in=1), entry(call="late", due_in=9)
        await store.apply([early, late])
        assert await store.next_due_at() == early.due_at
        await store.mark_reached([early.reach(T0 + timedelta(seconds=2))])
        assert await store.next_due_at() == late.due_at
        assert await store.count_scheduled() == 1

    @pytest.mark.parametrize("count_slice", [1, 4, 7, 23, 50_000])
    async def test_count_in_slices_counts_each_pending_timer_once(
        self, store: SqliteTimerStore, count_slice: int
    ) -> None:
        """count_scheduled counts every Scheduled timer once whatever the slice, ties on the
        due time across tenants included, and no fired timer."""
        timers = [entry(f"tenant-{i % 3}", f"call-{i}", due_in=i // 5) for i in range(23)]
        await store.apply(timers)
        await store.mark_reached([timers[0].reach(T0), timers[9].reach(T0 + timedelta(seconds=9))])
        store.count_slice = count_slice
        assert await store.count_scheduled() == 21

    async def test_mark_reached_is_one_guarded_transaction(self, store: SqliteTimerStore) -> None:
        """A batch is marked in one transaction; rescheduled or marked timers are left alone."""
        timers = [entry(call=f"c{i}") for i in range(100)]
        await store.apply(timers)
        await store.schedule(entry(call="c0", due_in=30))
        reached = [t.reach(T0) for t in timers]
        before = store.transactions_committed
        assert await store.mark_reached(reached) == 99
        assert store.transactions_committed == before + 1
        later = [t.reach(T0 + timedelta(seconds=1)) for t in timers[1:]]
        assert await store.mark_reached(later) == 0
        kept = await store.get("tenant-a", "c1")
        assert kept is not None and kept.reached_at == T0
        moved = await store.get("tenant-a", "c0")
        assert moved is not None and moved.is_scheduled

    async def test_entries_read_back_equal_the_validated_ones(
        self, store: SqliteTimerStore
    ) -> None:
        """Every read returns, field by field and type by type, the entry that was stored."""
        trace = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "k=v")
        stored = [
            attrs.evolve(entry(call="c1", correlation="corr-1"), trace_context=trace),
            entry(tenant="tenant-b", call="c2", due_in=0.001),
        ]
        await store.apply(stored)
        fired = stored[1].reach(T0 + timedelta(seconds=1))
        await store.mark_reached([fired])
        expected = [stored[0], fired]
        found = await store.find_due(T0 + timedelta(seconds=5), 10)
        read = [
            await store.get(stored[0].tenant_id, "c1"),
            await store.get("tenant-b", "c2"),
        ]
        assert found == [stored[0]]
        assert read == expected
        for got, want in [(found[0], stored[0]), *zip(read, expected, strict=True)]:
            assert got is not None
            for field in attrs.fields(TimerEntry):
                assert type(getattr(got, field.name)) is type(getattr(want, field.name))

    async def test_purge_deletes_oldest_reached_only(self, store: SqliteTimerStore) -> None:
        """purge_reached removes the oldest fired timers up to the limit, never Scheduled ones."""
        timers = [entry(call=f"c{i}") for i in range(5)]
        await store.apply([*timers, entry(call="pending", due_in=999)])
        await store.mark_reached([t.reach(T0 + timedelta(seconds=i)) for i, t in enumerate(timers)])
        assert await store.purge_reached(T0 + timedelta(seconds=3), limit=2) == 2
        left = [t.service_call_id for t in await store.list_for_tenant("tenant-a")]
        assert left == ["c2", "c3", "c4", "pending"]
        assert await store.purge_reached(T0 + timedelta(days=1), limit=100) == 3
        assert [t.service_call_id for t in await store.list_for_tenant("tenant-a")] == ["pending"]

    async def test_a_long_purge_lets_writes_queued_meanwhile_commit_first(
        self, db_path: Path
    ) -> None:
        """A purge of many commits slice by slice: a write queued while it runs (a mark of
        fired timers, new commands) is committed between two slices, not after the purge;
        and the purge still deletes all it was asked to, tombstones included."""
        # NORMAL: a write is answered at its commit (at FULL, after the syncer's fsync,
        # which a loaded disk may hold past the purge's last slice).
        store = SqliteTimerStore(db_path, synchronous="NORMAL")
        await store.start()
        try:
            await self._purge_beside_a_write(store)
        finally:
            await store.aclose()

    @staticmethod
    async def _purge_beside_a_write(store: SqliteTimerStore) -> None:
        store.purge_slice_s = 0.0  # one statement a slice: many slices
        timers = [entry(call=f"old-{i:03d}") for i in range(200)]
        await store.apply(timers)
        await store.mark_reached([t.reach(T0) for t in timers])
        await store.apply([PositionedOperation(TimerKey("tenant-a", "gone"), 5, T0)])
        committed = store.transactions_committed
        purging = asyncio.ensure_future(store.purge_reached(T0 + timedelta(days=1), limit=500))
        await asyncio.sleep(0)  # the purge's first slice is queued
        await store.apply([entry(call="new", due_in=60)])
        assert not purging.done()  # the write did not wait for the whole purge
        assert await purging == 201  # 200 fired timers and the tombstone
        assert store.transactions_committed - committed >= 200 // 16
        assert [t.service_call_id for t in await store.list_for_tenant("tenant-a")] == ["new"]

    async def test_list_and_correlation_are_in_key_order(self, store: SqliteTimerStore) -> None:
        """list_for_tenant pages by service call id; correlation lookups come in key order."""
        await store.apply([entry(call=c, correlation="trace") for c in ("c3", "c1", "c2")])
        page = await store.list_for_tenant("tenant-a", limit=2)
        assert [t.service_call_id for t in page] == ["c1", "c2"]
        rest = await store.list_for_tenant("tenant-a", after=page[-1].service_call_id)
        assert [t.service_call_id for t in rest] == ["c3"]
        found = await store.find_by_correlation("tenant-a", "trace")
        assert [t.service_call_id for t in found] == ["c1", "c2", "c3"]


class TestDriverErrors:
    async def test_locked_database_is_unavailable_then_recovers(self, db_path: Path) -> None:
        """A write blocked by another connection's lock raises StoreUnavailable, then works."""
        store = SqliteTimerStore(db_path, busy_timeout_ms=50)
        await store.start()
        blocker = sqlite3.connect(db_path, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreUnavailable, match="locked"):
                await store.schedule(entry())
            with pytest.raises(StoreUnavailable):
                await store.mark_reached([entry(call="x").reach(T0)])
            blocker.execute("COMMIT")
            assert await store.schedule(entry()) is CommandOutcome.SCHEDULED
        finally:
            blocker.close()
            await store.aclose()

    async def test_full_database_is_unavailable(self, db_path: Path) -> None:
        """A write that needs more pages than allowed raises StoreUnavailable; reads go on."""
        async with SqliteTimerStore(db_path):
            pass
        connection = sqlite3.connect(db_path)
        (pages,) = connection.execute("PRAGMA page_count").fetchone()
        connection.close()
        store = SqliteTimerStore(db_path, pragmas={"max_page_count": pages + 2})
        await store.start()
        try:
            await store.schedule(entry(call="small"))
            with pytest.raises(StoreUnavailable, match="full"):
                await store.apply([entry(call=f"bulk-{i:05d}") for i in range(5000)])
            assert [t.service_call_id for t in await store.list_for_tenant("tenant-a")] == ["small"]
            assert await store.cancel("tenant-a", "small") is CommandOutcome.CANCELLED
        finally:
            await store.aclose()

    async def test_unexpected_sql_errors_are_store_errors(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """A database changed behind the store's back yields StoreError, never sqlite3's own."""
        raw.execute("DROP TABLE timer_schedules")
        with pytest.raises(StoreError) as read_error:
            await store.get("tenant-a", "call-1")
        with pytest.raises(StoreError) as write_error:
            await store.schedule(entry())
        for error in (read_error.value, write_error.value):
            assert not isinstance(error, sqlite3.Error)
            assert "no such table" in str(error)


class TestDueByTenantWhenAllFit:
    async def test_tenants_are_listed_only_when_more_is_due_than_the_claim(
        self, store: SqliteTimerStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """find_due_by_tenant reads what is due from the due index when all of it fits in the
        claim, and lists the tenants (here made to fail) only when more is due."""
        from timer_adapters_sqlite import _store

        await store.apply([entry(f"tenant-{i % 3}", f"call-{i}", due_in=i) for i in range(5)])
        monkeypatch.setattr(_store, "DUE_TENANTS", "SELECT no_such_function()")
        now = T0 + timedelta(seconds=10)
        found = await store.find_due_by_tenant(now, 5, after={})
        assert [e.service_call_id for e in found] == [f"call-{i}" for i in range(5)]
        first = found[0]
        rest = await store.find_due_by_tenant(now, 5, after={first.tenant_id: DueCursor.of(first)})
        assert [e.service_call_id for e in rest] == [f"call-{i}" for i in range(1, 5)]
        with pytest.raises(StoreError):
            await store.find_due_by_tenant(now, 4, after={})
