"""``SqliteTimerClient``: synchronous scheduling on the store's file with no broker, each call
a transaction of its own, seen and fired by a running ``Timer`` on the same file."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.sync_clients import SyncClientContract
from timer_adapters_sqlite import SqliteTimerClient, SqliteTimerStore
from timer_core import StoreUnavailable, TimerStore


class TestSqliteTimerClient(SyncClientContract):
    @pytest.fixture
    def location(self, tmp_path: Path) -> str:
        return str(tmp_path / "timers.db")

    def open_client(self, location: str) -> SqliteTimerClient:
        return SqliteTimerClient.open(location)

    def store(self, location: str) -> TimerStore:
        return SqliteTimerStore(location)

    def test_a_locked_file_is_waited_for_then_reported(self, tmp_path: Path) -> None:
        """While another connection holds the write lock past ``busy_timeout_ms`` the call
        raises StoreUnavailable, and writes once the lock is gone."""
        import sqlite3

        path = tmp_path / "timers.db"
        with SqliteTimerClient.open(path, busy_timeout_ms=100) as client:
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            due = datetime.now(UTC) + timedelta(hours=1)
            with pytest.raises(StoreUnavailable):
                client.schedule("shop", "order-1", due)
            holder.execute("ROLLBACK")
            holder.close()
            assert client.schedule("shop", "order-1", due).value == "scheduled"

    def test_threads_share_one_client(self, tmp_path: Path) -> None:
        """Eight threads scheduling through one client at once all succeed."""
        path = tmp_path / "timers.db"
        due = datetime.now(UTC) + timedelta(hours=1)
        with SqliteTimerClient.open(path) as client:
            errors: list[BaseException] = []

            def work(n: int) -> None:
                try:
                    for i in range(20):
                        client.schedule("shop", f"t{n}-{i}", due)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert errors == []

        async def count() -> int:
            async with SqliteTimerStore(path) as store:
                return len(await store.list_for_tenant("shop"))

        assert asyncio.run(count()) == 160
