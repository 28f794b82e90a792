"""PostgresTimerStore bound to the shipped TimerStore conformance suite, on a real server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timer_adapters_postgres import PostgresTimerStore
from timer_core import TimerStore
from timer_core.testing import (
    FindsDueByTenantContract,
    TimerCensusContract,
    TimerStoreContract,
    TimerStoreLeaseContract,
)


class TestPostgresTimerStoreContract(TimerStoreContract, FindsDueByTenantContract):
    """PostgresTimerStore keeps every promise of the TimerStore port."""

    @pytest.fixture
    def make_store(self, postgres_url: str) -> Callable[[], TimerStore]:
        return lambda: PostgresTimerStore(postgres_url, pool_size=3)


class TestPostgresTimerStoreLeaseContract(TimerStoreLeaseContract):
    """Several PostgresTimerStore instances on one database keep the lease promise."""

    @pytest.fixture
    def make_leasing_store(self, postgres_url: str) -> Callable[[float], TimerStore]:
        return lambda lease_s: PostgresTimerStore(postgres_url, pool_size=3, lease_s=lease_s)


class TestPostgresCensusContract(TimerCensusContract):
    """PostgresTimerStore keeps the promises of the census and look-up capabilities."""

    @pytest.fixture
    def make_store(self, postgres_url: str) -> Callable[[], TimerStore]:
        return lambda: PostgresTimerStore(postgres_url, pool_size=3)
