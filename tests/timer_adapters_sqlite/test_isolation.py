"""SQLite bound to the shipped isolation suite (issue 42): a real file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TimerStore
from timer_core.testing import TimerIsolationContract


class TestSqliteIsolation(TimerIsolationContract):
    """A Timer on a SQLite file keeps one timer's and one tenant's trouble their own."""

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Callable[[], TimerStore]:
        return lambda: SqliteTimerStore(tmp_path / "timers.db")
