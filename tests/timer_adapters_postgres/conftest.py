"""PostgreSQL fixtures of the store's tests: one database per test, or a shared one emptied
per test, on the session's throwaway cluster (``postgres_cluster``, see :mod:`tests.pg`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import sqlalchemy as sa

from tests.pg import PostgresCluster
from timer_adapters_postgres import PostgresTimerStore


@pytest.fixture(scope="session")
def _shared_database(postgres_cluster: PostgresCluster) -> str:
    # Creating a database costs 0.1-0.3 s; emptying the table of a shared one, milliseconds.
    name = f"timer_shared_{os.getpid()}"
    postgres_cluster.create_database(name)
    return name


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster, _shared_database: str) -> str:
    """The SQLAlchemy URL of a database whose timer tables (if any) are empty for this test."""
    with psycopg.connect(postgres_cluster.conninfo(_shared_database), autocommit=True) as conn:
        for table in ("timer_schedules", "timer_tombstones", "timer_horizon"):
            if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,):
                conn.execute(f"TRUNCATE {table}")
    return postgres_cluster.url(_shared_database)


@pytest.fixture
def postgres_sql(postgres_url: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """An autocommit psycopg connection to the test's database, to look behind the store."""
    conninfo = sa.make_url(postgres_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as conn:
        yield conn


@pytest_asyncio.fixture
async def make_started_store(postgres_url: str) -> AsyncIterator[Callable[..., Any]]:
    """``await make_started_store(**options)``: a started store on the test's database.

    Every store made is closed at teardown.
    """
    stores: list[PostgresTimerStore] = []

    async def make(**options: Any) -> PostgresTimerStore:
        options.setdefault("pool_size", 3)
        store = PostgresTimerStore(postgres_url, **options)
        stores.append(store)
        await store.start()
        return store

    try:
        yield make
    finally:
        for store in stores:
            await store.aclose()
