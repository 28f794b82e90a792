"""SQLite files behind the store's back: the schema made by the store's own migrations, timers
preloaded in bulk, states counted, lateness read back; and the hand-written statements of the
raw yardsticks (the store's work, written here from the schema, not taken from the adapter).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from timer_adapters_sqlite import migrate
from timer_bench.kit import TENANTS, epoch_ms, now_ms, stamp
from timer_bench.procs import CheckFailed

TABLE = "timer_schedules"
Row = tuple[str, str, str | None, str, str]
"""A timer as raw insert parameters: tenant, service call, correlation, due at, registered at."""

# The statements of the raw yardsticks: what the store's work is, at its simplest.
INSERT = (
    f"INSERT INTO {TABLE} (tenant_id, service_call_id, correlation_id, due_at, registered_at) "
    "VALUES (?, ?, ?, ?, ?)"
)
UPSERT = f"""
INSERT INTO {TABLE} (tenant_id, service_call_id, correlation_id, due_at, registered_at, state)
VALUES (?, ?, ?, ?, ?, 'Scheduled')
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    due_at = excluded.due_at, correlation_id = excluded.correlation_id,
    registered_at = excluded.registered_at
WHERE {TABLE}.state = 'Scheduled'
"""
FIND_DUE = f"""
SELECT tenant_id, service_call_id, correlation_id, due_at FROM {TABLE}
INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ?
ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
NEXT_DUE = f"""
SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL
"""
MARK_REACHED = f"""
UPDATE {TABLE} SET state = 'Reached', reached_at = ?
WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled' AND due_at = ?
"""
_ANY_DUE = f"""
SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ? LIMIT 1
"""


def connect(path: Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute(f"PRAGMA synchronous = {synchronous}")
    connection.execute("PRAGMA busy_timeout = 10000")
    return connection


def create(path: Path) -> Path:
    """An empty database at the current schema, made by the store's own migrations."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    migrate(path)
    return path


def timer_rows(
    count: int, *, prefix: str, due_ms: Callable[[int], int], registered_ms: int | None = None
) -> Iterator[Row]:
    """``count`` distinct timers over the kit's tenants."""
    registered = stamp(now_ms() if registered_ms is None else registered_ms)
    for i in range(count):
        yield (
            f"tenant-{i % TENANTS:02d}",
            f"{prefix}-{i:08d}",
            f"trace-{prefix}-{i:08d}",
            stamp(due_ms(i)),
            registered,
        )


def insert_rows(path: Path, rows: Iterable[Row], *, rebuild_indexes: bool = False) -> None:
    """Timers written behind the service's back in one transaction. ``rebuild_indexes``
    drops the indexes first and builds them after: the same indexes, made several times
    faster by sorting than by a million inserts."""
    connection = connect(path)
    try:
        connection.execute("PRAGMA cache_size = -262144")
        indexes = connection.execute(
            "SELECT name, sql FROM sqlite_master "
            f"WHERE type = 'index' AND tbl_name = '{TABLE}' AND sql IS NOT NULL"
        ).fetchall()
        connection.execute("BEGIN IMMEDIATE")
        if rebuild_indexes:
            for name, _ in indexes:
                connection.execute(f"DROP INDEX {name}")
        connection.executemany(INSERT, rows)
        if rebuild_indexes:
            for _, sql in indexes:
                connection.execute(sql)
        connection.execute("COMMIT")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()


def insert_overdue(path: Path, prefix: str, count: int) -> None:
    """``count`` timers due over the last hour, in due order of their ids."""
    base = now_ms() - 3_600_000
    rows = timer_rows(
        count, prefix=prefix, due_ms=lambda i: base + (i * 3_599_000) // count, registered_ms=base
    )
    insert_rows(path, rows)


def state_counts(path: Path) -> dict[str, int]:
    connection = connect(path)
    try:
        return dict(connection.execute(f"SELECT state, count(*) FROM {TABLE} GROUP BY state"))
    finally:
        connection.close()


def any_due(path: Path) -> bool:
    connection = connect(path)
    try:
        return connection.execute(_ANY_DUE, (stamp(now_ms()),)).fetchone() is not None
    finally:
        connection.close()


def reached_lateness(path: Path) -> tuple[list[float], int]:
    """``reachedAt - dueAt`` in ms of every Reached timer, and how many fired early."""
    connection = connect(path)
    try:
        lateness = [
            epoch_ms(reached) - epoch_ms(due)
            for due, reached in connection.execute(
                f"SELECT due_at, reached_at FROM {TABLE} WHERE state = 'Reached'"
            )
        ]
    finally:
        connection.close()
    return lateness, sum(1 for value in lateness if value < 0)


def first_of(path: Path, column: str, prefix: str | None = None) -> float:
    """The earliest ``registered_at`` or ``reached_at`` (of the ids starting with ``prefix``),
    in epoch ms."""
    connection = connect(path)
    try:
        sql = f"SELECT min({column}) FROM {TABLE}"
        args: tuple[str, ...] = ()
        if prefix is not None:
            sql, args = sql + " WHERE service_call_id GLOB ?", (f"{prefix}-*",)
        (first,) = connection.execute(sql, args).fetchone()
    finally:
        connection.close()
    if first is None:
        raise CheckFailed(f"no timer has a {column}")
    return epoch_ms(first)


async def wait_until_none_due(path: Path, *, within: float, what: str) -> float:
    """Poll (10 ms) until no Scheduled timer is due; returns that moment (epoch seconds)."""
    connection = connect(path)
    deadline = time.monotonic() + within
    try:
        while connection.execute(_ANY_DUE, (stamp(now_ms()),)).fetchone() is not None:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{what}: timers still due after {within:.0f}s")
            await asyncio.sleep(0.01)
        return time.time()
    finally:
        connection.close()
