"""Scheduling inside the host's own SQLAlchemy transaction on the store's SQLite file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
import sqlalchemy.orm

from tests.transactional import kill_inside_transaction, waiting_worker
from timer_adapters_sqlite import (
    SqliteTimerStore,
    cancel_in_transaction,
    schedule_in_transaction,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ScheduleTimer,
    ServiceCallId,
    StoreError,
    TenantId,
    TimerState,
)

from .conftest import T0, entry

_ORDERS = "CREATE TABLE orders (id TEXT PRIMARY KEY)"
A, CALL = TenantId("shop-1"), ServiceCallId("order-17")


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteTimerStore]:
    """A started store on the file (so the timer schema is there)."""
    async with SqliteTimerStore(db_path) as store:
        yield store


@pytest.fixture
def host_engine(db_path: Path, store: SqliteTimerStore) -> Iterator[sa.Engine]:
    """The host's own engine on the same file, with its own orders table."""
    engine = sa.create_engine(f"sqlite:///{db_path}")
    with engine.begin() as connection:
        connection.exec_driver_sql(_ORDERS)
    try:
        yield engine
    finally:
        engine.dispose()


def order_rows(engine: sa.Engine) -> int:
    """How many orders the host's table holds."""
    with engine.connect() as connection:
        return int(connection.exec_driver_sql("SELECT count(*) FROM orders").scalar_one())


def place_order(engine: sa.Engine, *, commit: bool, due_at: datetime = T0) -> CommandOutcome:
    """The host's transaction: an order row and its payment timeout, committed or not."""
    with engine.connect() as connection:
        connection.exec_driver_sql("INSERT INTO orders VALUES ('order-17')")
        outcome = schedule_in_transaction(
            connection, ScheduleTimer(A, CALL, due_at), now=T0, correlation_id="req-1"
        )
        if commit:
            connection.commit()
        else:
            connection.rollback()
    return outcome


class TestScheduleInTransaction:
    async def test_commit_stores_the_timer_with_the_hosts_row(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """A committed transaction holds both the host's row and the timer."""
        assert place_order(host_engine, commit=True) is CommandOutcome.SCHEDULED
        stored = await store.get(A, CALL)
        assert stored is not None
        assert stored.state is TimerState.SCHEDULED
        assert stored.due_at == T0
        assert stored.registered_at == T0
        assert stored.correlation_id == "req-1"
        assert order_rows(host_engine) == 1

    async def test_rollback_leaves_no_timer(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """A rolled back transaction leaves neither the host's row nor the timer."""
        place_order(host_engine, commit=False)
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0

    async def test_an_exception_in_engine_begin_leaves_no_timer(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """``with engine.begin()`` left by an exception rolls the timer back with the rest."""

        def fail_after_scheduling() -> None:
            with host_engine.begin() as connection:
                schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
                raise RuntimeError("payment provider down")

        with pytest.raises(RuntimeError):
            fail_after_scheduling()
        assert await store.get(A, CALL) is None

    async def test_commit_wakes_the_running_worker(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """A worker polling every ten minutes fires the committed timer within seconds."""
        async with waiting_worker(store) as bus:
            due = datetime.now(UTC)
            await asyncio.to_thread(place_order, host_engine, commit=True, due_at=due)
            (event,) = await asyncio.wait_for(bus.wait_for_published(1), 10)
        assert event.payload.service_call_id == CALL
        assert event.payload.reached_at >= due

    async def test_host_killed_inside_the_transaction_leaves_no_timer(
        self, store: SqliteTimerStore, host_engine: sa.Engine, db_path: Path
    ) -> None:
        """A host process SIGKILLed between scheduling and commit leaves no timer, no lock."""
        kill_inside_transaction(
            f"""
            import sqlalchemy as sa
            from datetime import datetime, UTC
            from timer_adapters_sqlite import schedule_in_transaction
            from timer_core import ScheduleTimer
            engine = sa.create_engine("sqlite:///{db_path}")
            connection = engine.connect()
            connection.exec_driver_sql("INSERT INTO orders VALUES ('order-17')")
            now = datetime(2030, 1, 1, tzinfo=UTC)
            schedule_in_transaction(connection, ScheduleTimer("shop-1", "order-17", now), now=now)
            """
        )
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0
        # The dead process's write lock is gone: the store writes at once.
        assert await store.schedule(entry("shop-1", "order-17")) is CommandOutcome.SCHEDULED

    async def test_a_session_schedules_in_its_transaction(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """An ORM Session works too: the timer commits with the session."""
        with sqlalchemy.orm.Session(host_engine) as session:
            session.execute(sa.text("INSERT INTO orders VALUES ('order-17')"))
            schedule_in_transaction(session, ScheduleTimer(A, CALL, T0), now=T0)
            assert await store.get(A, CALL) is None  # not committed yet
            session.commit()
        assert await store.get(A, CALL) is not None


class TestCancelInTransaction:
    async def test_cancel_commits_or_rolls_back_with_the_transaction(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """A cancel rolled back keeps the timer; a cancel committed removes it."""
        await store.schedule(entry("shop-1", "order-17", due_in=60))
        with host_engine.connect() as connection:
            assert cancel_in_transaction(connection, CancelTimer(A, CALL)) is (
                CommandOutcome.CANCELLED
            )
            connection.rollback()
        assert await store.get(A, CALL) is not None
        with host_engine.begin() as connection:
            cancel_in_transaction(connection, CancelTimer(A, CALL))
        assert await store.get(A, CALL) is None

    async def test_cancel_of_unknown_timer_is_a_noop(
        self, store: SqliteTimerStore, host_engine: sa.Engine
    ) -> None:
        """Cancelling a timer that does not exist says so and changes nothing."""
        with host_engine.begin() as connection:
            outcome = cancel_in_transaction(connection, CancelTimer(A, CALL))
        assert outcome is CommandOutcome.CANCEL_NOOP


class TestMisuse:
    async def test_autocommit_connection_is_refused(self, store: SqliteTimerStore) -> None:
        """The store's own engine runs without driver transactions: refused, nothing written."""
        with store.engine.connect() as connection, pytest.raises(ValueError, match="without"):
            schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
        assert await store.get(A, CALL) is None

    def test_database_without_the_schema_names_the_cure(self, tmp_path: Path) -> None:
        """A file the store never opened gives a StoreError that says how to create it."""
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
        with engine.connect() as connection, pytest.raises(StoreError, match="migrate"):
            schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
        engine.dispose()
