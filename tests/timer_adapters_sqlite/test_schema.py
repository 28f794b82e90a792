"""The timer_schedules schema: migrations, version checks, constraints and the metadata."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import sqlalchemy as sa

from timer_adapters_sqlite import MIGRATIONS, SCHEMA_VERSION, SqliteTimerStore, metadata, migrate
from timer_core import (
    CommandOutcome,
    PositionedOperation,
    SchemaVersionError,
    ServiceCallId,
    StoreError,
    StoreUnavailable,
    TenantId,
    TimerKey,
    TraceContext,
)

from .conftest import entry, migrate_to

_GOOD_TS = "2030-01-01T12:00:00.000Z"
_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _create_from_metadata(path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


def _describe(connection: sqlite3.Connection) -> dict[str, Any]:
    """The parts of the schema SQLite reports, comparable between two databases."""
    return {table: _describe_table(connection, table) for table in _TABLES}


_TABLES = ("timer_schedules", "timer_tombstones")


def _describe_file(path: Path) -> dict[str, Any]:
    """:func:`_describe` of the database file at ``path``."""
    connection = sqlite3.connect(path)
    try:
        return _describe(connection)
    finally:
        connection.close()


def _versions(path: Path) -> list[int]:
    """The schema versions recorded in the database file at ``path``, in order."""
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute("SELECT version FROM timer_schema_version ORDER BY version")
        return [version for (version,) in rows]
    finally:
        connection.close()


def _describe_table(connection: sqlite3.Connection, table: str) -> dict[str, Any]:
    # (name, unique, origin, partial) without the position, which depends on creation order.
    indexes = sorted(row[1:] for row in connection.execute(f"PRAGMA index_list({table})"))
    where = {
        name: re.sub(r"\s+", " ", sql.split(" WHERE ", 1)[1]) if " WHERE " in sql else None
        for name, sql in connection.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
            "AND tbl_name = ?",
            (table,),
        )
    }
    (table_sql,) = connection.execute(
        "SELECT sql FROM sqlite_master WHERE name = ?", (table,)
    ).fetchone()
    return {
        "checks": re.findall(
            r"^\s*CONSTRAINT (ck_\w+)\s+CHECK \s*(.*?),?\s*$", table_sql, re.M | re.S
        ),
        "columns": connection.execute(f"PRAGMA table_xinfo({table})").fetchall(),
        "indexes": indexes,
        "index_columns": {
            name: connection.execute(f"PRAGMA index_xinfo({name})").fetchall()
            for name, *_ in indexes
        },
        "partial": where,
        "foreign_keys": connection.execute(f"PRAGMA foreign_key_list({table})").fetchall(),
        "table_list": connection.execute(f"PRAGMA table_list({table})").fetchall(),
    }


@pytest.fixture(params=["migrations", "metadata"])
def schema_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A database whose schema was made by the migrations or by ``metadata.create_all``."""
    path = tmp_path / f"{request.param}.db"
    if request.param == "migrations":
        migrate(path)
    else:
        _create_from_metadata(path)
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        yield connection
    finally:
        connection.close()


