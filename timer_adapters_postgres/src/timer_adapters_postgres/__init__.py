"""Timer's store on PostgreSQL (SQLAlchemy Core + psycopg 3): several instances share one database.

Due timers are claimed with leases, marks are fenced, and schedules wake the other
instances through ``LISTEN``/``NOTIFY``; the database's clock decides when timers are due
for all of them (:class:`DatabaseClock`); a host schedules inside its own transaction with
``schedule_in_transaction``.
"""

from timer_adapters_postgres._client import PostgresTimerClient
from timer_adapters_postgres._clock import DatabaseClock
from timer_adapters_postgres._listener import ScheduleListener
from timer_adapters_postgres._schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Migration,
    metadata,
    migrate,
    schema_version,
    timer_schedules,
    timer_tombstones,
)
from timer_adapters_postgres._store import PostgresTimerStore
from timer_adapters_postgres._writes import cancel_in_transaction, schedule_in_transaction

__all__ = [
    "PostgresTimerClient",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "DatabaseClock",
    "Migration",
    "PostgresTimerStore",
    "ScheduleListener",
    "cancel_in_transaction",
    "metadata",
    "migrate",
    "schedule_in_transaction",
    "schema_version",
    "timer_schedules",
    "timer_tombstones",
]
