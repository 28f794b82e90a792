"""The schema: versioned migrations, the exported metadata, constraints and driver errors."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import attrs
import psycopg
import pytest
import sqlalchemy as sa

from tests.ports import refused_port
from timer_adapters_postgres import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Migration,
    PostgresTimerStore,
    metadata,
)
from timer_core import (
    CommandOutcome,
    PositionedOperation,
    SchemaNotFound,
    SchemaVersionError,
    ServiceCallId,
    StoreUnavailable,
    TenantId,
    TimerEntry,
    TimerKey,
    TraceContext,
)

_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def connect(url: str) -> psycopg.Connection[Any]:
    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(conninfo, autocommit=True)


def timer(call: str) -> TimerEntry:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    return TimerEntry(tenant_id="t", service_call_id=call, due_at=now, registered_at=now)


class TestMigrations:
    """Forward-only, versioned migrations run at start, once, and refuse newer databases."""

    async def test_fresh_database_is_migrated_to_the_current_version(
        self, fresh_postgres_url: str
    ) -> None:
        """Starting on an empty database creates the table and records every migration."""
        async with PostgresTimerStore(fresh_postgres_url, listen=False) as store:
            await store.schedule(timer("call-1"))
        with connect(fresh_postgres_url) as conn:
            versions = conn.execute("SELECT version FROM timer_schema_migrations").fetchall()
        assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]

    async def test_concurrent_first_starts_migrate_once(self, fresh_postgres_url: str) -> None:
        """Several instances starting together on an empty database all come up."""
        stores = [PostgresTimerStore(fresh_postgres_url, listen=False) for _ in range(4)]
        try:
            await asyncio.gather(*(store.start() for store in stores))
            await stores[0].schedule(timer("call-1"))
            assert await stores[3].count_scheduled() == 1
        finally:
            for store in stores:
                await store.aclose()

    async def test_newer_schema_is_refused_and_left_alone(self, postgres_url: str) -> None:
        """A database migrated by a newer Timer raises SchemaVersionError and is not touched."""
        async with PostgresTimerStore(postgres_url, listen=False) as store:
            await store.schedule(timer("call-1"))
        with connect(postgres_url) as conn:
            conn.execute(
                "INSERT INTO timer_schema_migrations (version, description) "
                "VALUES (%s, 'from the future')",
                (SCHEMA_VERSION + 1,),
            )
            try:
                with pytest.raises(SchemaVersionError, match="newer"):
                    await PostgresTimerStore(postgres_url, listen=False).start()
                count = conn.execute("SELECT count(*) FROM timer_schedules").fetchone()
                assert count == (1,)
            finally:
                conn.execute(
                    "DELETE FROM timer_schema_migrations WHERE version = %s", (SCHEMA_VERSION + 1,)
                )

    async def test_migrate_false_refuses_an_unmigrated_database(
        self, fresh_postgres_url: str
    ) -> None:
        """With migrate=False, a database without the Timer schema is an error, not changed."""
        with pytest.raises(SchemaNotFound, match="no Timer schema in postgresql"):
            await PostgresTimerStore(fresh_postgres_url, listen=False, migrate=False).start()
        with connect(fresh_postgres_url) as conn:
            assert conn.execute("SELECT to_regclass('timer_schedules')").fetchone() == (None,)

    async def test_version_1_database_is_migrated_and_keeps_its_timers(
        self, fresh_postgres_url: str
    ) -> None:
        """A database left at schema version 1 gains command positions; its timers stay."""
        with connect(fresh_postgres_url) as conn:
            conn.execute(
                "CREATE TABLE timer_schema_migrations (version integer PRIMARY KEY, "
                "description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for statement in MIGRATIONS[0].statements:
                conn.execute(statement)
            conn.execute("INSERT INTO timer_schema_migrations VALUES (1, 'version 1')")
            conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES ('t', 'pending', '2030-01-01Z', '2030-01-01Z')"
            )
        async with PostgresTimerStore(fresh_postgres_url, listen=False) as store:
            pending = await store.get(TenantId("t"), ServiceCallId("pending"))
            assert pending == timer("pending")
            key = TimerKey(TenantId("t"), ServiceCallId("pending"))
            at = pending.registered_at
            assert await store.apply([PositionedOperation(key, 5, at)]) == [
                CommandOutcome.CANCELLED
            ]
            assert await store.apply([PositionedOperation(timer("pending"), 4, at)]) == [
                CommandOutcome.STALE
            ]
        with connect(fresh_postgres_url) as conn:
            versions = conn.execute(
                "SELECT version FROM timer_schema_migrations ORDER BY version"
            ).fetchall()
        assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]

    async def test_metadata_describes_the_migrated_schema(self, postgres_url: str) -> None:
        """The exported metadata has the same columns, keys, checks and indexes as the database."""
        async with PostgresTimerStore(postgres_url, listen=False):
            pass
        engine = sa.create_engine(postgres_url)
        dialect = engine.dialect
        try:
            inspector = sa.inspect(engine)
            for table in metadata.sorted_tables:
                columns = {c["name"]: c for c in inspector.get_columns(table.name)}
                assert set(columns) == {c.name for c in table.columns}
                for column in table.columns:
                    found = columns[column.name]
                    assert found["nullable"] == column.nullable, column.name
                    assert found["type"].compile(dialect) == column.type.compile(dialect)
                primary = inspector.get_pk_constraint(table.name)["constrained_columns"]
                assert primary == [c.name for c in table.primary_key.columns]
                checks = {c["name"] for c in inspector.get_check_constraints(table.name)}
                assert checks == {
                    c.name for c in table.constraints if isinstance(c, sa.CheckConstraint)
                }
                indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes(table.name)}
                assert indexes == {i.name: [c.name for c in i.columns] for i in table.indexes}
                options = inspector.get_table_options(table.name).get("postgresql_with", {})
                expected = table.dialect_options["postgresql"]["with"] or {}
                assert {k: str(v) for k, v in options.items()} == {
                    k: str(v) for k, v in expected.items()
                }
        finally:
            engine.dispose()

    async def test_instants_are_timestamptz_and_ids_sort_bytewise(self, postgres_url: str) -> None:
        """Instants are stored as timestamptz and identifiers in the C collation."""
        async with PostgresTimerStore(postgres_url, listen=False):
            pass
        with connect(postgres_url) as conn:
            types = dict(
                conn.execute(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_name = 'timer_schedules'"
                ).fetchall()
            )
            collations = dict(
                conn.execute(
                    "SELECT column_name, collation_name FROM information_schema.columns "
                    "WHERE table_name = 'timer_schedules' AND collation_name IS NOT NULL"
                ).fetchall()
            )
        assert {types[c] for c in ("due_at", "registered_at", "reached_at", "lease_until")} == {
            "timestamp with time zone"
        }
        for column in ("tenant_id", "service_call_id", "correlation_id", "state"):
            assert collations[column] == "C"


def migrate_by_hand(conn: psycopg.Connection[Any], migrations: list[Migration]) -> None:
    """Run ``migrations`` on an empty database and record them, as an older Timer did."""
    conn.execute(
        "CREATE TABLE timer_schema_migrations (version integer PRIMARY KEY, "
        "description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for migration in migrations:
        for statement in migration.statements:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO timer_schema_migrations (version, description) VALUES (%s, %s)",
            (migration.version, migration.description),
        )


#: The migrations up to the one that adds the trace context (the previous schema version).
_BEFORE_TRACE_CONTEXT = [
    m
    for m in MIGRATIONS
    if m.version < next(t.version for t in MIGRATIONS if "trace context" in t.description)
]


class TestTraceContextMigration:
    """The trace context columns come to a database the previous version made."""

    async def test_previous_version_migrates_and_keeps_its_timers(
        self, fresh_postgres_url: str
    ) -> None:
        """A database at the previous version gains the trace columns; its timers read back
        without context and keep their command position."""
        with connect(fresh_postgres_url) as conn:
            migrate_by_hand(conn, _BEFORE_TRACE_CONTEXT)
            conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, correlation_id, due_at,"
                " registered_at, command_position)"
                " VALUES ('t', 'old', 'corr', '2030-01-01Z', '2030-01-01Z', 7)"
            )
        async with PostgresTimerStore(fresh_postgres_url, listen=False) as store:
            old = await store.get(TenantId("t"), ServiceCallId("old"))
            assert old is not None
            assert old.correlation_id == "corr"
            assert old.trace_context is None
            stale = PositionedOperation(timer("old"), 6, old.registered_at)
            assert await store.apply([stale]) == [CommandOutcome.STALE]
            traced = attrs.evolve(
                timer("new"), trace_context=TraceContext(_TRACEPARENT, "vendor=opaque")
            )
            await store.schedule(traced)
            assert await store.get(TenantId("t"), ServiceCallId("new")) == traced
        with connect(fresh_postgres_url) as conn:
            versions = conn.execute(
                "SELECT version FROM timer_schema_migrations ORDER BY version"
            ).fetchall()
        assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


class TestAutovacuumMigration:
    """Schema version 6 vacuums and analyzes ``timer_schedules`` after 2% of its rows changed."""

    async def test_version_5_database_gets_the_table_autovacuum_settings(
        self, fresh_postgres_url: str
    ) -> None:
        """A database at version 5 gains the three scale factors, keeps its fill factor and
        its timers."""
        with connect(fresh_postgres_url) as conn:
            migrate_by_hand(conn, [m for m in MIGRATIONS if m.version <= 5])
            conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES ('t', 'old', '2030-01-01Z', '2030-01-01Z')"
            )
        async with PostgresTimerStore(fresh_postgres_url, listen=False) as store:
            assert await store.get(TenantId("t"), ServiceCallId("old")) == timer("old")
        with connect(fresh_postgres_url) as conn:
            options = conn.execute(
                "SELECT reloptions FROM pg_class WHERE relname = 'timer_schedules'"
            ).fetchone()
        assert options is not None
        assert sorted(options[0]) == [
            "autovacuum_analyze_scale_factor=0.02",
            "autovacuum_vacuum_insert_scale_factor=0.02",
            "autovacuum_vacuum_scale_factor=0.02",
            "fillfactor=50",
        ]


class TestConstraints:
    """The table itself refuses rows the domain forbids, whoever writes them."""

    @pytest.mark.parametrize(
        ("state", "reached_at", "lease_owner", "lease_until"),
        [
            ("Fired", None, None, None),
            ("Reached", None, None, None),
            ("Scheduled", "2030-01-01T00:00:00Z", None, None),
            ("Scheduled", None, "owner", None),
        ],
    )
    async def test_forbidden_rows_are_rejected(
        self,
        postgres_url: str,
        state: str,
        reached_at: str | None,
        lease_owner: str | None,
        lease_until: str | None,
    ) -> None:
        """Unknown states, reached_at out of step with state, and half leases violate a CHECK."""
        async with PostgresTimerStore(postgres_url, listen=False):
            pass
        with connect(postgres_url) as conn, pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at,"
                " state, reached_at, lease_owner, lease_until)"
                " VALUES ('t', 'c', now(), now(), %s, %s, %s, %s)",
                (state, reached_at, lease_owner, lease_until),
            )


class TestErrors:
    """Driver errors come out as StoreError / StoreUnavailable, and the store recovers."""

    def test_a_url_for_another_database_is_refused(self) -> None:
        """Only PostgreSQL URLs (psycopg driver) are accepted, checked in the constructor."""
        with pytest.raises(ValueError, match="PostgreSQL"):
            PostgresTimerStore("mysql://localhost/timer")
        with pytest.raises(ValueError, match="PostgreSQL"):
            PostgresTimerStore("postgresql+asyncpg://localhost/timer")

    async def test_unreachable_server_is_unavailable(self) -> None:
        """Starting against a port nobody listens on raises StoreUnavailable."""
        with refused_port() as port:
            store = PostgresTimerStore(
                f"postgresql://postgres@127.0.0.1:{port}/timer", connect_timeout_s=1
            )
            with pytest.raises(StoreUnavailable, match="PostgreSQL"):
                await store.start()

    async def test_unstarted_or_closed_store_is_unavailable(self, postgres_url: str) -> None:
        """Calls before start or after aclose raise StoreUnavailable."""
        store = PostgresTimerStore(postgres_url, listen=False)
        with pytest.raises(StoreUnavailable):
            await store.count_scheduled()
        await store.start()
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await store.schedule(timer("call-1"))

    async def test_killed_connections_fail_once_then_recover(
        self, postgres_url: str, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A server-side disconnect surfaces as StoreUnavailable; the next call reconnects."""
        async with PostgresTimerStore(postgres_url, listen=False, pool_size=1) as store:
            await store.schedule(timer("call-1"))
            postgres_sql.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'timer' AND datname = current_database()"
            )
            with pytest.raises(StoreUnavailable):
                await store.count_scheduled()
            assert await store.count_scheduled() == 1

    async def test_statement_timeout_is_unavailable(
        self, postgres_url: str, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A write blocked past statement_timeout_s by a lock raises StoreUnavailable."""
        async with PostgresTimerStore(postgres_url, listen=False, statement_timeout_s=0.2) as store:
            await store.schedule(timer("call-1"))
            with postgres_sql.transaction():
                postgres_sql.execute("LOCK TABLE timer_schedules IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(StoreUnavailable, match="statement timeout"):
                    await store.schedule(timer("call-1"))
            assert await store.count_scheduled() == 1
