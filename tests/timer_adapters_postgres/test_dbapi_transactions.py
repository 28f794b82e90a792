"""Scheduling in a host's transaction on a plain psycopg connection (what Django wraps)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from timer_adapters_postgres import (
    PostgresTimerStore,
    cancel_in_transaction,
    schedule_in_transaction,
)
from timer_core import CancelTimer, CommandOutcome, ScheduleTimer, TimerState, ValidationError

NOW = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


def conninfo(url: str) -> str:
    """The libpq conninfo of a SQLAlchemy URL."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class TestPlainPsycopg:
    async def test_the_timer_exists_only_if_the_transaction_commits(
        self, fresh_postgres_url: str
    ) -> None:
        """Committed, the timer is stored and announced; rolled back, nothing is left."""
        async with PostgresTimerStore(fresh_postgres_url, pool_size=2) as store:
            with psycopg.connect(conninfo(fresh_postgres_url)) as conn:
                command = ScheduleTimer(
                    "shop-1", "order-1", NOW + timedelta(minutes=5), correlation_id="r1"
                )
                assert schedule_in_transaction(conn, command, now=NOW) is CommandOutcome.SCHEDULED
                conn.commit()
                schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-2", NOW), now=NOW)
                conn.rollback()
                assert cancel_in_transaction(conn, CancelTimer("shop-1", "order-3")) is (
                    CommandOutcome.CANCEL_NOOP
                )
                conn.rollback()
            kept = await store.get("shop-1", "order-1")
            assert kept is not None and kept.state is TimerState.SCHEDULED
            assert kept.correlation_id == "r1"
            assert await store.get("shop-1", "order-2") is None

    async def test_a_second_schedule_of_the_same_timer_reschedules_it(
        self, fresh_postgres_url: str
    ) -> None:
        """The general write path (an existing row) runs through the caller's cursor too."""
        async with PostgresTimerStore(fresh_postgres_url, pool_size=2) as store:
            with psycopg.connect(conninfo(fresh_postgres_url)) as conn:
                schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
                later = NOW + timedelta(hours=1)
                schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", later), now=NOW)
                conn.commit()
                assert cancel_in_transaction(conn, CancelTimer("shop-1", "order-1")) is (
                    CommandOutcome.CANCELLED
                )
                conn.rollback()
            entry = await store.get("shop-1", "order-1")
            assert entry is not None and entry.due_at == later

    def test_autocommit_is_refused(self, fresh_postgres_url: str) -> None:
        """An autocommit connection would commit the timer alone: refused."""
        conn: psycopg.Connection[Any]
        with (
            psycopg.connect(conninfo(fresh_postgres_url), autocommit=True) as conn,
            pytest.raises(ValidationError, match="autocommit"),
        ):
            schedule_in_transaction(conn, ScheduleTimer("shop-1", "order-1", NOW), now=NOW)
