"""Retention on PostgreSQL: a purge goes on from where its last batch ended, and what it
skipped is found by the next one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from timer_adapters_postgres import PostgresTimerStore

MakeStore = Callable[..., Awaitable[PostgresTimerStore]]

NOW = datetime.now(UTC).replace(microsecond=0)


def fired(sql: psycopg.Connection[Any], count: int) -> None:
    """``count`` Reached timers ``fired-0`` ... fired a second apart, the first a day ago."""
    sql.execute(
        "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at, "
        "state, reached_at) SELECT 't', 'fired-' || i, at, at, 'Reached', at FROM ("
        "SELECT i, %s + make_interval(secs => i) AS at FROM generate_series(0, %s) AS i) AS r",
        (NOW - timedelta(days=1), count - 1),
    )


def left(sql: psycopg.Connection[Any]) -> list[str]:
    """The service call ids still stored, in order."""
    rows = sql.execute("SELECT service_call_id FROM timer_schedules ORDER BY reached_at")
    return [call for (call,) in rows.fetchall()]


class TestPurgeCursor:
    async def test_a_purge_goes_on_after_its_last_batch_and_restarts_when_done(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A row another transaction holds is skipped while the purge goes on from where it
        got to; once a batch comes back short, the next purge starts from the oldest and
        deletes it."""
        store = await make_started_store(listen=False)
        fired(postgres_sql, 5)
        with psycopg.connect(postgres_sql.info.dsn, autocommit=False) as holder:
            holder.execute(
                "SELECT 1 FROM timer_schedules WHERE service_call_id = 'fired-0' FOR UPDATE"
            )
            assert await store.purge_reached(NOW, 2) == 2
            assert left(postgres_sql) == ["fired-0", "fired-3", "fired-4"]
            assert await store.purge_reached(NOW, 2) == 2
            assert left(postgres_sql) == ["fired-0"]
            holder.rollback()
        # The cursor is past fired-0 until a batch comes back short.
        assert await store.purge_reached(NOW, 2) == 0
        assert left(postgres_sql) == ["fired-0"]
        assert await store.purge_reached(NOW, 2) == 1
        assert left(postgres_sql) == []

    async def test_the_cutoff_still_bounds_a_resumed_purge(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A purge resumed from its cursor deletes nothing fired after the cutoff."""
        store = await make_started_store(listen=False)
        fired(postgres_sql, 6)
        cutoff = NOW - timedelta(days=1) + timedelta(seconds=3.5)
        assert await store.purge_reached(cutoff, 2) == 2
        assert await store.purge_reached(cutoff, 2) == 2
        assert await store.purge_reached(cutoff, 2) == 0
        assert left(postgres_sql) == ["fired-4", "fired-5"]