class TestMigrations:
    async def test_start_records_the_schema_version(
        self, store: SqliteTimerStore, raw: sqlite3.Connection
    ) -> None:
        """Start applies every migration and records each in the version table."""
        rows = raw.execute("SELECT version FROM timer_schema_version").fetchall()
        assert rows == [(v,) for v in range(1, SCHEMA_VERSION + 1)]

    def test_migrate_again_changes_nothing(self, db_path: Path) -> None:
        """Migrating an up-to-date database is a no-op that returns the current version."""
        assert migrate(db_path) == SCHEMA_VERSION
        connection = sqlite3.connect(db_path)
        before = connection.execute("SELECT * FROM sqlite_master ORDER BY name").fetchall()
        connection.close()
        assert migrate(db_path) == SCHEMA_VERSION
        connection = sqlite3.connect(db_path)
        try:
            after = connection.execute("SELECT * FROM sqlite_master ORDER BY name").fetchall()
            versions = connection.execute("SELECT count(*) FROM timer_schema_version").fetchone()
        finally:
            connection.close()
        assert after == before
        assert versions == (SCHEMA_VERSION,)

    async def test_concurrent_starts_migrate_once(self, db_path: Path) -> None:
        """Two stores starting on a fresh file at once both work; each step is recorded once."""
        stores = [SqliteTimerStore(db_path), SqliteTimerStore(db_path)]
        await asyncio.gather(*(s.start() for s in stores))
        try:
            await stores[0].schedule(entry())
            assert await stores[1].get(entry().tenant_id, entry().service_call_id) == entry()
        finally:
            for s in stores:
                await s.aclose()
        assert migrate(db_path) == SCHEMA_VERSION

    async def test_newer_database_is_refused(self, db_path: Path) -> None:
        """A database written by a newer schema version is refused with a clear error."""
        migrate(db_path)
        connection = sqlite3.connect(db_path)
        with connection:
            connection.execute(
                "INSERT INTO timer_schema_version VALUES (?, 'from the future')",
                (SCHEMA_VERSION + 1,),
            )
        connection.close()
        store = SqliteTimerStore(db_path)
        with pytest.raises(SchemaVersionError) as refused:
            await store.start()
        message = str(refused.value)
        assert f"version {SCHEMA_VERSION + 1}" in message
        assert f"up to {SCHEMA_VERSION}" in message
        assert "newer" in message
        with pytest.raises(StoreUnavailable):
            await store.schedule(entry())
        with pytest.raises(SchemaVersionError):
            migrate(db_path)

    def test_table_made_from_metadata_is_adopted(self, db_path: Path) -> None:
        """A table a host created from ``metadata`` (e.g. via Alembic) is taken over as is."""
        _create_from_metadata(db_path)
        assert migrate(db_path) == SCHEMA_VERSION

    def test_migrate_accepts_an_engine(self, db_path: Path) -> None:
        """migrate runs on a host's own SQLite engine with the driver's default transactions."""
        engine = sa.create_engine(f"sqlite:///{db_path}")
        try:
            assert migrate(engine) == SCHEMA_VERSION
            with engine.connect() as connection:
                assert connection.exec_driver_sql(
                    "SELECT max(version) FROM timer_schema_version"
                ).scalar() == (SCHEMA_VERSION)
        finally:
            engine.dispose()

    def test_unwritable_path_is_a_store_error(self, tmp_path: Path) -> None:
        """A database path that cannot be opened raises StoreUnavailable naming the path."""
        path = tmp_path / "missing-dir" / "timer.db"
        with pytest.raises(StoreUnavailable, match="missing-dir"):
            migrate(path)


#: The migrations up to the one that adds the trace context (the previous schema version).
_BEFORE_TRACE_CONTEXT = [
    m
    for m in MIGRATIONS
    if m.version < next(t.version for t in MIGRATIONS if "trace context" in t.description)
]


