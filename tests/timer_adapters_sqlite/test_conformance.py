"""SqliteTimerStore bound to the shipped TimerStore conformance suite, on a file database."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TimerStore
from timer_core.testing import FindsDueByTenantContract, TimerCensusContract, TimerStoreContract


class TestSqliteStoreContract(TimerStoreContract, FindsDueByTenantContract):
    """SqliteTimerStore (standalone, a file in a temporary directory) keeps the port's promises."""

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Callable[[], TimerStore]:
        return lambda: SqliteTimerStore(tmp_path / "timer.db")


class TestSqliteCensusContract(TimerCensusContract):
    """SqliteTimerStore keeps the promises of the census and look-up capabilities."""

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Callable[[], TimerStore]:
        return lambda: SqliteTimerStore(tmp_path / "timer.db")
