"""Scheduling inside the host's own SQLAlchemy transaction on the stores' PostgreSQL database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
import sqlalchemy.orm

from tests.transactional import kill_inside_transaction, waiting_worker
from timer_adapters_postgres import (
    PostgresTimerStore,
    cancel_in_transaction,
    schedule_in_transaction,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TimerState,
)

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
A, CALL = TenantId("shop-1"), ServiceCallId("order-17")


@pytest.fixture
async def store(fresh_postgres_url: str) -> AsyncIterator[PostgresTimerStore]:
    """A started, listening store on a database of the test's own (schema migrated)."""
    async with PostgresTimerStore(fresh_postgres_url, pool_size=2) as store:
        yield store


@pytest.fixture
def host_engine(fresh_postgres_url: str, store: PostgresTimerStore) -> Iterator[sa.Engine]:
    """The host's own engine on the same database, with its own orders table."""
    engine = sa.create_engine(fresh_postgres_url, poolclass=sa.NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE orders (id text PRIMARY KEY)")
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
        self, store: PostgresTimerStore, host_engine: sa.Engine
    ) -> None:
        """A committed transaction holds both the host's row and the timer."""
        assert place_order(host_engine, commit=True) is CommandOutcome.SCHEDULED
        stored = await store.get(A, CALL)
        assert stored is not None
        assert stored.state is TimerState.SCHEDULED
        assert (stored.due_at, stored.registered_at, stored.correlation_id) == (T0, T0, "req-1")
        assert order_rows(host_engine) == 1

    async def test_rollback_leaves_no_timer(
        self, store: PostgresTimerStore, host_engine: sa.Engine
    ) -> None:
        """A rolled back transaction leaves neither the host's row nor the timer."""
        place_order(host_engine, commit=False)
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0

    async def test_commit_wakes_the_running_worker(
        self, store: PostgresTimerStore, host_engine: sa.Engine
    ) -> None:
        """A worker polling every ten minutes fires the committed timer within seconds."""
        async with waiting_worker(store) as bus:
            due = datetime.now(UTC)
            await asyncio.to_thread(place_order, host_engine, commit=True, due_at=due)
            (event,) = await asyncio.wait_for(bus.wait_for_published(1), 10)
        assert event.payload.service_call_id == CALL
        assert event.payload.reached_at >= due

    async def test_host_killed_inside_the_transaction_leaves_no_timer(
        self, store: PostgresTimerStore, host_engine: sa.Engine, fresh_postgres_url: str
    ) -> None:
        """A host process SIGKILLed between scheduling and commit leaves no timer, no lock."""
        kill_inside_transaction(
            f"""
            import sqlalchemy as sa
            from datetime import datetime, UTC
            from timer_adapters_postgres import schedule_in_transaction
            from timer_core import ScheduleTimer
            engine = sa.create_engine({fresh_postgres_url!r})
            connection = engine.connect()
            connection.exec_driver_sql("INSERT INTO orders VALUES ('order-17')")
            now = datetime(2030, 1, 1, tzinfo=UTC)
            schedule_in_transaction(connection, ScheduleTimer("shop-1", "order-17", now), now=now)
            """
        )
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0
        # The server ends the dead session's transaction and frees its row lock.
        timer = TimerEntry(A, CALL, T0, T0)
        outcome = await asyncio.wait_for(store.schedule(timer), 20)
        assert outcome is CommandOutcome.SCHEDULED

    async def test_a_session_schedules_in_its_transaction(
        self, store: PostgresTimerStore, host_engine: sa.Engine
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
        self, store: PostgresTimerStore, host_engine: sa.Engine
    ) -> None:
        """A cancel rolled back keeps the timer; a cancel committed removes it."""
        await store.schedule(TimerEntry(A, CALL, T0, T0))
        with host_engine.connect() as connection:
            outcome = cancel_in_transaction(connection, CancelTimer(A, CALL))
            connection.rollback()
        assert outcome is CommandOutcome.CANCELLED
        assert await store.get(A, CALL) is not None
        with host_engine.begin() as connection:
            cancel_in_transaction(connection, CancelTimer(A, CALL))
        assert await store.get(A, CALL) is None

    async def test_reached_timer_is_not_rearmed(
        self, store: PostgresTimerStore, host_engine: sa.Engine
    ) -> None:
        """Scheduling a timer that already fired changes nothing, as a command would."""
        timer = TimerEntry(A, CALL, T0, T0)
        await store.schedule(timer)
        await store.mark_reached([timer.reach(T0)])
        assert place_order(host_engine, commit=True) is CommandOutcome.IGNORED_REACHED
        stored = await store.get(A, CALL)
        assert stored is not None and stored.state is TimerState.REACHED
