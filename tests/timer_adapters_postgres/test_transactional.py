"""Scheduling inside the host's own SQLAlchemy transaction on the stores' PostgreSQL database."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.transactional import TransactionalSchedulingTests
from timer_adapters_postgres import PostgresTimerStore


class TestPostgresTransactionalScheduling(TransactionalSchedulingTests):
    """The shared promises on PostgreSQL: wake-ups come from the NOTIFY sent on commit."""

    package = "timer_adapters_postgres"

    @pytest.fixture
    async def store(self, fresh_postgres_url: str) -> AsyncIterator[PostgresTimerStore]:
        """A started, listening store on a database of the test's own (schema migrated)."""
        async with PostgresTimerStore(fresh_postgres_url, pool_size=2) as store:
            yield store

    @pytest.fixture
    def host_url(self, fresh_postgres_url: str) -> str:
        """The host's own engine URL for the same database."""
        return fresh_postgres_url

    @pytest.fixture
    def async_host_url(self, fresh_postgres_url: str) -> str:
        """The same database through psycopg's asyncio connection."""
        return fresh_postgres_url
