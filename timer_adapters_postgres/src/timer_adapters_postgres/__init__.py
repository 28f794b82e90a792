"""Timer's store on PostgreSQL (SQLAlchemy Core + psycopg 3): several instances share one database.

Due timers are claimed with leases, marks are fenced, and schedules wake the other
instances through ``LISTEN``/``NOTIFY``.
"""

from timer_adapters_postgres._listener import ScheduleListener
from timer_adapters_postgres._schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Migration,
    metadata,
    migrate,
    schema_version,
    timer_schedules,
)
from timer_adapters_postgres._store import PostgresTimerStore

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Migration",
    "PostgresTimerStore",
    "ScheduleListener",
    "metadata",
    "migrate",
    "schema_version",
    "timer_schedules",
]
