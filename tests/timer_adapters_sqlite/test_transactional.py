"""Scheduling inside the host's own SQLAlchemy transaction on the store's SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.timer_adapters_sqlite.conftest import entry
from tests.transactional import CALL, T0, A, TransactionalSchedulingTests
from timer_adapters_sqlite import SqliteTimerStore, schedule_in_transaction
from timer_adapters_sqlite._in_transaction import _HostCursor
from timer_adapters_sqlite._writes import batch_of, write_batches
from timer_core import (
    CommandOutcome,
    PositionedOperation,
    ScheduleTimer,
    StoreError,
    TimerKey,
)


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


class TestHostCursor:
    async def test_a_run_of_positioned_cancels_goes_through_a_host_connection(
        self, db_path: Path
    ) -> None:
        """write_batches takes every kind of batch through a host's connection, positioned
        cancels too (their keys are read with fetchall): both cancelled, tombstones kept."""
        key_1, key_2 = TimerKey(A, CALL), TimerKey(A, "call-2")
        async with SqliteTimerStore(db_path) as store:
            await store.apply([entry(A, CALL, due_in=60), entry(A, "call-2", due_in=60)])
            engine = sa.create_engine(f"sqlite:///{db_path}")
            try:
                with engine.begin() as connection:
                    cancels = [PositionedOperation(key_1, 7, T0), PositionedOperation(key_2, 8, T0)]
                    outcomes = write_batches(_HostCursor(connection), [batch_of(cancels)])
                with engine.connect() as connection:
                    tombstones = connection.exec_driver_sql(
                        "SELECT service_call_id, command_position FROM timer_tombstones"
                        " ORDER BY command_position"
                    ).all()
            finally:
                engine.dispose()
            assert outcomes == [CommandOutcome.CANCELLED, CommandOutcome.CANCELLED]
            assert await store.get(A, CALL) is None and await store.get(A, "call-2") is None
        assert [tuple(row) for row in tombstones] == [(CALL, 7), ("call-2", 8)]
