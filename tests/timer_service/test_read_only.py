"""Read-only subcommands (``inspect``, ``dlq list``) never create, migrate or change anything:
they say clearly what is missing instead."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import nats
import psycopg
import pytest
import sqlalchemy as sa

from timer_adapters_nats.embedded import NatsServerProcess
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import SchemaNotFound
from timer_service.cli import EXIT_CONFIG, main


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return sorted(name for (name,) in rows)


class TestInspectOnSqlite:
    def test_a_missing_file_is_not_created(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`inspect` on a path with no database says so and leaves no file behind."""
        path = tmp_path / "absent.db"
        assert main(["inspect", "tenant-a", "--db-path", str(path)]) == EXIT_CONFIG
        error = capsys.readouterr().err
        assert f"TIMER_DB_PATH={path}: no Timer schema in {path}" in error
        assert "run the service first" in error
        assert sorted(p.name for p in tmp_path.iterdir()) == []

    def test_a_database_without_the_schema_is_not_migrated(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`inspect` on an SQLite file that is not Timer's creates no table in it."""
        path = tmp_path / "other.db"
        with sqlite3.connect(path) as connection:
            connection.execute("CREATE TABLE host_data (x INTEGER)")
        connection.close()
        before = path.read_bytes()
        assert main(["inspect", "tenant-a", "--db-path", str(path)]) == EXIT_CONFIG
        assert "no Timer schema in" in capsys.readouterr().err
        assert _tables(path) == ["host_data"]
        assert path.read_bytes() == before

    def test_an_empty_file_stays_empty(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`inspect` on a zero-byte file reports no schema and writes nothing into it."""
        path = tmp_path / "empty.db"
        path.touch()
        assert main(["inspect", "tenant-a", "--db-path", str(path)]) == EXIT_CONFIG
        assert "no Timer schema in" in capsys.readouterr().err
        assert path.stat().st_size == 0

    async def test_a_timer_database_is_read(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """On a database the service created, `inspect` reads it (exit 1: no timers)."""
        path = tmp_path / "timer.db"
        async with SqliteTimerStore(path):
            pass
        code = await asyncio.to_thread(
            main, ["inspect", "tenant-a", "--db-path", str(path), "--json"]
        )
        assert code == 0
        assert capsys.readouterr().out.strip() == "[]"

    async def test_the_store_refuses_without_creating(self, tmp_path: Path) -> None:
        """`SqliteTimerStore(migrate=False)` raises SchemaNotFound and creates no file."""
        path = tmp_path / "absent.db"
        with pytest.raises(SchemaNotFound, match="no such database file"):
            await SqliteTimerStore(path, migrate=False).start()
        assert not path.exists()


class TestInspectOnPostgres:
    def test_an_empty_database_gets_no_schema(
        self, fresh_postgres_url: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`inspect` against an empty PostgreSQL database says so and creates no table."""
        code = main(["inspect", "tenant-a", "--database-url", fresh_postgres_url])
        assert code == EXIT_CONFIG
        error = capsys.readouterr().err
        assert "TIMER_DATABASE_URL: no Timer schema in postgresql" in error
        assert "run the service first" in error
        conninfo = sa.make_url(fresh_postgres_url).set(drivername="postgresql")
        with psycopg.connect(conninfo.render_as_string(hide_password=False)) as connection:
            tables = connection.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
            ).fetchone()
        assert tables == (0,)


class TestDeadLetterListing:
    async def test_dlq_list_creates_no_stream(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`dlq list` against a broker the service never provisioned creates no stream."""
        server = NatsServerProcess(tmp_path / "nats", host="127.0.0.1", port=0)
        await asyncio.to_thread(server.start)
        try:
            await asyncio.to_thread(
                main, ["dlq", "list", "--broker-url", server.url, "--db-path", "x.db"]
            )
            nc = await nats.connect(server.url)
            try:
                streams = await nc.jetstream().streams_info()
            finally:
                await nc.close()
        finally:
            await asyncio.to_thread(server.stop)
        assert streams == []
