"""Timer's durable store on SQLite through SQLAlchemy: ``SqliteTimerStore`` and its schema."""

from timer_adapters_sqlite._schema import (
    SCHEMA_VERSION,
    StoreMode,
    Synchronous,
    create_sqlite_engine,
    metadata,
    migrate,
    timer_schedules_table,
)
from timer_adapters_sqlite._store import SqliteTimerStore

__all__ = [
    "SCHEMA_VERSION",
    "SqliteTimerStore",
    "StoreMode",
    "Synchronous",
    "create_sqlite_engine",
    "metadata",
    "migrate",
    "timer_schedules_table",
]
