"""Scheduling inside the host's own SQLAlchemy transaction on the store's SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.transactional import CALL, T0, A, TransactionalSchedulingTests
from timer_adapters_sqlite import SqliteTimerStore, schedule_in_transaction
from timer_core import ScheduleTimer, StoreError


class TestSqliteTransactionalScheduling(TransactionalSchedulingTests):
    """The shared promises on SQLite: wake-ups come from the store's data_version watch."""

    package = "timer_adapters_sqlite"

    @pytest.fixture
    async def store(self, db_path: Path) -> AsyncIterator[SqliteTimerStore]:
        """A started store on the file (so the timer schema is there)."""
        async with SqliteTimerStore(db_path) as store:
            yield store

    @pytest.fixture
    def host_url(self, db_path: Path) -> str:
        """The host's own engine URL for the same file (plain pysqlite settings)."""
        return f"sqlite:///{db_path}"

    @pytest.fixture
    def async_host_url(self, db_path: Path) -> str:
        """The same file through aiosqlite, for a host on SQLAlchemy's asyncio API."""
        return f"sqlite+aiosqlite:///{db_path}"


class TestMisuse:
    async def test_autocommit_connection_is_refused(self, db_path: Path) -> None:
        """The store's own engine runs without driver transactions: refused, nothing written."""
        async with SqliteTimerStore(db_path) as store:
            with store.engine.connect() as connection, pytest.raises(ValueError, match="without"):
                schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
            assert await store.get(A, CALL) is None

    def test_database_without_the_schema_names_the_cure(self, tmp_path: Path) -> None:
        """A file the store never opened gives a StoreError that says how to create it."""
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
        with engine.connect() as connection, pytest.raises(StoreError, match="migrate"):
            schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
        engine.dispose()
