"""EXPLAIN QUERY PLAN proofs: every query the store runs seeks an index, none scans the table."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_adapters_sqlite import _census as census
from timer_adapters_sqlite import _sql as queries

from .conftest import T0, entry

_NOW = "2030-01-01T12:00:00.000Z"


async def _populate(path: Path) -> None:
    async with SqliteTimerStore(path) as store:
        timers = [
            entry(f"tenant-{i % 20}", f"call-{i}", due_in=i, correlation=f"trace-{i % 50}")
            for i in range(2000)
        ]
        await store.apply(timers)
        await store.mark_reached([t.reach(T0 + timedelta(hours=1)) for t in timers[:1500]])


@pytest.fixture(scope="module", params=["fresh", "analyzed"])
def planner(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sqlite3.Connection]:
    """A populated database (20 tenants, some timers fired), with or without ANALYZE stats."""
    path = tmp_path_factory.mktemp("plans") / "timer.db"
    asyncio.run(_populate(path))
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        if request.param == "analyzed":
            connection.execute("ANALYZE")
        yield connection
    finally:
        connection.close()


def plan(connection: sqlite3.Connection, sql: str, params: Any = ()) -> list[str]:
    """The detail lines of the statement's query plan."""
    return [row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {sql}", params)]


def assert_index_search(details: list[str], expected: str) -> None:
    """The plan seeks ``expected`` and never scans a table or index."""
    assert any(d.startswith("SEARCH timer_schedules USING") and expected in d for d in details), (
        details
    )
    assert not any(d.startswith("SCAN") for d in details), details


class TestDueQueryPlans:
    def test_seed_tenant_polling_query_uses_the_seed_index(
        self, planner: sqlite3.Connection
    ) -> None:
        """The seed's per-tenant polling query, on the timers near enough to be in the due
        indexes, is an index search on the tenant-first index."""
        details = plan(
            planner,
            "SELECT * FROM timer_schedules WHERE tenant_id = 'tenant-a' AND state = 'Scheduled'"
            " AND far_bucket IS NULL AND due_at <= '2025-11-14T10:00:00Z'"
            " ORDER BY due_at ASC LIMIT 100",
        )
        assert details[0].startswith(
            "SEARCH timer_schedules USING INDEX idx_timer_schedules_tenant_due"
        )
        assert not any("SCAN" in d or "TEMP B-TREE" in d for d in details), details

    def test_tenant_due_query_reads_the_tenant_index_in_order(
        self, planner: sqlite3.Connection
    ) -> None:
        """find_due_for_tenant seeks the tenant-first partial index: no scan, no sort."""
        details = plan(planner, queries.FIND_DUE_FOR_TENANT, ("tenant-1", _NOW, 100))
        assert_index_search(details, "idx_timer_schedules_tenant_due (tenant_id=? AND due_at<?)")
        assert not any("TEMP B-TREE" in d for d in details), details

    def test_tenant_share_queries_seek_the_tenant_index(self, planner: sqlite3.Connection) -> None:
        """find_due_by_tenant: a few seeks per tenant to list them, and each tenant's due
        timers after its cursor read in index order, whatever the tenant's backlog."""
        details = plan(planner, queries.DUE_TENANTS, (_NOW, 100))
        searches = [d for d in details if d.startswith("SEARCH")]
        assert searches and all("idx_timer_schedules_tenant_due" in d for d in searches), details
        assert not any(d.startswith("SCAN timer_schedules") for d in details), details
        wanted = json.dumps([["tenant-1", "", ""], ["tenant-2", _NOW, "call-1"]])
        details = plan(planner, queries.FIND_DUE_OF_TENANTS, (wanted, _NOW, 10))
        assert any(
            "idx_timer_schedules_tenant_due (tenant_id=? AND (due_at,service_call_id)>(?,?)" in d
            for d in details
        ), details
        assert not any(d.startswith("SCAN timer_schedules") for d in details), details
        assert not any("TEMP B-TREE" in d for d in details), details

    def test_next_due_at_is_one_seek(self, planner: sqlite3.Connection) -> None:
        """next_due_at reads the first entry of the partial index."""
        details = plan(planner, queries.NEXT_DUE_AT)
        assert_index_search(details, "idx_timer_schedules_scheduled_due")


class TestOtherPlans:
    @pytest.mark.parametrize(
        ("sql", "params"),
        [
            (queries.INSERT_NEW, ("t", "c", None, _NOW, _NOW, None, None, None)),
            (queries.INSERT_NEW, ("t", "c", None, _NOW, _NOW, 7, "00-x-y-01", None)),
            (queries.RESCHEDULE, ("t", "c", None, _NOW, _NOW, 7, "00-x-y-01", None)),
            (queries.CANCEL, ("t", "c")),
            (queries.MARK_REACHED, (_NOW, "t", "c", _NOW)),
            (queries.POSITIONS, ("t", "c")),
            (str(queries.GET), {"tenant": "t", "call": "c"}),
            (str(queries.LIST_FOR_TENANT), {"tenant": "t", "after": "", "limit": 10}),
        ],
    )
    def test_key_lookups_use_the_primary_key(
        self, planner: sqlite3.Connection, sql: str, params: Any
    ) -> None:
        """Writes and key lookups seek the primary key."""
        details = plan(planner, sql, params)
        # A SELECT of literals only "scans" its one constant row.
        assert not any(d.startswith("SCAN") and d != "SCAN CONSTANT ROW" for d in details), details
        searches = [d for d in details if d.startswith("SEARCH")]
        # A plain INSERT has no plan lines of its own; the rest seek a primary key (the far
        # edge is the one row of timer_horizon, read by its key).
        assert all(
            "sqlite_autoindex_timer_schedules_1 (tenant_id=?" in d
            or "sqlite_autoindex_timer_tombstones_1 (tenant_id=?" in d
            or d == "SEARCH timer_horizon USING INTEGER PRIMARY KEY (rowid=?)"
            for d in searches
        ), details
        if sql not in (queries.INSERT_NEW, queries.CANCEL, queries.RESCHEDULE):
            assert any("sqlite_autoindex_timer_schedules_1 (tenant_id=?" in d for d in details)

    def test_correlation_lookup_seeks_the_correlation_index(
        self, planner: sqlite3.Connection
    ) -> None:
        """find_by_correlation seeks idx_timer_schedules_correlation_id."""
        details = plan(
            planner, str(queries.FIND_BY_CORRELATION), {"tenant": "t", "correlation": "x"}
        )
        assert_index_search(details, "idx_timer_schedules_correlation_id (correlation_id=?)")

    def test_purge_seeks_the_oldest_fired_timers(self, planner: sqlite3.Connection) -> None:
        """purge_reached finds old fired timers through their partial index, deletes by rowid
        (no walk down the key's index to find each row)."""
        details = plan(planner, str(queries.PURGE_REACHED), {"before": _NOW, "limit": 10})
        assert_index_search(details, "idx_timer_schedules_reached_at (reached_at<?)")
        assert_index_search(details, "USING INTEGER PRIMARY KEY (rowid=?)")
        assert not any("sqlite_autoindex_timer_schedules_1" in d for d in details), details

    @pytest.mark.parametrize(
        "name", ["POSITIONS_JSON", "CANCEL_JSON", "TOMBSTONE_JSON", "RESCHEDULE_JSON"]
    )
    def test_batch_writes_seek_by_key(self, planner: sqlite3.Connection, name: str) -> None:
        """A batch's keys are read, rescheduled, deleted and tombstoned key by key."""
        keys = json.dumps([["tenant-1", "call-1", 7, _NOW], ["tenant-2", "call-2", 8, _NOW]])
        details = plan(planner, getattr(queries, name), (keys,))
        assert not any(
            d.startswith("SCAN") and "json_each" not in d and "VIRTUAL TABLE" not in d
            for d in details
        ), details

    def test_tombstone_writes_and_purge_seek_their_indexes(
        self, planner: sqlite3.Connection
    ) -> None:
        """A positioned cancel's tombstone is written by key, purged through its time index."""
        details = plan(planner, queries.TOMBSTONE, ("t", "c", 7, _NOW))
        assert not any(d.startswith("SCAN") for d in details), details
        details = plan(planner, str(queries.PURGE_TOMBSTONES), {"before": _NOW, "limit": 10})
        assert any(
            d.startswith("SEARCH timer_tombstones USING")
            and "idx_timer_tombstones_cancelled_at (cancelled_at<?)" in d
            for d in details
        ), details
        assert not any(d.startswith("SCAN") for d in details), details

    @pytest.mark.parametrize("name", ["COUNT_SCHEDULED_BOUNDARY", "COUNT_SCHEDULED_REST"])
    def test_count_slices_seek_the_scheduled_index(
        self, planner: sqlite3.Connection, name: str
    ) -> None:
        """Each slice of count_scheduled seeks the partial index of Scheduled timers after its
        key and never scans the table."""
        sql = getattr(queries, name)
        args = ("2030-01-01T00:00:00.000Z", "tenant-1", "call-1") + ((100,) if "?4" in sql else ())
        details = plan(planner, sql, args)
        assert len(details) == 1, details
        assert details[0].startswith("SEARCH timer_schedules USING "), details
        assert "INDEX idx_timer_schedules_scheduled_due (" in details[0], details


class TestCensusQueryPlans:
    """The census and the console's look-ups seek indexes: their cost never grows with the
    table (capped counts stop at their LIMIT)."""

    @pytest.mark.parametrize(
        ("name", "index", "params"),
        [
            ("COUNT_DUE", "idx_timer_schedules_scheduled_due", ("", _NOW, 1000)),
            ("COUNT_TENANT_DUE", "idx_timer_schedules_tenant_due", ("", _NOW, 1000, "tenant-1")),
            ("PENDING_TENANTS", "idx_timer_schedules_tenant_due", ("", 100)),
            (
                "SCHEDULED_FOR_TENANT",
                "idx_timer_schedules_tenant_due",
                ("tenant-1", "", _NOW, "", "", 50),
            ),
            ("FIND_BY_CORRELATION_ID", "idx_timer_schedules_correlation_id", ("trace-1", 50)),
            (
                "SCAN_TENANT",
                "sqlite_autoindex_timer_schedules_1",
                ("tenant-1", "", 100, "Reached", "", "~", 50),
            ),
            ("SCAN_TENANT_WINDOW", "sqlite_autoindex_timer_schedules_1", ("tenant-1", "", 100)),
        ],
    )
    def test_census_statement_seeks_its_index(
        self, planner: sqlite3.Connection, name: str, index: str, params: tuple[Any, ...]
    ) -> None:
        """Each census and look-up statement searches its index and scans no table."""
        details = plan(planner, getattr(census, name), params)
        assert any(
            f"SEARCH timer_schedules USING INDEX {index}" in d
            or f"SEARCH timer_schedules USING COVERING INDEX {index}" in d
            for d in details
        ), details
        assert not any(d.startswith("SCAN timer_") for d in details), details
