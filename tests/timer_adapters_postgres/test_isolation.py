"""PostgreSQL bound to the shipped isolation suite (issue 42), on a real server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timer_adapters_postgres import PostgresTimerStore
from timer_core import TimerStore
from timer_core.testing import LeasingIsolationContract, TimerIsolationContract


class TestPostgresIsolation(TimerIsolationContract):
    """A Timer on PostgreSQL keeps one timer's and one tenant's trouble their own."""

    @pytest.fixture
    def make_store(self, postgres_url: str) -> Callable[[], TimerStore]:
        return lambda: PostgresTimerStore(postgres_url, pool_size=3)


class TestPostgresLeasingIsolation(LeasingIsolationContract):
    """Instances on one database give back the claims of the timers they hold back."""

    @pytest.fixture
    def make_store(self, postgres_url: str) -> Callable[[], TimerStore]:
        return lambda: PostgresTimerStore(postgres_url, pool_size=3, lease_s=300.0)
