"""Timer's durable store on SQLite through SQLAlchemy: ``SqliteTimerStore``, its schema, and
scheduling inside a host's own transaction (``schedule_in_transaction``)."""

from timer_adapters_sqlite._schema import (
    SCHEMA_VERSION,
    StoreMode,
    Synchronous,
    create_sqlite_engine,
    metadata,
    migrate,
    timer_schedules_table,
)
from timer_adapters_sqlite._store import (
    SqliteTimerStore,
    cancel_in_transaction,
    schedule_in_transaction,
)

__all__ = [
    "SCHEMA_VERSION",
    "SqliteTimerStore",
    "StoreMode",
    "Synchronous",
    "cancel_in_transaction",
    "create_sqlite_engine",
    "metadata",
    "migrate",
    "schedule_in_transaction",
    "timer_schedules_table",
]
