"""``PostgresTimerClient``: synchronous scheduling on the stores' database with no broker, each
call a transaction of its own, seen (``NOTIFY``) and fired by a running ``Timer``."""

from __future__ import annotations

import pytest

from tests.sync_clients import SyncClientContract
from timer_adapters_postgres import PostgresTimerClient, PostgresTimerStore
from timer_core import StoreUnavailable, TimerStore


class TestPostgresTimerClient(SyncClientContract):
    @pytest.fixture
    def location(self, postgres_url: str) -> str:
        return postgres_url

    def open_client(self, location: str) -> PostgresTimerClient:
        return PostgresTimerClient.open(location)

    def store(self, location: str) -> TimerStore:
        return PostgresTimerStore(location, pool_size=2)

    def test_a_database_nobody_answers_at_is_reported(self) -> None:
        """A URL whose server does not answer raises StoreUnavailable when opened."""
        from tests.timer_service.process import free_port

        url = f"postgresql://nobody@127.0.0.1:{free_port()}/nothing"
        with pytest.raises(StoreUnavailable):
            PostgresTimerClient.open(url, connect_timeout_s=1)

    def test_a_url_that_is_not_postgresql_is_refused(self) -> None:
        """A SQLite URL is refused when the client is made, saying what URL it wants."""
        with pytest.raises(ValueError, match="postgresql://"):
            PostgresTimerClient.open("sqlite:///timers.db")
