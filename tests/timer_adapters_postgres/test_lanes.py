"""The store's lanes: claims and marks on connections of its own, used from the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from tests.pg import wait_until_blocked
from timer_adapters_postgres import PostgresTimerStore, _sql
from timer_adapters_postgres._lanes import pyformat
from timer_core import StoreUnavailable, TimerEntry

MakeStore = Callable[..., Awaitable[PostgresTimerStore]]

NOW = datetime.now(UTC).replace(microsecond=0)


def due(call: str) -> TimerEntry:
    return TimerEntry(
        tenant_id="tenant-a",
        service_call_id=call,
        due_at=NOW - timedelta(seconds=30),
        registered_at=NOW - timedelta(seconds=60),
    )


def kill_store_connections(sql: psycopg.Connection[Any]) -> None:
    sql.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'timer' AND datname = current_database()"
    )


def scheduled(sql: psycopg.Connection[Any]) -> int:
    row = sql.execute("SELECT count(*) FROM timer_schedules WHERE state = 'Scheduled'").fetchone()
    assert row is not None
    return int(row[0])


class TestStatementsOfTheLanes:
    def test_named_parameters_become_psycopg_ones(self) -> None:
        """``:name`` becomes ``%(name)s``; casts and text that only looks alike stay."""
        statement = sa.text("SELECT CAST(:a AS int), 'x'::text, now() WHERE b = :b_2")
        assert (
            pyformat(statement) == "SELECT CAST(%(a)s AS int), 'x'::text, now() WHERE b = %(b_2)s"
        )

    def test_a_percent_sign_is_refused(self) -> None:
        """psycopg would read it as a placeholder: such a statement is refused up front."""
        with pytest.raises(ValueError, match="'%'"):
            pyformat(sa.text("SELECT 1 WHERE a LIKE 'x%'"))


class TestLanesFailAndRecover:
    async def test_killed_lanes_fail_once_then_reconnect(
        self, postgres_url: str, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A claim and a mark whose connection the server dropped raise StoreUnavailable;
        the next ones reconnect, and nothing was claimed or marked meanwhile."""
        async with PostgresTimerStore(postgres_url, listen=False) as store:
            await store.apply([due("call-0"), due("call-1"), due("call-2")])
            first = await store.find_due(NOW, 1)  # both lanes connected
            assert await store.mark_reached([entry.reach(NOW) for entry in first]) == 1
            kill_store_connections(postgres_sql)
            with pytest.raises(StoreUnavailable, match="claim due timers"):
                await store.find_due(NOW, 10)
            claimed = await store.find_due(NOW, 10)
            assert [e.service_call_id for e in claimed] == ["call-1", "call-2"]
            reached = [entry.reach(NOW) for entry in claimed]
            kill_store_connections(postgres_sql)
            with pytest.raises(StoreUnavailable, match="mark timers reached"):
                await store.mark_reached(reached)
            assert scheduled(postgres_sql) == 2
            assert await store.mark_reached(reached) == 2
            assert scheduled(postgres_sql) == 0

    async def test_a_claim_past_the_statement_timeout_is_unavailable(
        self, postgres_url: str, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """The lanes carry the store's statement_timeout_s like its other connections."""
        async with PostgresTimerStore(postgres_url, listen=False, statement_timeout_s=0.2) as store:
            await store.apply([due("call-1")])
            with postgres_sql.transaction():
                postgres_sql.execute("LOCK TABLE timer_schedules IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(StoreUnavailable, match="statement timeout"):
                    await store.find_due_by_tenant(NOW, 10, after={})
            assert [e.service_call_id for e in await store.find_due(NOW, 10)] == ["call-1"]

    async def test_a_cancelled_claim_runs_to_its_end_and_the_lane_goes_on(
        self, postgres_url: str, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """Cancelling the caller does not cut the exchange with the server short: the claim
        still commits (its timers leased to this store, which may claim them again at once)
        and the next statement on the lane runs normally."""
        async with PostgresTimerStore(postgres_url, listen=False) as store:
            await store.apply([due("call-1")])
            with psycopg.connect(postgres_sql.info.dsn) as other:
                other.execute("LOCK TABLE timer_schedules IN ACCESS EXCLUSIVE MODE")
                claiming = asyncio.create_task(store.find_due(NOW, 10))
                await wait_until_blocked(postgres_sql)
                claiming.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await claiming
                other.commit()
            again = await store.find_due(NOW, 10)
            assert [e.service_call_id for e in again] == ["call-1"]
            row = postgres_sql.execute(
                "SELECT lease_owner, lease_token FROM timer_schedules"
            ).fetchone()
            assert row == (store.owner_id, 2)  # claimed by the cancelled call, then again

    async def test_closed_lanes_are_unavailable(self, postgres_url: str) -> None:
        """After aclose, claims and marks raise StoreUnavailable like every other call."""
        store = PostgresTimerStore(postgres_url, listen=False)
        await store.start()
        await store.apply([due("call-1")])
        claimed = await store.find_due(NOW, 10)
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await store.find_due(NOW, 10)
        with pytest.raises(StoreUnavailable):
            await store.find_due_by_tenant(NOW, 10, after={})
        with pytest.raises(StoreUnavailable):
            await store.mark_reached([entry.reach(NOW) for entry in claimed])


class TestPooledConnections:
    async def test_the_most_recently_used_connection_is_handed_out_first(
        self, make_started_store: MakeStore
    ) -> None:
        """Once the pool holds several connections, calls one after another keep using the
        same one (its server process stays warm) instead of going round all of them."""
        store = await make_started_store(pool_size=3)

        def backend(conn: Any) -> int:
            return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())

        together = threading.Barrier(3, timeout=30)

        def held(conn: Any) -> int:
            pid = backend(conn)
            together.wait()  # all three hold a connection at once
            return pid

        opened = set(await asyncio.gather(*(store._run("hold", held) for _ in range(3))))
        assert len(opened) == 3  # three connections in the pool now
        used = {await store._run("read", backend) for _ in range(6)}
        assert len(used) == 1


class TestClaimsStayOnTheirPage:
    async def test_most_of_a_claim_writes_no_index_entries(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """Timers due together were stored together; claiming a batch of them updates most
        rows of a few pages at once. With half of each page free (schema version 5) most of
        those updates are heap-only (HOT): no new entry in any of the table's four indexes.
        The smallest rows and a long owner name here: 76 of 100 (10 at the former
        fillfactor of 90); rows with correlation ids or trace context do better."""
        store = await make_started_store()
        await store.apply([due(f"call-{n:04d}") for n in range(500)])
        params = {"owner": "owner-with-a-name-as-long-as-the-default-ones", "now": NOW}
        params.update(lease=timedelta(seconds=30), limit=100)
        with postgres_sql.transaction():
            claimed = postgres_sql.execute(_sql.CLAIM_FIRST_SQL, params).fetchall()
            row = postgres_sql.execute(
                "SELECT pg_stat_get_xact_tuples_updated(c.oid),"
                " pg_stat_get_xact_tuples_hot_updated(c.oid)"
                " FROM pg_class AS c WHERE c.relname = 'timer_schedules'"
            ).fetchone()
        assert len(claimed) == 100
        assert row is not None
        updated, hot = row
        assert updated == 100
        assert hot >= 70
