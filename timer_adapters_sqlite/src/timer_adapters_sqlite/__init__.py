"""Timer's durable store on SQLite through SQLAlchemy: ``SqliteTimerStore``, its schema, and
scheduling inside a host's own transaction (``schedule_in_transaction``)."""

from timer_adapters_sqlite._client import SqliteTimerClient
from timer_adapters_sqlite._in_transaction import cancel_in_transaction, schedule_in_transaction
from timer_adapters_sqlite._schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Migration,
    StoreMode,
    Synchronous,
    create_sqlite_engine,
    metadata,
    migrate,
    timer_schedules,
    timer_schedules_table,
)
from timer_adapters_sqlite._store import SqliteTimerStore

__all__ = [
    "SqliteTimerClient",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Migration",
    "SqliteTimerStore",
    "StoreMode",
    "Synchronous",
    "cancel_in_transaction",
    "create_sqlite_engine",
    "metadata",
    "migrate",
    "timer_schedules",
    "schedule_in_transaction",
    "timer_schedules_table",
]
