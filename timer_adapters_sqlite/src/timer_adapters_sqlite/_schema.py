"""The ``timer_schedules`` schema: versioned forward-only migrations and the SQLAlchemy metadata.

The migrations are the source of truth for databases this package manages; ``metadata``
describes the same schema for hosts that fold the table into their own Alembic history.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import attrs
import sqlalchemy as sa

from timer_adapters_sqlite._errors import translate_error
from timer_core import SchemaNotFound, SchemaVersionError, StoreError

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Migration",
    "StoreMode",
    "Synchronous",
    "check_schema",
    "create_sqlite_engine",
    "metadata",
    "migrate",
    "timer_schedules",
    "timer_schedules_table",
]

log = logging.getLogger(__name__)

StoreMode = Literal["standalone", "shared"]
Synchronous = Literal["NORMAL", "FULL"]

TABLE = "timer_schedules"
TOMBSTONES = "timer_tombstones"
HORIZON = "timer_horizon"
VERSION_TABLE = "timer_schema_version"

# Timestamps are compared as text (`due_at <= ?`), which is only correct while every value
# has exactly this shape; the CHECKs make the database refuse anything else.
_TIMESTAMP_GLOB = (
    "[0-9][0-9][0-9][0-9]-[0-1][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-6][0-9].[0-9][0-9][0-9]Z"
)

_CHECKS: dict[str, str] = {
    "ck_timer_schedules_state": "state IN ('Scheduled', 'Reached')",
    "ck_timer_schedules_reached_at": "(state = 'Reached') = (reached_at IS NOT NULL)",
    "ck_timer_schedules_due_at_format": f"due_at GLOB '{_TIMESTAMP_GLOB}'",
    "ck_timer_schedules_registered_at_format": f"registered_at GLOB '{_TIMESTAMP_GLOB}'",
    "ck_timer_schedules_reached_at_format": (
        f"reached_at IS NULL OR reached_at GLOB '{_TIMESTAMP_GLOB}'"
    ),
}

# name -> (columns, partial-index condition or None): the indexes version 1 created.
_INDEXES_V1: dict[str, tuple[tuple[str, ...], str | None]] = {
    # The seed's tenant-scoped polling index.
    "idx_timer_schedules_due_at": (("tenant_id", "state", "due_at"), None),
    "idx_timer_schedules_correlation_id": (("correlation_id",), None),
    # The worker's cross-tenant poll, in the port's (due_at, tenant_id, service_call_id)
    # order; partial, so fired timers cost it nothing and next_due_at is its first entry.
    "idx_timer_schedules_scheduled_due": (
        ("due_at", "tenant_id", "service_call_id"),
        "state = 'Scheduled'",
    ),
    # Retention (purge_reached) deletes the oldest fired timers without scanning the table.
    "idx_timer_schedules_reached_at": (("reached_at",), "state = 'Reached'"),
}

# Version 3: each tenant's pending timers in its own due order, for batches shared among
# tenants (find_due_by_tenant) and the tenant-scoped due query. It replaces the seed's
# (tenant_id, state, due_at), which also held every fired timer and sorted ties.
_TENANT_DUE_INDEX = "idx_timer_schedules_tenant_due"
_TENANT_DUE = (("tenant_id", "due_at", "service_call_id"), "state = 'Scheduled'")

# Version 5, timers far ahead kept apart: a timer due at or after the far edge
# (timer_horizon.edge) has its due time's 10-minute bucket in far_bucket and is in neither
# due-order index, whose insertion points are random in a table of timers set weeks ahead
# (a page of each written per new timer); it is in the two far indexes instead, keyed by
# bucket and by tenant, each then by rowid, so a new far timer lands at the end of its
# bucket's and its tenant's entries, pages a batch shares. As the edge moves forward, the
# timers of the buckets it passes move into the due-order indexes, in bucket order.
_NEAR = "state = 'Scheduled' AND far_bucket IS NULL"
_FAR = "far_bucket IS NOT NULL"
_DUE_INDEX = "idx_timer_schedules_scheduled_due"
_FAR_INDEXES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "idx_timer_schedules_far": (("far_bucket",), _FAR),
    "idx_timer_schedules_far_tenant": (("tenant_id",), _FAR),
}

# The indexes of the current version.
_INDEXES: dict[str, tuple[tuple[str, ...], str | None]] = {
    **{name: index for name, index in _INDEXES_V1.items() if name != "idx_timer_schedules_due_at"},
    _TENANT_DUE_INDEX: _TENANT_DUE,
}
_INDEXES[_DUE_INDEX] = (_INDEXES[_DUE_INDEX][0], _NEAR)
_INDEXES[_TENANT_DUE_INDEX] = (_TENANT_DUE[0], _NEAR)
_INDEXES.update(_FAR_INDEXES)

_FOREIGN_KEY = (
    "CONSTRAINT fk_timer_schedules_service_call FOREIGN KEY (tenant_id, service_call_id) "
    "REFERENCES service_calls (tenant_id, service_call_id) ON DELETE CASCADE"
)


def _create_table_v1(mode: StoreMode) -> list[str]:
    lines = [
        "tenant_id TEXT NOT NULL",
        "service_call_id TEXT NOT NULL",
        "correlation_id TEXT",
        "due_at TEXT NOT NULL",
        "registered_at TEXT NOT NULL",
        "reached_at TEXT",
        "state TEXT NOT NULL DEFAULT 'Scheduled'",
        "CONSTRAINT pk_timer_schedules PRIMARY KEY (tenant_id, service_call_id)",
    ]
    if mode == "shared":
        lines.append(_FOREIGN_KEY)
    lines += [f"CONSTRAINT {name} CHECK ({check})" for name, check in _CHECKS.items()]
    body = ",\n    ".join(lines)
    statements = [f"CREATE TABLE IF NOT EXISTS {TABLE} (\n    {body}\n) STRICT"]
    for name, (columns, where) in _INDEXES_V1.items():
        sql = f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} ({', '.join(columns)})"
        statements.append(sql if where is None else f"{sql} WHERE {where}")
    return statements


def _command_order_v2(_mode: StoreMode) -> list[str]:
    # The tombstone of a positioned cancel: its key's highest command position, kept (until
    # retention purges it) after the timer itself is deleted.
    return [
        f"CREATE TABLE IF NOT EXISTS {TOMBSTONES} (\n"
        "    tenant_id TEXT NOT NULL,\n"
        "    service_call_id TEXT NOT NULL,\n"
        "    command_position INTEGER NOT NULL,\n"
        "    cancelled_at TEXT NOT NULL,\n"
        "    CONSTRAINT pk_timer_tombstones PRIMARY KEY (tenant_id, service_call_id),\n"
        "    CONSTRAINT ck_timer_tombstones_cancelled_at_format\n"
        f"        CHECK (cancelled_at GLOB '{_TIMESTAMP_GLOB}')\n"
        ") STRICT",
        f"CREATE INDEX IF NOT EXISTS idx_timer_tombstones_cancelled_at "
        f"ON {TOMBSTONES} (cancelled_at)",
    ]


def _tenant_due_v3(_mode: StoreMode) -> list[str]:
    columns, where = _TENANT_DUE
    return [
        f"CREATE INDEX IF NOT EXISTS {_TENANT_DUE_INDEX} ON {TABLE} ({', '.join(columns)}) "
        f"WHERE {where}",
        "DROP INDEX IF EXISTS idx_timer_schedules_due_at",
    ]


def _far_apart_v5(_mode: StoreMode) -> list[str]:
    statements = [
        f"CREATE TABLE IF NOT EXISTS {HORIZON} (\n"
        "    id INTEGER NOT NULL PRIMARY KEY,\n"
        "    edge TEXT NOT NULL,\n"
        "    CONSTRAINT ck_timer_horizon_id CHECK (id = 1),\n"
        f"    CONSTRAINT ck_timer_horizon_edge_format CHECK (edge GLOB '{_TIMESTAMP_GLOB}')\n"
        ") STRICT"
    ]
    # Existing timers stay near (far_bucket NULL) and there is no edge yet: the first poll
    # sets one, and only timers written after it may be far.
    for name in (_DUE_INDEX, _TENANT_DUE_INDEX):
        columns, where = _INDEXES[name]
        statements += [
            f"DROP INDEX IF EXISTS {name}",
            f"CREATE INDEX {name} ON {TABLE} ({', '.join(columns)}) WHERE {where}",
        ]
    for name, (columns, where) in _FAR_INDEXES.items():
        statements.append(
            f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} ({', '.join(columns)}) WHERE {where}"
        )
    return statements


def _no_statements(_mode: StoreMode) -> list[str]:
    # Only columns (added unless present): nullable at the end, so SQLite rewrites nothing
    # and existing rows read NULL.
    return []


@attrs.frozen
class Migration:
    """One forward step of the schema; ``statements`` may differ by mode, never by data.

    ``columns`` are ``(table, column, declaration)`` added with ``ALTER TABLE`` unless the
    table has them already (one made from :data:`metadata` by a host does).
    """

    version: int
    description: str
    statements: Callable[[StoreMode], Sequence[str]]
    columns: tuple[tuple[str, str, str], ...] = ()


# Append only: a released step is never edited, a change is a new step.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "create timer_schedules with its indexes", _create_table_v1),
    Migration(
        2,
        "command positions: timer_schedules.command_position and timer_tombstones",
        _command_order_v2,
        columns=((TABLE, "command_position", "INTEGER"),),
    ),
    Migration(
        3,
        "tenant fairness: idx_timer_schedules_tenant_due replaces idx_timer_schedules_due_at",
        _tenant_due_v3,
    ),
    Migration(
        4,
        "keep the W3C trace context a timer was scheduled with",
        _no_statements,
        columns=((TABLE, "traceparent", "TEXT"), (TABLE, "tracestate", "TEXT")),
    ),
    Migration(
        5,
        "timers far ahead kept out of the due-order indexes: far_bucket, timer_horizon, "
        "idx_timer_schedules_far, idx_timer_schedules_far_tenant",
        _far_apart_v5,
        columns=((TABLE, "far_bucket", "TEXT"),),
    ),
)
assert [m.version for m in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The schema version this package writes; a database at a higher version is refused."""