def _create_version_before_trace_context(path: Path) -> None:
    """A database exactly as the schema version before the trace context left it, with a
    timer that has a command position."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        migrate_to(connection, _BEFORE_TRACE_CONTEXT[-1].version)
        connection.execute(
            "INSERT INTO timer_schedules (tenant_id, service_call_id, correlation_id, due_at, "
            "registered_at, command_position) VALUES ('tenant-a', 'old', 'corr', ?, ?, 7)",
            (_GOOD_TS, _GOOD_TS),
        )
    finally:
        connection.close()


class TestTraceContextMigration:
    async def test_previous_version_migrates_and_keeps_its_timers(self, db_path: Path) -> None:
        """A database at the previous version gains the trace columns; its timers read back
        without context and keep their command position."""
        _create_version_before_trace_context(db_path)
        async with SqliteTimerStore(db_path) as store:
            old = await store.get(TenantId("tenant-a"), ServiceCallId("old"))
            assert old is not None
            assert old.correlation_id == "corr"
            assert old.trace_context is None
            stale = PositionedOperation(entry("tenant-a", "old"), 6, old.registered_at)
            assert await store.apply([stale]) == [CommandOutcome.STALE]
            traced = attrs.evolve(
                entry(), trace_context=TraceContext(_TRACEPARENT, "vendor=opaque")
            )
            await store.schedule(traced)
            assert await store.get(traced.tenant_id, traced.service_call_id) == traced
        assert _versions(db_path) == list(range(1, SCHEMA_VERSION + 1))

    def test_migrated_previous_version_matches_a_fresh_schema(self, tmp_path: Path) -> None:
        """Migrating from the previous version builds the same schema as a fresh database."""
        _create_version_before_trace_context(tmp_path / "old.db")
        assert migrate(tmp_path / "old.db") == SCHEMA_VERSION
        migrate(tmp_path / "fresh.db")
        assert _describe_file(tmp_path / "old.db") == _describe_file(tmp_path / "fresh.db")


class TestSchema:
    def test_metadata_matches_the_migrations(self, tmp_path: Path) -> None:
        """``metadata.create_all`` and the migrations build the same table and indexes."""
        migrate(tmp_path / "migrated.db")
        _create_from_metadata(tmp_path / "metadata.db")
        assert _describe_file(tmp_path / "migrated.db") == _describe_file(tmp_path / "metadata.db")

    def test_table_is_strict_with_the_seed_columns(self, schema_db: sqlite3.Connection) -> None:
        """timer_schedules is STRICT, keyed by (tenant_id, service_call_id), as in the seed."""
        (_, _, _, _, _, strict) = schema_db.execute("PRAGMA table_list(timer_schedules)").fetchone()
        assert strict == 1
        columns = {
            name: (kind, notnull, pk)
            for _, name, kind, notnull, _, pk in schema_db.execute(
                "PRAGMA table_info(timer_schedules)"
            )
        }
        assert columns == {
            "tenant_id": ("TEXT", 1, 1),
            "service_call_id": ("TEXT", 1, 2),
            "correlation_id": ("TEXT", 0, 0),
            "due_at": ("TEXT", 1, 0),
            "registered_at": ("TEXT", 1, 0),
            "reached_at": ("TEXT", 0, 0),
            "state": ("TEXT", 1, 0),
            "command_position": ("INTEGER", 0, 0),
            "traceparent": ("TEXT", 0, 0),
            "tracestate": ("TEXT", 0, 0),
            "far_bucket": ("TEXT", 0, 0),
        }
        indexes = {
            name: [c[2] for c in schema_db.execute(f"PRAGMA index_info({name})")]
            for _, name, *_ in schema_db.execute("PRAGMA index_list(timer_schedules)")
        }
        # Since version 3 the seed's (tenant_id, state, due_at) is this partial index.
        assert "idx_timer_schedules_due_at" not in indexes
        assert indexes["idx_timer_schedules_tenant_due"] == [
            "tenant_id",
            "due_at",
            "service_call_id",
        ]
        assert indexes["idx_timer_schedules_correlation_id"] == ["correlation_id"]

    @pytest.mark.parametrize(
        ("values", "constraint"),
        [
            (("Cancelled", None), "ck_timer_schedules_state"),
            (("Reached", None), "ck_timer_schedules_reached_at"),
            (("Scheduled", _GOOD_TS), "ck_timer_schedules_reached_at"),
            (("Reached", "2030-01-01 12:00:00"), "ck_timer_schedules_reached_at_format"),
        ],
    )
    def test_state_and_reached_at_are_checked(
        self, schema_db: sqlite3.Connection, values: tuple[str, str | None], constraint: str
    ) -> None:
        """Only Scheduled/Reached, with reached_at set exactly when Reached, in ISO text."""
        with pytest.raises(sqlite3.IntegrityError, match=constraint):
            schema_db.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at,"
                " state, reached_at) VALUES ('t', 'c', ?, ?, ?, ?)",
                (_GOOD_TS, _GOOD_TS, *values),
            )

    @pytest.mark.parametrize(
        "due_at", ["2030-01-01T12:00:00Z", "2030-01-01T12:00:00.000+00:00", "2030-01-01"]
    )
    def test_timestamps_must_be_millisecond_utc_text(
        self, schema_db: sqlite3.Connection, due_at: str
    ) -> None:
        """A due time in any other shape is refused: text order must be time order."""
        with pytest.raises(sqlite3.IntegrityError, match="ck_timer_schedules_due_at_format"):
            schema_db.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES ('t', 'c', ?, ?)",
                (due_at, _GOOD_TS),
            )

    def test_strict_refuses_wrong_types(self, schema_db: sqlite3.Connection) -> None:
        """STRICT refuses a blob in a TEXT column instead of storing it."""
        with pytest.raises(sqlite3.IntegrityError, match="cannot store BLOB"):
            schema_db.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES (x'00', 'c', ?, ?)",
                (_GOOD_TS, _GOOD_TS),
            )


def _create_version_1(path: Path) -> None:
    """A database exactly as the previous release (schema version 1) left it, with timers."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in MIGRATIONS[0].statements("standalone"):
            connection.execute(statement)
        connection.execute(
            "CREATE TABLE timer_schema_version (version INTEGER PRIMARY KEY, "
            "description TEXT NOT NULL) STRICT"
        )
        connection.execute("INSERT INTO timer_schema_version VALUES (1, 'version 1')")
        connection.executemany(
            "INSERT INTO timer_schedules (tenant_id, service_call_id, correlation_id, due_at, "
            "registered_at, state, reached_at) VALUES ('t', ?, 'corr', ?, ?, ?, ?)",
            [
                ("pending", _GOOD_TS, _GOOD_TS, "Scheduled", None),
                ("fired", _GOOD_TS, _GOOD_TS, "Reached", _GOOD_TS),
            ],
        )
    finally:
        connection.close()


