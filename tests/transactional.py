"""The transactional-scheduling tests both SQL stores pass: a host's own SQLAlchemy transaction
schedules or cancels a timer, which exists if and only if that transaction commits.

A store's test module subclasses :class:`TransactionalSchedulingTests`, names its adapter
``package`` and provides the ``store`` fixture (started, schema migrated) and the
``host_url`` and ``async_host_url`` fixtures (the SQLAlchemy URLs of the same database, for
the host's engine and for a host on SQLAlchemy's asyncio API).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
import sqlalchemy.orm
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from timer_adapters_memory import MemoryEventBus
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ScheduleTimer,
    ServiceCallId,
    SystemClock,
    TenantId,
    TimerEntry,
    TimerState,
    TimerStore,
    TimerWorker,
)

# Far longer than any test waits: a timer fired within a test was fired by a wake-up.
NEVER_POLL_S = 600.0
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
A, CALL = TenantId("shop-1"), ServiceCallId("order-17")


@contextlib.asynccontextmanager
async def waiting_worker(store: TimerStore) -> AsyncIterator[MemoryEventBus]:
    """A running worker on ``store``, asleep after its first pass, woken only through the
    store's ``watch_remote_schedules``; yields the bus it publishes to."""
    bus = MemoryEventBus()
    worker = TimerWorker(store, bus, SystemClock(), polling_interval=NEVER_POLL_S)
    assert store.watch_remote_schedules(worker.notify_scheduled)
    running = asyncio.create_task(worker.run())
    try:
        while worker.passes < 1:  # the first pass is done: from now on it sleeps
            await asyncio.sleep(0.01)
        yield bus
    finally:
        worker.stop()
        await running


def kill_inside_transaction(code: str) -> None:
    """Run ``code`` (which makes its writes and leaves them uncommitted) in a new Python
    process and SIGKILL it once it says so."""
    script = textwrap.dedent(code) + "\nimport sys, time\nprint('in transaction', flush=True)\n"
    script += "time.sleep(600)\n"
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() != "in transaction":
            _, errors = process.communicate(timeout=30)
            raise AssertionError(f"the host process failed before killing it: {errors}")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL


def order_rows(engine: sa.Engine) -> int:
    """How many orders the host's table holds."""
    with engine.connect() as connection:
        return int(connection.exec_driver_sql("SELECT count(*) FROM orders").scalar_one())


