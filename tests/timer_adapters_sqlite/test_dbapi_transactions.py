"""Scheduling in a host's transaction on a plain sqlite3 connection (what Django wraps)."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from timer_adapters_sqlite import (
    SqliteTimerStore,
    cancel_in_transaction,
    migrate,
    schedule_in_transaction,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ConfigurationError,
    ScheduleTimer,
    StoreError,
    TimerState,
    ValidationError,
)

NOW = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A SQLite file with the timer schema and a host table of its own."""
    path = tmp_path / "host.db"
    migrate(str(path))
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
    return path


async def stored(path: Path, call: str) -> TimerState | None:
    """The state of the timer of ``call``, read by a store of its own."""
    async with SqliteTimerStore(path) as store:
        entry = await store.get("shop-1", call)
    return None if entry is None else entry.state


class TestPlainSqlite3:
    async def test_the_timer_exists_only_if_the_transaction_commits(self, db: Path) -> None:
        """Committed, the timer is stored with the command's correlation id; rolled back, not."""
        conn = sqlite3.connect(db)
        conn.execute("INSERT INTO orders VALUES ('order-1')")
        command = ScheduleTimer(
            "shop-1", "order-1", NOW + timedelta(minutes=5), correlation_id="r1"
        )
        assert schedule_in_transaction(conn, command, now=NOW) is CommandOutcome.SCHEDULED
        conn.commit()
        conn.execute("INSERT INTO orders VALUES ('order-2')")
        schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-2", NOW), now=NOW)
        conn.rollback()
        conn.close()
        assert await stored(db, "order-1") is TimerState.SCHEDULED
        assert await stored(db, "order-2") is None
        async with SqliteTimerStore(db) as store:
            entry = await store.get("shop-1", "order-1")
        assert entry is not None and entry.correlation_id == "r1"

    async def test_cancel_goes_with_the_transaction(self, db: Path) -> None:
        """A cancel in a committed transaction removes the timer."""
        conn = sqlite3.connect(db)
        schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
        conn.commit()
        outcome = cancel_in_transaction(conn, CancelTimer("shop-1", "order-1"))
        conn.commit()
        conn.close()
        assert outcome is CommandOutcome.CANCELLED
        assert await stored(db, "order-1") is None

    def test_autocommit_without_a_transaction_is_refused(self, db: Path) -> None:
        """isolation_level=None and no BEGIN: refused, as the timer would commit alone."""
        conn = sqlite3.connect(db, isolation_level=None)
        with pytest.raises(ValidationError, match="autocommit"):
            schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
        conn.execute("BEGIN")
        schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
        conn.rollback()
        conn.close()

    def test_a_database_without_the_schema_names_the_fix(self, tmp_path: Path) -> None:
        """No timer table: a StoreError saying to start a store or migrate."""
        conn = sqlite3.connect(tmp_path / "empty.db")
        with pytest.raises(StoreError, match="migrate"):
            schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
        conn.close()

    def test_two_different_correlation_ids_are_refused(self, db: Path) -> None:
        """A correlation id on the command and another beside it: ValidationError."""
        conn = sqlite3.connect(db)
        command = ScheduleTimer("shop-1", "order-1", NOW, correlation_id="a")
        with pytest.raises(ValidationError, match="two correlation ids"):
            schedule_in_transaction(conn, command, now=NOW, correlation_id="b")
        conn.close()

    def test_something_else_than_a_connection_is_a_configuration_error(self) -> None:
        """A string where a connection belongs is refused, naming what is accepted."""
        command = ScheduleTimer("shop-1", "o", NOW)
        with pytest.raises(ConfigurationError, match=r"sqlite3\.Connection"):
            schedule_in_transaction("host.db", command, now=NOW)  # type: ignore[arg-type]
