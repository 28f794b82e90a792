"""Fixtures for the SQLite store tests: a database file in a fresh temporary directory."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from timer_adapters_sqlite import MIGRATIONS, SqliteTimerStore
from timer_core import TimerEntry

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
"""A fixed instant tests schedule around (adapters never read the clock)."""


def entry(
    tenant: str = "tenant-a",
    call: str = "call-1",
    *,
    due_in: float = 0.0,
    correlation: str | None = None,
) -> TimerEntry:
    """A ``Scheduled`` timer due ``due_in`` seconds after :data:`T0`, registered at T0."""
    return TimerEntry(
        tenant_id=tenant,
        service_call_id=call,
        due_at=T0 + timedelta(seconds=due_in),
        registered_at=T0,
        correlation_id=correlation,
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """Where the test's database file lives."""
    return tmp_path / "timer.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteTimerStore]:
    """A started standalone store on :func:`db_path`, closed at teardown."""
    timer_store = SqliteTimerStore(db_path)
    await timer_store.start()
    try:
        yield timer_store
    finally:
        await timer_store.aclose()


@pytest.fixture
def raw(db_path: Path) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection to the same file, in autocommit mode, for inspection."""
    connection = sqlite3.connect(db_path, isolation_level=None)
    try:
        yield connection
    finally:
        connection.close()


def migrate_to(connection: sqlite3.Connection, version: int) -> None:
    """Build the standalone schema exactly as version ``version`` left it (older databases
    for the migration tests), on an autocommit connection to an empty file."""
    connection.execute(
        "CREATE TABLE timer_schema_version (version INTEGER PRIMARY KEY, "
        "description TEXT NOT NULL) STRICT"
    )
    for migration in MIGRATIONS[:version]:
        for statement in migration.statements("standalone"):
            connection.execute(statement)
        for table, column, declaration in migration.columns:
            connection.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
        connection.execute(
            "INSERT INTO timer_schema_version VALUES (?, ?)",
            (migration.version, migration.description),
        )