def timer_schedules_table(metadata: sa.MetaData, *, mode: StoreMode = "standalone") -> sa.Table:
    """Define ``timer_schedules`` (and the version table) in ``metadata``, e.g. a host's own.

    In ``shared`` mode the table references the host's ``service_calls`` table, which must
    be defined in the same metadata for ``create_all`` to order the two.
    """
    args: list[sa.schema.SchemaItem] = [
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("service_call_id", sa.Text, nullable=False),
        sa.Column("correlation_id", sa.Text, nullable=True),
        sa.Column("due_at", sa.Text, nullable=False),
        sa.Column("registered_at", sa.Text, nullable=False),
        sa.Column("reached_at", sa.Text, nullable=True),
        sa.Column("state", sa.Text, nullable=False, server_default=sa.text("'Scheduled'")),
        sa.Column("command_position", sa.Integer, nullable=True),
        sa.Column("traceparent", sa.Text, nullable=True),
        sa.Column("tracestate", sa.Text, nullable=True),
        sa.Column("far_bucket", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", "service_call_id", name="pk_timer_schedules"),
    ]
    if mode == "shared":
        args.append(
            sa.ForeignKeyConstraint(
                ["tenant_id", "service_call_id"],
                ["service_calls.tenant_id", "service_calls.service_call_id"],
                ondelete="CASCADE",
                name="fk_timer_schedules_service_call",
            )
        )
    args += [sa.CheckConstraint(check, name=name) for name, check in _CHECKS.items()]
    for name, (columns, where) in _INDEXES.items():
        if where is None:
            args.append(sa.Index(name, *columns))
        else:
            args.append(sa.Index(name, *columns, sqlite_where=sa.text(where)))
    table = sa.Table(TABLE, metadata, *args, sqlite_strict=True)
    sa.Table(
        TOMBSTONES,
        metadata,
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("service_call_id", sa.Text, nullable=False),
        sa.Column("command_position", sa.Integer, nullable=False),
        sa.Column("cancelled_at", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "service_call_id", name="pk_timer_tombstones"),
        sa.CheckConstraint(
            f"cancelled_at GLOB '{_TIMESTAMP_GLOB}'", name="ck_timer_tombstones_cancelled_at_format"
        ),
        sa.Index("idx_timer_tombstones_cancelled_at", "cancelled_at"),
        sqlite_strict=True,
    )
    sa.Table(
        HORIZON,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("edge", sa.Text, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_timer_horizon_id"),
        sa.CheckConstraint(f"edge GLOB '{_TIMESTAMP_GLOB}'", name="ck_timer_horizon_edge_format"),
        sqlite_strict=True,
    )
    # Part of the metadata so a host's Alembic autogenerate does not plan to drop it.
    sa.Table(
        VERSION_TABLE,
        metadata,
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("description", sa.Text, nullable=False),
        sqlite_strict=True,
    )
    return table


metadata = sa.MetaData()
"""The standalone schema as SQLAlchemy metadata (for hosts' Alembic); see also
:func:`timer_schedules_table` for the shared mode."""
timer_schedules = timer_schedules_table(metadata)
"""The standalone ``timer_schedules`` table in :data:`metadata`."""

_PRAGMA_NAME = re.compile(r"[a-z_]+")
_PRAGMA_VALUE = re.compile(r"-?[0-9]+|[A-Za-z_]+")


def create_sqlite_engine(
    path: str | os.PathLike[str],
    *,
    synchronous: Synchronous = "FULL",
    busy_timeout_ms: int = 5000,
    pragmas: Mapping[str, int | str] | None = None,
) -> sa.Engine:
    """An engine whose connections use WAL, ``synchronous``, ``busy_timeout`` and foreign keys.

    The driver's own transaction handling is switched off (``isolation_level=None``): the
    store issues ``BEGIN IMMEDIATE`` itself, so a writer takes the write lock up front and
    waits ``busy_timeout_ms`` for it instead of failing half way through a transaction.
    ``pragmas`` are applied to every connection after those (e.g. ``cache_size``).
    """
    if synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
    if busy_timeout_ms < 0:
        raise ValueError(f"busy_timeout_ms must be >= 0, got {busy_timeout_ms}")
    extra = dict(pragmas or {})
    for name, value in extra.items():
        if not _PRAGMA_NAME.fullmatch(name) or not _PRAGMA_VALUE.fullmatch(str(value)):
            raise ValueError(f"unsupported pragma {name}={value!r}")
    url = sa.URL.create("sqlite", database=os.fspath(path))
    engine = sa.create_engine(url, poolclass=sa.NullPool)

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_connection: object, _record: object) -> None:
        connection = dbapi_connection
        connection.isolation_level = None  # type: ignore[attr-defined]
        (journal,) = connection.execute("PRAGMA journal_mode = WAL").fetchone()  # type: ignore[attr-defined]
        if str(journal).lower() != "wal":
            log.warning("SQLite database %s runs in journal mode %s, not WAL", path, journal)
        statements = [
            f"PRAGMA synchronous = {synchronous}",
            f"PRAGMA busy_timeout = {int(busy_timeout_ms)}",
            "PRAGMA foreign_keys = ON",
        ] + [f"PRAGMA {name} = {value}" for name, value in extra.items()]
        for statement in statements:
            connection.execute(statement)  # type: ignore[attr-defined]

    return engine


def migrate(target: str | os.PathLike[str] | sa.Engine, *, mode: StoreMode = "standalone") -> int:
    """Bring the database up to :data:`SCHEMA_VERSION`; returns the version it is now at.

    ``target`` is a database file path or a SQLite engine. Steps already applied (recorded
    in ``timer_schema_version``) are skipped, so calling it again is harmless; concurrent
    callers serialise on the write lock. Raises :class:`SchemaVersionError` when the database
    is newer than this package, and :class:`StoreError` when ``mode`` does not fit it.
    """
    if isinstance(target, sa.Engine):
        engine, owned, where = target, False, str(target.url.database)
    else:
        engine, owned, where = create_sqlite_engine(target), True, os.fspath(target)
    if engine.dialect.name != "sqlite":
        raise StoreError(f"timer_adapters_sqlite needs a SQLite engine, got {engine.dialect.name}")
    try:
        with engine.connect() as connection:
            return migrate_connection(connection, mode=mode, where=where)
    except StoreError:
        raise
    except Exception as exc:
        raise translate_error(exc, where) from exc
    finally:
        if owned:
            engine.dispose()


def migrate_connection(connection: sa.Connection, *, mode: StoreMode, where: str) -> int:
    """:func:`migrate` on an open connection, in one ``BEGIN IMMEDIATE`` transaction."""
    if mode not in ("standalone", "shared"):
        raise ValueError(f"mode must be 'standalone' or 'shared', got {mode!r}")
    # A host engine may emit its own BEGIN from a "begin" event; only start one if it did not.
    connection.begin()
    driver = connection.connection.driver_connection
    if driver is not None and not driver.in_transaction:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        connection.exec_driver_sql(
            f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} ("
            "version INTEGER PRIMARY KEY, description TEXT NOT NULL) STRICT"
        )
        current = connection.exec_driver_sql(
            f"SELECT coalesce(max(version), 0) FROM {VERSION_TABLE}"
        ).scalar_one()
        if current > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"database {where} has Timer schema version {current}, but this "
                f"timer_adapters_sqlite only knows versions up to {SCHEMA_VERSION}: it was "
                "written by a newer Timer; upgrade timer_adapters_sqlite (refusing to touch it)"
            )
        if mode == "shared" and not _table_exists(connection, "service_calls"):
            raise StoreError(
                f"shared mode needs the host's service_calls (tenant_id, service_call_id) "
                f"table in {where}; create it before starting the timer store"
            )
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for table, column, declaration in migration.columns:
                present = connection.exec_driver_sql(f"PRAGMA table_xinfo({table})").all()
                if all(row[1] != column for row in present):
                    connection.exec_driver_sql(
                        f"ALTER TABLE {table} ADD COLUMN {column} {declaration}"
                    )
            for statement in migration.statements(mode):
                connection.exec_driver_sql(statement)
            connection.execute(
                sa.text(f"INSERT INTO {VERSION_TABLE} (version, description) VALUES (:v, :d)"),
                {"v": migration.version, "d": migration.description},
            )
            log.info(
                "timer schema of %s migrated to version %d (%s)",
                where,
                migration.version,
                migration.description,
            )
        _check_mode(connection, mode, where)
        connection.commit()
    except BaseException:
        connection.rollback()
        raise
    return SCHEMA_VERSION