class TestMigrationFromVersion1:
    async def test_version_1_database_is_migrated_and_keeps_its_timers(self, db_path: Path) -> None:
        """A version 1 database gains command positions on start; its timers stay as they were."""
        _create_version_1(db_path)
        async with SqliteTimerStore(db_path) as store:
            pending = await store.get(TenantId("t"), ServiceCallId("pending"))
            fired = await store.get(TenantId("t"), ServiceCallId("fired"))
            assert pending is not None and pending.is_scheduled
            assert pending.correlation_id == "corr"
            assert fired is not None and not fired.is_scheduled
            key = TimerKey(TenantId("t"), ServiceCallId("pending"))
            at = pending.registered_at
            # A timer from before the migration has no position: any positioned command applies.
            assert await store.apply([PositionedOperation(key, 5, at)]) == [
                CommandOutcome.CANCELLED
            ]
            old = PositionedOperation(entry("t", "pending"), 4, at)
            assert await store.apply([old]) == [CommandOutcome.STALE]
        assert _versions(db_path) == list(range(1, SCHEMA_VERSION + 1))

    def test_migrated_version_1_matches_a_fresh_database(self, tmp_path: Path) -> None:
        """A version 1 database migrated forward has the same schema as a fresh one."""
        _create_version_1(tmp_path / "old.db")
        assert migrate(tmp_path / "old.db") == SCHEMA_VERSION
        migrate(tmp_path / "fresh.db")
        assert _describe_file(tmp_path / "old.db") == _describe_file(tmp_path / "fresh.db")


class TestModes:
    async def test_standalone_database_refuses_shared_mode(self, db_path: Path) -> None:
        """Opening a standalone table in shared mode is refused: SQLite cannot add the FK."""
        migrate(db_path)
        connection = sqlite3.connect(db_path)
        connection.execute(
            "CREATE TABLE service_calls (tenant_id TEXT, service_call_id TEXT, "
            "PRIMARY KEY (tenant_id, service_call_id))"
        )
        connection.close()
        with pytest.raises(StoreError, match="standalone mode"):
            await SqliteTimerStore(db_path, mode="shared").start()

    async def test_shared_mode_needs_service_calls(self, db_path: Path) -> None:
        """Shared mode without the host's service_calls table fails at start, naming it."""
        with pytest.raises(StoreError, match="service_calls"):
            await SqliteTimerStore(db_path, mode="shared").start()
