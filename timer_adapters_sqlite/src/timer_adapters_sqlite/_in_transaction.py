"""Scheduling inside a host's own transaction: the timer exists if and only if it commits."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any, TypeAlias

import sqlalchemy as sa
import sqlalchemy.exc
import sqlalchemy.orm

from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._writes import Batch, batch_of, write_batches
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ConfigurationError,
    DatabaseWrapper,
    ScheduleTimer,
    StoreError,
    TimerKey,
    ValidationError,
)
from timer_core.commands import scheduled_entry

__all__ = ["HostConnection", "cancel_in_transaction", "schedule_in_transaction"]


#: What the functions here write through: SQLAlchemy's ``Connection`` or ORM ``Session``, a
#: plain ``sqlite3.Connection``, or a wrapper of one (Django's ``connection``).
HostConnection: TypeAlias = (
    sa.Connection | sqlalchemy.orm.Session | sqlite3.Connection | DatabaseWrapper
)


def schedule_in_transaction(
    connection: HostConnection,
    command: ScheduleTimer,
    *,
    now: datetime,
    correlation_id: str | None = None,
) -> CommandOutcome:
    """Schedule (or reschedule) a timer inside the caller's own transaction on the database.

    The timer exists if and only if that transaction commits; a running
    :class:`SqliteTimerStore` on the same file notices the commit within its
    ``watch_interval_s`` and wakes its worker (see ``watch_remote_schedules``). ``now`` is the
    caller's clock reading (the timer's ``registered_at``); adapters never read the clock.
    ``connection`` is on the store's SQLite file: a SQLAlchemy :class:`~sqlalchemy.Connection`
    or ORM :class:`~sqlalchemy.orm.Session`, with any driver (a transaction is begun if none
    is; on SQLAlchemy's asyncio API, call this through ``run_sync``), a plain
    :class:`sqlite3.Connection` (the write opens its implicit transaction; the caller
    commits), or a wrapper of one such as Django's ``django.db.connection`` inside
    ``transaction.atomic()``. The timer schema must be there (start the store once, or
    call :func:`migrate`). The correlation id is ``correlation_id`` or the command's own.

    Returns ``SCHEDULED``, or ``IGNORED_REACHED`` when the timer already fired (it is never
    re-armed). Raises :class:`~timer_core.errors.ValidationError` when the connection runs
    without transactions (the timer would be committed at once),
    :class:`~timer_core.errors.ConfigurationError` for a connection to another database,
    and :class:`~timer_core.errors.StoreError` (``StoreUnavailable`` when the database is
    locked) when the write fails; the caller's transaction is then theirs to roll back.
    """
    entry = scheduled_entry(command, now, correlation_id=correlation_id)
    (outcome,) = _write_in_transaction(connection, batch_of([entry]))
    return outcome


def cancel_in_transaction(connection: HostConnection, command: CancelTimer) -> CommandOutcome:
    """Cancel a ``Scheduled`` timer inside the caller's own transaction (see
    :func:`schedule_in_transaction`): ``CANCELLED`` once that commits, or ``CANCEL_NOOP``
    when the timer is unknown or already fired."""
    key = TimerKey(command.tenant_id, command.service_call_id)
    (outcome,) = _write_in_transaction(connection, batch_of([key]))
    return outcome


def _write_in_transaction(connection: HostConnection, batch: Batch) -> list[CommandOutcome]:
    if isinstance(connection, sqlalchemy.orm.Session):
        connection = connection.connection()
    if not isinstance(connection, sa.Connection):
        return _write_through_dbapi(_dbapi_connection(connection), batch)
    if connection.dialect.name != "sqlite":
        raise ConfigurationError(
            f"timer_adapters_sqlite needs a SQLite connection, got {connection.dialect.name}"
        )
    if not connection.in_transaction():
        connection.begin()
    where = str(connection.engine.url.database)
    # The driver's own view (sqlite3 or aiosqlite): SQLAlchemy's transaction is only a
    # promise when the driver runs without transactions (isolation_level=None).
    driver = connection.connection.driver_connection
    if not getattr(driver, "in_transaction", True) and (
        getattr(driver, "isolation_level", "") is None
    ):
        raise ValidationError(
            f"the connection to {where} runs without transactions (its sqlite3 connection has "
            "isolation_level=None, as SqliteTimerStore.engine's do) and none is open, so the "
            "timer would be committed at once: use an engine of your own "
            "(sqlalchemy.create_engine('sqlite:///...')) or open one with BEGIN first"
        )
    try:
        return write_batches(_HostCursor(connection), [batch])
    except sqlalchemy.exc.DBAPIError as exc:
        error = translate_error(exc, where)
        if "no such table" in str(exc.orig):
            error = StoreError(f"{error} (start a SqliteTimerStore on it once, or call migrate())")
        raise error from exc


def _dbapi_connection(connection: object) -> sqlite3.Connection:
    """The sqlite3 connection itself, or the one a wrapper (Django's) holds."""
    if isinstance(connection, sqlite3.Connection):
        return connection
    vendor = getattr(connection, "vendor", None)
    if vendor is None or not hasattr(connection, "ensure_connection"):
        raise ConfigurationError(
            "schedule_in_transaction takes a SQLAlchemy Connection or Session, a "
            "sqlite3.Connection, or Django's connection; got "
            f"{type(connection).__module__}.{type(connection).__name__}"
        )
    if vendor != "sqlite":
        raise ConfigurationError(f"timer_adapters_sqlite needs a SQLite connection, got {vendor}")
    connection.ensure_connection()
    raw = connection.connection  # type: ignore[attr-defined]
    if not isinstance(raw, sqlite3.Connection):
        raise ConfigurationError(f"the connection wraps {type(raw).__name__}, not sqlite3")
    return raw


def _write_through_dbapi(raw: sqlite3.Connection, batch: Batch) -> list[CommandOutcome]:
    # Without a transaction open and with the module's implicit ones off (isolation_level
    # None: Django outside transaction.atomic()), each statement would commit on its own.
    autocommit = getattr(raw, "autocommit", None) is True or raw.isolation_level is None
    if not raw.in_transaction and autocommit:
        raise ValidationError(
            "the sqlite3 connection is in autocommit mode and no transaction is open, so the "
            "timer would be committed at once: schedule inside a transaction (Django: "
            "`with transaction.atomic():`; sqlite3: BEGIN first, or the default isolation_level)"
        )
    cursor = raw.cursor()
    try:
        return write_batches(cursor, [batch])
    except sqlite3.Error as exc:
        error = translate_error(exc, "the caller's connection")
        if "no such table" in str(exc):
            error = StoreError(f"{error} (start a SqliteTimerStore on it once, or call migrate())")
        raise error from exc
    finally:
        cursor.close()


class _HostCursor:
    """A cursor over a host's SQLAlchemy connection: statements run through the connection
    (its events and logging see them), whatever the SQLite driver, sync or under
    ``run_sync`` of SQLAlchemy's asyncio API."""

    def __init__(self, connection: sa.Connection) -> None:
        self._connection = connection
        self._result: sa.CursorResult[Any] | None = None

    @property
    def rowcount(self) -> int:
        return -1 if self._result is None else self._result.rowcount

    def execute(self, sql: str, parameters: Any = (), /) -> _HostCursor:
        self._result = self._connection.exec_driver_sql(sql, tuple(parameters))
        return self

    def executemany(self, sql: str, parameters: Any, /) -> _HostCursor:
        self._result = self._connection.exec_driver_sql(sql, list(parameters))
        return self

    def fetchone(self) -> Any:
        return None if self._result is None else self._result.fetchone()

    def fetchall(self) -> list[Any]:
        return [] if self._result is None else list(self._result.fetchall())