class TransactionalSchedulingTests:
    """What ``schedule_in_transaction`` and ``cancel_in_transaction`` promise, on a real
    database with a running store."""

    package: ClassVar[str]
    """The adapter package holding the two functions, e.g. ``timer_adapters_sqlite``."""

    @property
    def schedule_in_transaction(self) -> Callable[..., CommandOutcome]:
        return importlib.import_module(self.package).schedule_in_transaction

    @property
    def cancel_in_transaction(self) -> Callable[..., CommandOutcome]:
        return importlib.import_module(self.package).cancel_in_transaction

    @pytest.fixture
    def host_engine(self, host_url: str, store: TimerStore) -> Iterator[sa.Engine]:
        """The host's own engine on the store's database, with its own orders table."""
        engine = sa.create_engine(host_url, poolclass=sa.NullPool)
        with engine.begin() as connection:
            connection.exec_driver_sql("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        try:
            yield engine
        finally:
            engine.dispose()

    def place_order(self, engine: sa.Engine, *, commit: bool, due_at: datetime = T0) -> Any:
        """The host's transaction: an order row and its payment timeout, committed or not."""
        with engine.connect() as connection:
            connection.exec_driver_sql("INSERT INTO orders VALUES ('order-17')")
            outcome = self.schedule_in_transaction(
                connection, ScheduleTimer(A, CALL, due_at), now=T0, correlation_id="req-1"
            )
            if commit:
                connection.commit()
            else:
                connection.rollback()
        return outcome

    async def test_commit_stores_the_timer_with_the_hosts_row(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """A committed transaction holds both the host's row and the timer."""
        assert self.place_order(host_engine, commit=True) is CommandOutcome.SCHEDULED
        stored = await store.get(A, CALL)
        assert stored is not None
        assert stored.state is TimerState.SCHEDULED
        assert (stored.due_at, stored.registered_at, stored.correlation_id) == (T0, T0, "req-1")
        assert order_rows(host_engine) == 1

    async def test_rollback_leaves_no_timer(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """A rolled back transaction leaves neither the host's row nor the timer."""
        self.place_order(host_engine, commit=False)
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0

    async def test_an_exception_in_engine_begin_leaves_no_timer(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """``with engine.begin()`` left by an exception rolls the timer back with the rest."""

        def fail_after_scheduling() -> None:
            with host_engine.begin() as connection:
                self.schedule_in_transaction(connection, ScheduleTimer(A, CALL, T0), now=T0)
                raise RuntimeError("payment provider down")

        with pytest.raises(RuntimeError):
            fail_after_scheduling()
        assert await store.get(A, CALL) is None

    async def test_commit_wakes_the_running_worker(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """A worker polling every ten minutes fires the committed timer within seconds."""
        async with waiting_worker(store) as bus:
            due = datetime.now(UTC)
            await asyncio.to_thread(self.place_order, host_engine, commit=True, due_at=due)
            (event,) = await asyncio.wait_for(bus.wait_for_published(1), 10)
        assert event.payload.service_call_id == CALL
        assert event.payload.reached_at >= due

    async def test_host_killed_inside_the_transaction_leaves_no_timer(
        self, store: TimerStore, host_engine: sa.Engine, host_url: str
    ) -> None:
        """A host process SIGKILLed between scheduling and commit leaves no timer, no lock."""
        kill_inside_transaction(
            f"""
            import sqlalchemy as sa
            from datetime import datetime, UTC
            from {self.package} import schedule_in_transaction
            from timer_core import ScheduleTimer
            engine = sa.create_engine({host_url!r})
            connection = engine.connect()
            connection.exec_driver_sql("INSERT INTO orders VALUES ('order-17')")
            now = datetime(2030, 1, 1, tzinfo=UTC)
            schedule_in_transaction(connection, ScheduleTimer("shop-1", "order-17", now), now=now)
            """
        )
        assert await store.get(A, CALL) is None
        assert order_rows(host_engine) == 0
        # The dead process's lock is gone: the store writes the same timer at once.
        outcome = await asyncio.wait_for(store.schedule(TimerEntry(A, CALL, T0, T0)), 20)
        assert outcome is CommandOutcome.SCHEDULED

    async def test_a_session_schedules_in_its_transaction(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """An ORM Session works too: the timer commits with the session."""
        with sqlalchemy.orm.Session(host_engine) as session:
            session.execute(sa.text("INSERT INTO orders VALUES ('order-17')"))
            self.schedule_in_transaction(session, ScheduleTimer(A, CALL, T0), now=T0)
            assert await store.get(A, CALL) is None  # not committed yet
            session.commit()
        assert await store.get(A, CALL) is not None

    async def test_reached_timer_is_not_rearmed(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """Scheduling a timer that already fired changes nothing, as a command would."""
        timer = TimerEntry(A, CALL, T0, T0)
        await store.schedule(timer)
        await store.mark_reached([timer.reach(T0)])
        assert self.place_order(host_engine, commit=True) is CommandOutcome.IGNORED_REACHED
        stored = await store.get(A, CALL)
        assert stored is not None and stored.state is TimerState.REACHED

    async def test_cancel_commits_or_rolls_back_with_the_transaction(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """A cancel rolled back keeps the timer; a cancel committed removes it."""
        await store.schedule(TimerEntry(A, CALL, T0, T0))
        with host_engine.connect() as connection:
            outcome = self.cancel_in_transaction(connection, CancelTimer(A, CALL))
            connection.rollback()
        assert outcome is CommandOutcome.CANCELLED
        assert await store.get(A, CALL) is not None
        with host_engine.begin() as connection:
            self.cancel_in_transaction(connection, CancelTimer(A, CALL))
        assert await store.get(A, CALL) is None

    async def test_cancel_of_unknown_timer_is_a_noop(
        self, store: TimerStore, host_engine: sa.Engine
    ) -> None:
        """Cancelling a timer that does not exist says so and changes nothing."""
        with host_engine.begin() as connection:
            outcome = self.cancel_in_transaction(connection, CancelTimer(A, CALL))
        assert outcome is CommandOutcome.CANCEL_NOOP

    async def test_an_async_host_schedules_through_run_sync(
        self, store: TimerStore, host_engine: sa.Engine, async_host_url: str
    ) -> None:
        """A host on SQLAlchemy's asyncio API calls the functions through ``run_sync``: the
        timer commits with its AsyncConnection, and a cancel in a rolled back AsyncSession
        changes nothing."""
        engine = create_async_engine(async_host_url, poolclass=sa.NullPool)
        try:
            async with engine.begin() as connection:
                await connection.execute(sa.text("INSERT INTO orders VALUES ('order-17')"))
                outcome = await connection.run_sync(
                    self.schedule_in_transaction, ScheduleTimer(A, CALL, T0), now=T0
                )
            async with AsyncSession(engine) as session:
                cancelled = await session.run_sync(self.cancel_in_transaction, CancelTimer(A, CALL))
                await session.rollback()
        finally:
            await engine.dispose()
        assert (outcome, cancelled) == (CommandOutcome.SCHEDULED, CommandOutcome.CANCELLED)
        assert await store.get(A, CALL) is not None
        assert order_rows(host_engine) == 1
