"""The SQLite store's census and operator look-ups (``TimerCensus``, ``TimerLookup``): their
statements and the mixin that runs them on the store's reader thread.

Every statement names the index it is served by (``INDEXED BY``, as the poll does), so a
host's ``ANALYZE`` can never turn one into a scan; the query-plan tests prove each plan.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa

from timer_adapters_sqlite._disk import driver_of
from timer_adapters_sqlite._rows import entries_read, entry_from_row, read_timestamp
from timer_adapters_sqlite._schema import TABLE, TOMBSTONES
from timer_adapters_sqlite._sql import BUCKET_CHARS, COLUMNS, EDGE, NEXT_DUE_AT, NEXT_FAR_DUE_AT
from timer_core import (
    CorrelationId,
    DueCursor,
    PendingTenant,
    ServiceCallId,
    TenantId,
    TimerCensus,
    TimerEntry,
    TimerLookup,
    TimerRecord,
    TimerState,
)
from timer_core.instants import format_timestamp, require_utc

__all__ = [
    "COUNT_DUE",
    "COUNT_TENANT_DUE",
    "FIND_BY_CORRELATION_ID",
    "PENDING_TENANTS",
    "SCAN_TENANT",
    "SCAN_TENANT_WINDOW",
    "SCHEDULED_FOR_TENANT",
    "TENANT_OLDEST_DUE",
    "SqliteCensus",
]

T = TypeVar("T")

# Stored timestamps are `YYYY-...Z` text: "" sorts before every one and "~" after.
_LOWEST, _HIGHEST = "", "~"

# A capped count: the inner LIMITs stop the range scans at ?3 entries, so a bucket of ten
# million costs what one of ?3 does. Near timers through the partial due index; far ones
# through the far index (timer_adapters_sqlite._schema), by bucket: the buckets strictly
# inside the range are counted from the index alone, and only the (at most two) buckets the
# range's ends fall in have their timers' due times read.
_BUCKET = f"substr(?{{}}, 1, {BUCKET_CHARS})"
_FAR_IN = (
    f"far_bucket IS NOT NULL AND far_bucket > {_BUCKET.format(1)} "
    f"AND far_bucket < {_BUCKET.format(2)}"
)
COUNT_DUE = f"""
SELECT min(?3, (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
        WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > ?1 AND due_at <= ?2
        LIMIT ?3)
) + (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_far WHERE {_FAR_IN} LIMIT ?3)
) + (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_far
        WHERE far_bucket IS NOT NULL AND far_bucket = {_BUCKET.format(1)}
          AND due_at > ?1 AND due_at <= ?2
        LIMIT ?3)
) + (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_far
        WHERE far_bucket IS NOT NULL AND far_bucket = {_BUCKET.format(2)}
          AND far_bucket > {_BUCKET.format(1)} AND due_at > ?1 AND due_at <= ?2
        LIMIT ?3)
))
"""


# Every far timer is due at or after the edge: a range that ends before it has none, and
# the walk of the tenant's far timers is skipped. An open end ("" or "~") reads no due time
# (SQLite then never fetches the row the index entry points to).
def _reaches_edge(until: str) -> str:
    """Whether a due range ending at ``until`` reaches the edge (else it holds no far timer)."""
    return f"{until} >= ({EDGE})"


_FAR_REACHED = _reaches_edge("?2")
COUNT_TENANT_DUE = f"""
SELECT min(?3, (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
        WHERE tenant_id = ?4 AND state = 'Scheduled' AND far_bucket IS NULL
          AND due_at > ?1 AND due_at <= ?2
        LIMIT ?3)
) + (
    SELECT count(*) FROM (
        SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_far_tenant
        WHERE tenant_id = ?4 AND far_bucket IS NOT NULL AND {_FAR_REACHED}
          AND (?1 = '{_LOWEST}' OR due_at > ?1) AND (?2 = '{_HIGHEST}' OR due_at <= ?2)
        LIMIT ?3)
))
"""


def _earliest_of_tenant(tenant: str) -> str:
    """The earliest due time of ``tenant``'s pending timers: its first near one when that is
    before the edge, else the earlier of it and its far ones (a walk of those)."""
    near = (
        f"SELECT min(due_at) AS d FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due "
        f"WHERE tenant_id = {tenant} AND state = 'Scheduled' AND far_bucket IS NULL"
    )
    far = (
        f"SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_far_tenant "
        f"WHERE tenant_id = {tenant} AND far_bucket IS NOT NULL"
    )
    return (
        f"(SELECT CASE WHEN near.d < ({EDGE}) THEN near.d "
        f"ELSE (SELECT min(x) FROM (SELECT near.d AS x UNION ALL {far})) END "
        f"FROM ({near}) AS near)"
    )


TENANT_OLDEST_DUE = f"SELECT {_earliest_of_tenant('?1')}"


def _next_tenant(after: str) -> str:
    """The first tenant after ``after`` with pending timers, near or far (NULL: none)."""
    near = (
        f"(SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due "
        f"WHERE state = 'Scheduled' AND far_bucket IS NULL AND tenant_id > {after})"
    )
    far = (
        f"(SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_far_tenant "
        f"WHERE far_bucket IS NOT NULL AND tenant_id > {after})"
    )
    return f"min(coalesce({near}, {far}), coalesce({far}, {near}))"


# The tenants with pending timers after ?1, by a loose scan of the tenant-first partial
# indexes (a seek or two per tenant), with each one's earliest due time, up to ?2 tenants.
PENDING_TENANTS = f"""
WITH RECURSIVE pending(tenant_id, n) AS (
    SELECT {_next_tenant("?1")}, 1
  UNION ALL
    SELECT {_next_tenant("pending.tenant_id")}, n + 1
    FROM pending WHERE pending.tenant_id IS NOT NULL AND n < ?2
)
SELECT tenant_id, {_earliest_of_tenant("pending.tenant_id")}
FROM pending WHERE tenant_id IS NOT NULL
"""
# The tenant's near timers in the range, and its far ones (sorted: a walk of them, unless
# the range ends before the edge), merged.
SCHEDULED_FOR_TENANT = f"""
SELECT * FROM (
    SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
    WHERE tenant_id = ?1 AND state = 'Scheduled' AND far_bucket IS NULL
      AND due_at >= ?2 AND due_at <= ?3 AND (due_at, service_call_id) > (?4, ?5)
    ORDER BY due_at, service_call_id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_far_tenant
    WHERE tenant_id = ?1 AND far_bucket IS NOT NULL
      AND {_reaches_edge("?3")}
      AND due_at >= ?2 AND due_at <= ?3 AND (due_at, service_call_id) > (?4, ?5)
    ORDER BY due_at, service_call_id LIMIT ?6)