def check_schema(path: str | os.PathLike[str]) -> int:
    """Check, reading only, that ``path`` holds the current Timer schema; returns its version.

    Nothing is created or changed, not even the file: raises :class:`SchemaNotFound` when
    the file or its Timer schema is missing, :class:`SchemaVersionError` when it is newer
    than this package, and :class:`StoreError` when it is older (it needs migrating).
    """
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise SchemaNotFound(f"no Timer schema in {where}: no such database file")
    uri = Path(where).absolute().as_uri() + "?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as connection:
            found = connection.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)
            ).fetchone()
            version = 0
            if found is not None:
                (version,) = connection.execute(
                    f"SELECT coalesce(max(version), 0) FROM {VERSION_TABLE}"
                ).fetchone()
    except sqlite3.Error as exc:
        raise translate_error(exc, where) from exc
    if version == 0:
        raise SchemaNotFound(f"no Timer schema in {where}")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"database {where} has Timer schema version {version}, but this "
            f"timer_adapters_sqlite only knows versions up to {SCHEMA_VERSION}"
        )
    if version < SCHEMA_VERSION:
        raise StoreError(
            f"database {where} has Timer schema version {version}, not {SCHEMA_VERSION}, "
            "and migrations are turned off"
        )
    return int(version)


def _table_exists(connection: sa.Connection, name: str) -> bool:
    found = connection.execute(
        sa.text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name"),
        {"name": name},
    ).first()
    return found is not None


def _check_mode(connection: sa.Connection, mode: StoreMode, where: str) -> None:
    """Refuse a database whose table was made for the other mode (SQLite cannot alter FKs)."""
    keys = connection.exec_driver_sql(f"PRAGMA foreign_key_list({TABLE})").all()
    shared = any(row[2] == "service_calls" for row in keys)
    if mode == "shared" and not shared:
        raise StoreError(
            f"{TABLE} in {where} was created in standalone mode (no foreign key to "
            "service_calls); open it with mode='standalone'"
        )
    if mode == "standalone" and shared:
        raise StoreError(
            f"{TABLE} in {where} was created in shared mode (it references the host's "
            "service_calls); open it with mode='shared'"
        )
