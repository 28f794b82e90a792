"""The ``timer_schedules`` table as SQLAlchemy metadata, and the migrations that build it.

The migrations are frozen SQL, applied in one transaction under an advisory lock so that
instances starting together against a fresh database do not race; ``metadata`` describes
the schema they produce (a test keeps the two in step).
"""

from __future__ import annotations

import logging

import attrs
import sqlalchemy as sa

from timer_core import SchemaVersionError

__all__ = [
    "FAR_EDGE_LOCK",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Migration",
    "metadata",
    "migrate",
    "schema_version",
    "timer_horizon",
    "timer_schedules",
    "timer_tombstones",
]

log = logging.getLogger(__name__)

metadata = sa.MetaData()

#: Every timer, one row per ``(tenant_id, service_call_id)``, plus the lease of the instance
#: that claimed it for firing. Identifiers use the "C" collation so the database orders them
#: exactly like Python compares strings (keyset pagination depends on it).
timer_schedules = sa.Table(
    "timer_schedules",
    metadata,
    sa.Column("tenant_id", sa.String(128, collation="C"), primary_key=True),
    sa.Column("service_call_id", sa.String(128, collation="C"), primary_key=True),
    sa.Column("correlation_id", sa.String(128, collation="C"), nullable=True),
    sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("reached_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("state", sa.String(16, collation="C"), nullable=False, server_default="Scheduled"),
    sa.Column("lease_owner", sa.String(200), nullable=True),
    sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
    sa.Column("lease_token", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("command_position", sa.BigInteger, nullable=True),
    sa.Column("traceparent", sa.Text, nullable=True),
    sa.Column("tracestate", sa.Text, nullable=True),
    # NULL: the timer is near (in the due-order indexes); else it is due at or after the far
    # edge (timer_horizon), and this is its due time floored to a 10-minute bucket.
    sa.Column("far_bucket", sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('Scheduled', 'Reached')", name="ck_timer_schedules_state"),
    sa.CheckConstraint(
        "(state = 'Reached') = (reached_at IS NOT NULL)", name="ck_timer_schedules_reached_at"
    ),
    sa.CheckConstraint(
        "(lease_owner IS NULL) = (lease_until IS NULL)", name="ck_timer_schedules_lease"
    ),
    sa.Index(
        "ix_timer_schedules_tenant_due",
        "tenant_id",
        "due_at",
        "service_call_id",
        postgresql_where=sa.text("state = 'Scheduled' AND far_bucket IS NULL"),
    ),
    sa.Index(
        "ix_timer_schedules_tenant_correlation", "tenant_id", "correlation_id", "service_call_id"
    ),
    sa.Index(
        "ix_timer_schedules_due",
        "due_at",
        "tenant_id",
        "service_call_id",
        postgresql_where=sa.text(
            "state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'::timestamptz"
        ),
    ),
    sa.Index(
        "ix_timer_schedules_far",
        "far_bucket",
        postgresql_where=sa.text("far_bucket IS NOT NULL"),
    ),
    sa.Index(
        "ix_timer_schedules_far_tenant",
        "tenant_id",
        postgresql_where=sa.text("far_bucket IS NOT NULL"),
    ),
    sa.Index(
        "ix_timer_schedules_reached",
        "reached_at",
        postgresql_where=sa.text("state = 'Reached'"),
    ),
    # Half of each page left free (schema version 5): a claim's update stays on its page.
    # Autovacuum and autoanalyze at 2% of the rows changed, not 20% and 10% (version 6).
    postgresql_with={
        "fillfactor": 50,
        "autovacuum_vacuum_scale_factor": 0.02,
        "autovacuum_vacuum_insert_scale_factor": 0.02,
        "autovacuum_analyze_scale_factor": 0.02,
    },
)

#: The tombstone of a positioned cancel: the key's highest command position, kept after its
#: timer is deleted until retention purges it (see ``TimerStore.apply``).
timer_tombstones = sa.Table(
    "timer_tombstones",
    metadata,
    sa.Column("tenant_id", sa.String(128, collation="C"), primary_key=True),
    sa.Column("service_call_id", sa.String(128, collation="C"), primary_key=True),
    sa.Column("command_position", sa.BigInteger, nullable=False),
    sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_timer_tombstones_cancelled_at", "cancelled_at"),
)

#: The far edge (one row, or none yet): every Scheduled timer due before ``edge`` is near.
timer_horizon = sa.Table(
    "timer_horizon",
    metadata,
    sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
    sa.Column("edge", sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("id = 1", name="ck_timer_horizon_one_row"),
)

#: Every statement that decides whether a timer it writes is far takes this advisory lock
#: shared (through ``timer_far_edge()``, until its transaction ends); the advance takes it
#: exclusive to raise the edge. Any constant no host uses for its own advisory locks works;
#: this one spells "TIMEF".
FAR_EDGE_LOCK = 0x54494D4546

# The far edge as a writer must judge it: read after the shared lock is held, so the edge is
# the one committed last, never one an advance raised meanwhile (READ COMMITTED: each query
# of a VOLATILE function takes a new snapshot, the calling statement's is taken before it
# runs). A writer holding the lock keeps the edge where it read it until it commits.
FAR_EDGE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION timer_far_edge() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $body$
DECLARE
    stored timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared({FAR_EDGE_LOCK});
    SELECT edge INTO stored FROM timer_horizon;
    RETURN stored;
END
$body$
"""
# metadata.create_all makes (and drop_all drops) the function with the table.
_CREATE_FUNCTION = sa.DDL(FAR_EDGE_FUNCTION)  # type: ignore[no-untyped-call]
_DROP_FUNCTION = sa.DDL("DROP FUNCTION IF EXISTS timer_far_edge()")  # type: ignore[no-untyped-call]
sa.event.listen(timer_horizon, "after_create", _CREATE_FUNCTION)
sa.event.listen(timer_horizon, "before_drop", _DROP_FUNCTION)

#: Which migrations a database has had; the highest version is its schema version.
schema_migrations = sa.Table(
    "timer_schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column(
        "applied_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
)


@attrs.frozen
class Migration:
    """One forward-only schema step: the SQL statements that take version - 1 to version."""

    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "timer_schedules with leases for claiming by several instances",
        (
            # Claims only touch the unindexed lease columns: with free room on the page
            # (fillfactor) they are heap-only updates that write no index entries.
            """
            CREATE TABLE timer_schedules (
                tenant_id varchar(128) COLLATE "C" NOT NULL,
                service_call_id varchar(128) COLLATE "C" NOT NULL,
                correlation_id varchar(128) COLLATE "C",
                due_at timestamptz NOT NULL,
                registered_at timestamptz NOT NULL,
                reached_at timestamptz,
                state varchar(16) COLLATE "C" NOT NULL DEFAULT 'Scheduled',
                lease_owner varchar(200),
                lease_until timestamptz,
                lease_token bigint NOT NULL DEFAULT 0,
                CONSTRAINT timer_schedules_pkey PRIMARY KEY (tenant_id, service_call_id),
                CONSTRAINT ck_timer_schedules_state CHECK (state IN ('Scheduled', 'Reached')),
                CONSTRAINT ck_timer_schedules_reached_at
                    CHECK ((state = 'Reached') = (reached_at IS NOT NULL)),
                CONSTRAINT ck_timer_schedules_lease
                    CHECK ((lease_owner IS NULL) = (lease_until IS NULL))
            ) WITH (fillfactor = 90)
            """,
            """
            CREATE INDEX ix_timer_schedules_tenant_state_due
                ON timer_schedules (tenant_id, state, due_at)
            """,
            """
            CREATE INDEX ix_timer_schedules_tenant_correlation
                ON timer_schedules (tenant_id, correlation_id, service_call_id)
            """,
            # The cross-tenant due query walks this in order and stops after LIMIT rows.
            """
            CREATE INDEX ix_timer_schedules_due
                ON timer_schedules (due_at, tenant_id, service_call_id)
                WHERE state = 'Scheduled'
            """,
            """
            CREATE INDEX ix_timer_schedules_reached
                ON timer_schedules (reached_at)
                WHERE state = 'Reached'
            """,
        ),
    ),
    Migration(
        2,
        "command positions: timer_schedules.command_position and timer_tombstones",
        (
            # No default and nullable: adding the column rewrites nothing.
            "ALTER TABLE timer_schedules ADD COLUMN command_position bigint",
            """
            CREATE TABLE timer_tombstones (
                tenant_id varchar(128) COLLATE "C" NOT NULL,
                service_call_id varchar(128) COLLATE "C" NOT NULL,
                command_position bigint NOT NULL,
                cancelled_at timestamptz NOT NULL,
                CONSTRAINT timer_tombstones_pkey PRIMARY KEY (tenant_id, service_call_id)
            )
            """,
            """
            CREATE INDEX ix_timer_tombstones_cancelled_at
                ON timer_tombstones (cancelled_at)
            """,
        ),
    ),
    Migration(
        3,
        "tenant fairness: ix_timer_schedules_tenant_due replaces "
        "ix_timer_schedules_tenant_state_due",
        (
            # Each tenant's pending timers in its own due order: batches shared among
            # tenants claim from it without reading a tenant's whole backlog.
            """
            CREATE INDEX ix_timer_schedules_tenant_due
                ON timer_schedules (tenant_id, due_at, service_call_id)
                WHERE state = 'Scheduled'
            """,
            "DROP INDEX ix_timer_schedules_tenant_state_due",
        ),
    ),
    Migration(
        4,
        "keep the W3C trace context a timer was scheduled with",
        (
            # Nullable without a default: a catalog-only change, no table rewrite or scan.
            "ALTER TABLE timer_schedules ADD COLUMN traceparent text",
            "ALTER TABLE timer_schedules ADD COLUMN tracestate text",
        ),
    ),
    Migration(
        5,
        "half-full pages: a claim's update stays on its page",
        (
            # Timers due together sit together, so a claim of 100 updates most rows of a
            # few pages in one statement; at fillfactor 90 only about one in ten of the new
            # versions fitted on its page, and every other one was a non-HOT update writing
            # an entry into each of the table's four indexes. With half of each page free,
            # the claim's updates are heap-only (PostgreSQL CPU per fired timer about 30%
            # lower in bench/scale_out.py), for 1.8 times the heap. Pages already
            # written keep their fill until rewritten (VACUUM FULL, pg_repack).
            "ALTER TABLE timer_schedules SET (fillfactor = 50)",
        ),
    ),
    Migration(
        6,
        "autovacuum and autoanalyze after 2% of the rows changed, not 20% and 10%",
        (
            # At the server's defaults a table of 13,000,000 rows waited for 2,600,000 dead
            # ones (fired timers purged, rescheduled and fired ones' old versions) before a
            # vacuum: none ran during the large-table bench's steady runs, and the
            # one that comes at last reads the whole table and its indexes at once, while
            # the dead rows and their index entries slow every claim meanwhile. At 2% the
            # vacuums come about ten times as often and each has a tenth of the dead rows
            # to clear; the planner's statistics of the due times stay as fresh. A table
            # option: a database administrator's own ALTER TABLE overrides it.
            """
            ALTER TABLE timer_schedules SET (
                autovacuum_vacuum_scale_factor = 0.02,
                autovacuum_vacuum_insert_scale_factor = 0.02,
                autovacuum_analyze_scale_factor = 0.02
            )
            """,
        ),
    ),
    Migration(
        7,
        "timers far ahead kept out of the due-order indexes: far_bucket, timer_horizon",
        (
            # Nullable without a default: catalog only, and every existing timer is near.
            "ALTER TABLE timer_schedules ADD COLUMN far_bucket timestamptz",
            """
            CREATE TABLE timer_horizon (
                id smallint NOT NULL,
                edge timestamptz,
                CONSTRAINT timer_horizon_pkey PRIMARY KEY (id),
                CONSTRAINT ck_timer_horizon_one_row CHECK (id = 1)
            )
            """,
            FAR_EDGE_FUNCTION,
            # The due-order indexes take near timers only: a timer set weeks ahead wrote a
            # random leaf of each (a page read and written per index per timer at 10,000,000
            # pending); far ones are appended to their bucket's end of ix_timer_schedules_far
            # (equal keys are ordered by heap position) and moved in as the edge passes.
            # "due_at > '-infinity'" holds for every timer; only the queries that state it
            # can use this index: not the claim by tenant, whose order the index would give
            # (its tenant fixed) and which statistics taken with few timers near (all far
            # after a bulk load) planned as a walk of every tenant's due timers per tenant.
            "DROP INDEX ix_timer_schedules_due",
            """
            CREATE INDEX ix_timer_schedules_due
                ON timer_schedules (due_at, tenant_id, service_call_id)
                WHERE state = 'Scheduled' AND far_bucket IS NULL
                  AND due_at > '-infinity'::timestamptz
            """,
            "DROP INDEX ix_timer_schedules_tenant_due",
            """
            CREATE INDEX ix_timer_schedules_tenant_due
                ON timer_schedules (tenant_id, due_at, service_call_id)
                WHERE state = 'Scheduled' AND far_bucket IS NULL
            """,
            """
            CREATE INDEX ix_timer_schedules_far
                ON timer_schedules (far_bucket)
                WHERE far_bucket IS NOT NULL
            """,
            # A tenant's far timers (its counts, its earliest, its pages in the console),
            # appended at its tenant's end (equal keys again) rather than read among all of
            # the tenant's keys.
            """
            CREATE INDEX ix_timer_schedules_far_tenant
                ON timer_schedules (tenant_id)
                WHERE far_bucket IS NOT NULL
            """,
        ),
    ),
)

#: The schema version this package writes and reads.
SCHEMA_VERSION = MIGRATIONS[-1].version

# Any constant shared by every Timer instance works; this one spells "TIMER".
_MIGRATION_LOCK = 0x54494D4552

_CREATE_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS timer_schema_migrations (
    version integer PRIMARY KEY,
    description text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


def schema_version(conn: sa.Connection) -> int:
    """The database's schema version: 0 when Timer never migrated it."""
    exists = conn.execute(sa.text("SELECT to_regclass('timer_schema_migrations')")).scalar()
    if exists is None:
        return 0
    version = conn.execute(sa.select(sa.func.max(schema_migrations.c.version))).scalar()
    return int(version or 0)


def migrate(conn: sa.Connection) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION` inside the caller's transaction.

    Returns the version found before migrating. Raises :class:`SchemaVersionError` if the
    database is newer than this package (it is then left untouched).
    """
    found = schema_version(conn)
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the database has Timer schema version {found}, newer than {SCHEMA_VERSION} "
            "that this timer-adapters-postgres understands; upgrade Timer"
        )
    if found == SCHEMA_VERSION:
        return found
    # Serialise concurrent starters; re-read the version once we hold the lock.
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
    conn.execute(sa.text(_CREATE_VERSION_TABLE))
    found = schema_version(conn)
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the database has Timer schema version {found}, newer than {SCHEMA_VERSION}"
        )
    for migration in MIGRATIONS:
        if migration.version <= found:
            continue
        for statement in migration.statements:
            conn.execute(sa.text(statement))
        conn.execute(
            sa.insert(schema_migrations).values(
                version=migration.version, description=migration.description
            )
        )
        log.info(
            "migrated the timer schema to version %s: %s", migration.version, migration.description
        )
    return found