ORDER BY due_at, service_call_id LIMIT ?6
"""
# The next ?3 keys of the tenant after ?2 (primary key order) are the window; of them, those
# in state ?4 (NULL: either) due within [?5, ?6], up to ?7. Only those become rows.
SCAN_TENANT = f"""
SELECT {COLUMNS} FROM (
    SELECT * FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id > ?2
    ORDER BY service_call_id LIMIT ?3
) WHERE (?4 IS NULL OR state = ?4) AND due_at >= ?5 AND due_at <= ?6
ORDER BY service_call_id LIMIT ?7
"""
# How many keys the window held and its last one, from the primary key alone.
SCAN_TENANT_WINDOW = f"""
SELECT count(*), max(service_call_id) FROM (
    SELECT service_call_id FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id > ?2
    ORDER BY service_call_id LIMIT ?3
)
"""
FIND_BY_CORRELATION_ID = f"""
SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_correlation_id
WHERE correlation_id = ?1 ORDER BY tenant_id, service_call_id LIMIT ?2
"""
_RECORD = f"""
SELECT {COLUMNS}, command_position FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id = ?2
"""
_TOMBSTONE = f"""
SELECT command_position, cancelled_at FROM {TOMBSTONES}
WHERE tenant_id = ?1 AND service_call_id = ?2
"""


def edge_of(driver: Any) -> str | None:
    row = driver.execute(EDGE).fetchone()
    return None if row is None else str(row[0])


def stored_edge(connection: sa.Connection) -> datetime | None:
    edge = edge_of(driver_of(connection))
    return None if edge is None else read_timestamp(edge)


def earliest_due(connection: sa.Connection) -> datetime | None:
    """The earliest pending due time: the first near one when it is before the edge (every
    far one is at or after it), else the earlier of it and the first far one."""
    driver = driver_of(connection)
    (near,) = driver.execute(NEXT_DUE_AT).fetchone()
    edge = edge_of(driver)
    if near is not None and (edge is None or near < edge):
        return read_timestamp(near)
    (far,) = driver.execute(NEXT_FAR_DUE_AT).fetchone()
    found = [due for due in (near, far) if due is not None]
    return read_timestamp(min(found)) if found else None


def _bound(value: datetime | None, open_end: str) -> str:
    return open_end if value is None else format_timestamp(require_utc(value))


class SqliteCensus(TimerCensus, TimerLookup):
    """``TimerCensus`` and ``TimerLookup`` for :class:`SqliteTimerStore` (its reader thread)."""

    async def _read(self, fn: Callable[[sa.Connection], T]) -> T:
        raise NotImplementedError  # the store's own

    async def count_scheduled_due(
        self,
        *,
        after: datetime | None,
        until: datetime | None,
        cap: int,
        tenant_id: TenantId | None = None,
    ) -> int:
        args: tuple[object, ...] = (_bound(after, _LOWEST), _bound(until, _HIGHEST), max(cap, 0))
        sql = COUNT_DUE
        if tenant_id is not None:
            sql, args = COUNT_TENANT_DUE, (*args, TenantId(tenant_id))

        def count(connection: sa.Connection) -> int:
            return int(driver_of(connection).execute(sql, args).fetchone()[0])

        return await self._read(count)

    async def oldest_scheduled_due_at(self, tenant_id: TenantId | None = None) -> datetime | None:
        if tenant_id is None:
            return await self._read(earliest_due)
        sql, args = TENANT_OLDEST_DUE, (TenantId(tenant_id),)

        def oldest(connection: sa.Connection) -> datetime | None:
            (due_at,) = driver_of(connection).execute(sql, args).fetchone()
            return None if due_at is None else read_timestamp(due_at)

        return await self._read(oldest)

    async def pending_tenants(
        self, *, limit: int, after: TenantId | None = None
    ) -> list[PendingTenant]:
        if limit <= 0:
            return []
        args = (_LOWEST if after is None else TenantId(after), limit)

        def tenants(connection: sa.Connection) -> list[PendingTenant]:
            rows = driver_of(connection).execute(PENDING_TENANTS, args).fetchall()
            return [PendingTenant(TenantId(row[0]), read_timestamp(row[1])) for row in rows]

        return await self._read(tenants)

    async def scheduled_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        due_from: datetime | None,
        due_until: datetime | None,
        limit: int,
        after: DueCursor | None = None,
    ) -> list[TimerEntry]:
        if limit <= 0:
            return []
        cursor = (
            (_LOWEST, _LOWEST)
            if after is None
            else (format_timestamp(require_utc(after.due_at)), ServiceCallId(after.service_call_id))
        )
        args = (
            TenantId(tenant_id),
            _bound(due_from, _LOWEST),
            _bound(due_until, _HIGHEST),
            *cursor,
            limit,
        )
        return await self._read(entries_read(SCHEDULED_FOR_TENANT, args))

    async def scan_tenant(
        self,
        tenant_id: TenantId,
        *,
        state: TimerState | None,
        due_from: datetime | None,
        due_until: datetime | None,
        limit: int,
        scan: int,
        after: ServiceCallId | None = None,
    ) -> tuple[list[TimerEntry], ServiceCallId | None]:
        window = (
            TenantId(tenant_id),
            _LOWEST if after is None else ServiceCallId(after),
            max(scan, 0),
        )
        args = (
            *window,
            None if state is None else TimerState(state).value,
            _bound(due_from, _LOWEST),
            _bound(due_until, _HIGHEST),
            max(limit, 0),
        )

        def find(connection: sa.Connection) -> tuple[list[TimerEntry], ServiceCallId | None]:
            driver = driver_of(connection)
            found = [entry_from_row(row) for row in driver.execute(SCAN_TENANT, args)]
            if limit > 0 and len(found) == limit:
                return found, found[-1].service_call_id
            read, last = driver.execute(SCAN_TENANT_WINDOW, window).fetchone()
            return found, (ServiceCallId(last) if read == scan and last is not None else None)

        return await self._read(find)

    async def find_by_correlation_id(
        self, correlation_id: CorrelationId, *, limit: int
    ) -> list[TimerEntry]:
        args = (CorrelationId(correlation_id), max(limit, 0))
        return await self._read(entries_read(FIND_BY_CORRELATION_ID, args))

    async def timer_record(
        self, tenant_id: TenantId, service_call_id: ServiceCallId
    ) -> TimerRecord:
        key = (TenantId(tenant_id), ServiceCallId(service_call_id))

        def record(connection: sa.Connection) -> TimerRecord:
            driver = driver_of(connection)
            row = driver.execute(_RECORD, key).fetchone()
            tombstone = driver.execute(_TOMBSTONE, key).fetchone()
            return TimerRecord(
                *key,
                entry=None if row is None else entry_from_row(row[:-1]),
                command_position=None if row is None else row[-1],
                cancelled_at=None if tombstone is None else read_timestamp(tombstone[1]),
                cancel_position=None if tombstone is None else tombstone[0],
            )

        return await self._read(record)
