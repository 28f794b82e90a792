"""A host's own psycopg connection (or Django's wrapper of one) as a writer of timers in its
transaction: the store's SQLAlchemy statements, run through the caller's cursor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import psycopg
import sqlalchemy as sa
import sqlalchemy.orm
from psycopg.rows import namedtuple_row

from timer_adapters_postgres._lanes import pyformat
from timer_core import ConfigurationError, DatabaseWrapper, ValidationError

__all__ = ["HostConnection", "PsycopgWriter", "psycopg_connection"]


#: What ``schedule_in_transaction`` writes through: SQLAlchemy's ``Connection`` or ORM
#: ``Session``, a psycopg ``Connection``, or a wrapper of one (Django's ``connection``).
HostConnection: TypeAlias = (
    sa.Connection | sqlalchemy.orm.Session | psycopg.Connection[Any] | DatabaseWrapper
)


def psycopg_connection(connection: object) -> psycopg.Connection[Any]:
    """The psycopg connection itself, or the one a wrapper (Django's) holds, checked to be
    inside a transaction the caller will end."""
    raw: object = connection
    if not isinstance(connection, psycopg.Connection):
        vendor = getattr(connection, "vendor", None)
        if vendor is None or not hasattr(connection, "ensure_connection"):
            raise ConfigurationError(
                "schedule_in_transaction takes a SQLAlchemy Connection or Session, a psycopg "
                "Connection, or Django's connection; got "
                f"{type(connection).__module__}.{type(connection).__name__}"
            )
        if vendor != "postgresql":
            raise ConfigurationError(
                f"timer_adapters_postgres needs a PostgreSQL connection, got {vendor}"
            )
        connection.ensure_connection()
        raw = getattr(connection, "connection", None)
    if not isinstance(raw, psycopg.Connection):
        raise ConfigurationError(
            f"the connection wraps {type(raw).__name__}, not a psycopg (3) Connection"
        )
    if raw.autocommit:
        raise ValidationError(
            "the psycopg connection is in autocommit mode, so the timer would be committed at "
            "once: schedule inside a transaction (Django: `with transaction.atomic():`; "
            "psycopg: `with connection.transaction():` or autocommit=False)"
        )
    return raw


class _Result:
    """The part of SQLAlchemy's result the write functions read."""

    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self._rows = cursor.fetchall() if cursor.description is not None else []
        self.rowcount = cursor.rowcount

    def all(self) -> list[Any]:
        return self._rows

    def scalar_one(self) -> Any:
        (row,) = self._rows
        return row[0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


class PsycopgWriter:
    """``execute(statement, parameters)`` as SQLAlchemy's ``Connection`` has it, on the
    caller's psycopg connection (in its transaction; nothing is committed here)."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._connection = connection

    def get_execution_options(self) -> Mapping[str, Any]:
        """None of SQLAlchemy's options: the writes run in the caller's transaction."""
        return {}

    def execute(self, statement: sa.TextClause, parameters: Mapping[str, Any]) -> _Result:
        with self._connection.cursor(row_factory=namedtuple_row) as cursor:
            cursor.execute(pyformat(statement), dict(parameters))
            return _Result(cursor)
