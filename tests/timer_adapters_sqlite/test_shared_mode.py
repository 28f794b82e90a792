"""Shared mode: the timer table lives in the host's database and follows its service calls."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from timer_adapters_sqlite import SqliteTimerStore, timer_schedules_table
from timer_core import CommandOutcome, StoreError, StoreUnavailable

from .conftest import entry

_SERVICE_CALLS = (
    "CREATE TABLE service_calls (tenant_id TEXT NOT NULL, service_call_id TEXT NOT NULL, "
    "PRIMARY KEY (tenant_id, service_call_id))"
)


def _add_service_calls(connection: sqlite3.Connection, *calls: str) -> None:
    connection.executemany(
        "INSERT INTO service_calls VALUES ('tenant-a', ?)", [(call,) for call in calls]
    )


@pytest.fixture
async def shared(db_path: Path, raw: sqlite3.Connection) -> AsyncIterator[SqliteTimerStore]:
    """A started shared-mode store in a host database that already has service_calls."""
    # SQLite enforces foreign keys per connection: the host's connections opt in too.
    raw.execute("PRAGMA foreign_keys = ON")
    raw.execute(_SERVICE_CALLS)
    store = SqliteTimerStore(db_path, mode="shared")
    await store.start()
    try:
        yield store
    finally:
        await store.aclose()


class TestSharedMode:
    async def test_deleting_a_service_call_deletes_its_timer(
        self, shared: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """The seed's FK test: ON DELETE CASCADE removes the timer with its service call."""
        _add_service_calls(raw, "call-1", "call-2")
        await shared.apply([entry(call="call-1"), entry(call="call-2")])
        raw.execute(
            "DELETE FROM service_calls WHERE tenant_id = 'tenant-a' AND service_call_id = 'call-1'"
        )
        count = raw.execute(
            "SELECT count(*) FROM timer_schedules WHERE service_call_id = 'call-1'"
        ).fetchone()
        assert count == (0,)
        assert await shared.get("tenant-a", "call-1") is None  # type: ignore[arg-type]
        assert await shared.get("tenant-a", "call-2") is not None  # type: ignore[arg-type]

    async def test_timer_without_service_call_is_refused(self, shared: SqliteTimerStore) -> None:
        """Scheduling for an unknown service call raises StoreError (not transient)."""
        with pytest.raises(StoreError, match="FOREIGN KEY") as refused:
            await shared.schedule(entry(call="ghost"))
        assert not isinstance(refused.value, StoreUnavailable)
        assert await shared.count_scheduled() == 0

    async def test_a_refused_caller_does_not_fail_its_group(
        self, shared: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """In a group commit, only the caller whose timer has no service call fails."""
        calls = [f"call-{i}" for i in range(40)]
        _add_service_calls(raw, *calls)
        results = await asyncio.gather(
            *(shared.schedule(entry(call=c)) for c in [*calls[:20], "ghost", *calls[20:]]),
            return_exceptions=True,
        )
        assert isinstance(results[20], StoreError)
        assert results[:20] + results[21:] == [CommandOutcome.SCHEDULED] * 40
        assert await shared.count_scheduled() == 40

    async def test_host_metadata_builds_a_shared_table(self, db_path: Path) -> None:
        """A host that creates the table from its own metadata gets the cascading FK too."""
        host = sa.MetaData()
        sa.Table(
            "service_calls",
            host,
            sa.Column("tenant_id", sa.Text, primary_key=True),
            sa.Column("service_call_id", sa.Text, primary_key=True),
        )
        timer_schedules_table(host, mode="shared")
        engine = sa.create_engine(f"sqlite:///{db_path}")
        try:
            host.create_all(engine)
        finally:
            engine.dispose()
        async with SqliteTimerStore(db_path, mode="shared") as store:
            with store.engine.begin() as connection:
                connection.exec_driver_sql(
                    "INSERT INTO service_calls VALUES ('tenant-a', 'call-1')"
                )
            await store.schedule(entry())
            with store.engine.begin() as connection:
                connection.exec_driver_sql("DELETE FROM service_calls")
            assert await store.count_scheduled() == 0

    async def test_shared_database_refuses_standalone_mode(
        self, shared: SqliteTimerStore, db_path: Path
    ) -> None:
        """Opening the host's table in standalone mode is refused with a clear error."""
        with pytest.raises(StoreError, match="shared mode"):
            await SqliteTimerStore(db_path).start()
