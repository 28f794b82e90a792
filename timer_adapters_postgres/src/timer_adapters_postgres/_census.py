"""The PostgreSQL store's census and operator look-ups (``TimerCensus``, ``TimerLookup``):
their statements and the mixin that runs them in the store's threads.

Each is an index walk whose length its arguments bound (the query-plan tests prove it): a
capped count stops after ``cap`` entries of ``ix_timer_schedules_due`` and
``ix_timer_schedules_far``; tenants are found by a loose scan, one seek each. A tenant's
timers due past the far edge (see ._sql) are found through
``ix_timer_schedules_far_tenant``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa

from timer_adapters_postgres._rows import entry_from_row
from timer_adapters_postgres._sql import (
    EARLIEST_OF_NEAR_AND_FAR,
    FAR_BUCKET_INTERVAL,
    LOWEST_FAR,
)
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
from timer_core.instants import require_utc

__all__ = [
    "COUNT_DUE",
    "COUNT_TENANT_DUE",
    "FIND_BY_CORRELATION_ID",
    "OLDEST_DUE",
    "PENDING_TENANTS",
    "SCAN_TENANT",
    "SCAN_TENANT_WINDOW",
    "SCHEDULED_FOR_TENANT",
    "TENANT_OLDEST_DUE",
    "PostgresCensus",
]

_T = TypeVar("_T")
_COLUMNS = (
    "tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at, "
    "traceparent, tracestate"
)
# An open end of a due range: PostgreSQL's infinities sort outside every instant.
_EARLIEST, _LATEST = "-infinity", "infinity"

# Near timers are counted and listed through the due-order indexes, far ones (due at or after
# the far edge, see ._sql) through ix_timer_schedules_far or ix_timer_schedules_far_tenant.
_FAR_RANGE = f"""far_bucket IS NOT NULL
      AND far_bucket > CAST(:after AS timestamptz) - {FAR_BUCKET_INTERVAL}
      AND far_bucket <= CAST(:until AS timestamptz)
      AND due_at > CAST(:after AS timestamptz) AND due_at <= CAST(:until AS timestamptz)"""
_AFTER, _UNTIL = "CAST(:after AS timestamptz)", "CAST(:until AS timestamptz)"
# The inner LIMITs stop the walk of the partial due index after :cap entries; the ORDER BY
# is what keeps it a walk of that index (without it, a range holding most rows is planned as
# a sequential scan, which reads the whole table when the range holds few). Far timers are
# counted in ix_timer_schedules_far: those of the buckets wholly inside the range from the
# index alone (index-only; reading each row's due time took 0.65-1.3 s for a cap of a few
# hundred thousand at 10,000,000 far), those of the bucket at either end of it (where the
# range cuts a bucket) with their due times read (no order there: a sort would be the
# planner's choice where the statistics show few).
COUNT_DUE = sa.text(
    f"""
SELECT count(*) FROM (
    (SELECT 1 FROM timer_schedules
     WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'
       AND due_at > {_AFTER} AND due_at <= {_UNTIL}
     ORDER BY due_at LIMIT :cap)
  UNION ALL
    (SELECT 1 FROM timer_schedules
     WHERE far_bucket > {_AFTER} AND far_bucket <= {_UNTIL} - {FAR_BUCKET_INTERVAL}
     ORDER BY far_bucket LIMIT :cap)
  UNION ALL
    (SELECT 1 FROM timer_schedules
     WHERE far_bucket > {_AFTER} - {FAR_BUCKET_INTERVAL} AND far_bucket <= {_AFTER}
       AND due_at > {_AFTER} AND due_at <= {_UNTIL}
     LIMIT :cap)
  UNION ALL
    (SELECT 1 FROM timer_schedules
     WHERE far_bucket > {_UNTIL} - {FAR_BUCKET_INTERVAL} AND far_bucket <= {_UNTIL}
       AND far_bucket > {_AFTER} AND due_at <= {_UNTIL}
     LIMIT :cap)
  LIMIT :cap
) AS capped
"""
)
# A tenant's far timers: through ix_timer_schedules_far_tenant (or the far index's buckets).
COUNT_TENANT_DUE = sa.text(
    f"""
SELECT count(*) FROM (
    (SELECT 1 FROM timer_schedules
     WHERE tenant_id = :tenant AND state = 'Scheduled' AND far_bucket IS NULL
       AND due_at > CAST(:after AS timestamptz) AND due_at <= CAST(:until AS timestamptz)
     ORDER BY tenant_id, due_at LIMIT :cap)
  UNION ALL
    (SELECT 1 FROM timer_schedules WHERE tenant_id = :tenant AND {_FAR_RANGE} LIMIT :cap)
  LIMIT :cap
) AS capped
"""
)
# Every Scheduled timer, claimed or not (next_due_at leaves out what others hold).
OLDEST_DUE = sa.text(
    f"""
WITH near AS (
    SELECT min(due_at) AS due_at FROM timer_schedules
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'
), {LOWEST_FAR}
SELECT {EARLIEST_OF_NEAR_AND_FAR} FROM near, lowest
"""
)


def _tenant_earliest(tenant: str) -> str:
    """The earliest due time of the tenant ``tenant``, near or far, as a subquery of one row
    (``due_at``) beside ``lowest``: its near one (a seek), and only when that does not come
    before every far timer, its far ones too. OFFSET 0 keeps it one evaluation per tenant."""
    return f"""(
    SELECT CASE
        WHEN lowest.bucket IS NULL OR near.due_at < lowest.bucket THEN near.due_at
        ELSE (SELECT least(near.due_at, min(f.due_at)) FROM timer_schedules AS f
              WHERE f.tenant_id = {tenant} AND f.far_bucket IS NOT NULL)
    END AS due_at
    FROM (SELECT min(s.due_at) AS due_at FROM timer_schedules AS s
          WHERE s.tenant_id = {tenant} AND s.state = 'Scheduled' AND s.far_bucket IS NULL)
        AS near
    OFFSET 0
)"""


TENANT_OLDEST_DUE = sa.text(
    f"""
WITH {LOWEST_FAR}
SELECT e.due_at FROM lowest CROSS JOIN LATERAL {_tenant_earliest(":tenant")} AS e
"""
)


def _next_tenant(after: str) -> str:
    """The tenant after ``after`` with pending timers, near or far: the nearer of a seek
    into each of ix_timer_schedules_tenant_due and ix_timer_schedules_far_tenant (least()
    passes over a NULL)."""
    return f"""least(
        (SELECT tenant_id FROM timer_schedules
         WHERE state = 'Scheduled' AND far_bucket IS NULL AND tenant_id > {after}
         ORDER BY tenant_id, due_at, service_call_id LIMIT 1),
        (SELECT tenant_id FROM timer_schedules
         WHERE far_bucket IS NOT NULL AND tenant_id > {after}
         ORDER BY tenant_id LIMIT 1))"""


# A loose scan of both (each step seeks the next tenant in each), and each tenant's earliest
# due time (a seek into ix_timer_schedules_tenant_due; its far timers read only when it has
# no near one before them).
PENDING_TENANTS = sa.text(
    f"""
WITH RECURSIVE tenants AS (
    SELECT {_next_tenant(":after")} AS tenant_id
  UNION ALL
    SELECT {_next_tenant("p.tenant_id")} FROM tenants AS p WHERE p.tenant_id IS NOT NULL
), {LOWEST_FAR}
SELECT tenants.tenant_id, e.due_at
FROM tenants CROSS JOIN lowest CROSS JOIN LATERAL {_tenant_earliest("tenants.tenant_id")} AS e
WHERE tenants.tenant_id IS NOT NULL
LIMIT :limit
"""
)
# Near ones in the tenant's due order; far ones (ix_timer_schedules_far_tenant) only when the
# near ones do not fill the page with timers due before every far one; the page is sorted
# out of at most twice its size.
SCHEDULED_FOR_TENANT = sa.text(
    f"""
WITH near AS (
    SELECT {_COLUMNS} FROM timer_schedules
    WHERE tenant_id = :tenant AND state = 'Scheduled' AND far_bucket IS NULL
      AND due_at >= CAST(:due_from AS timestamptz)
      AND due_at <= CAST(:due_until AS timestamptz)
      AND (due_at, service_call_id) > (CAST(:after_due AS timestamptz), :after_call)
    ORDER BY tenant_id, due_at, service_call_id LIMIT :limit
), {LOWEST_FAR}
SELECT * FROM (
    SELECT * FROM near
  UNION ALL
    (SELECT {_COLUMNS} FROM timer_schedules
    WHERE tenant_id = :tenant AND far_bucket IS NOT NULL
      AND due_at >= CAST(:due_from AS timestamptz)
      AND due_at <= CAST(:due_until AS timestamptz)
      AND (due_at, service_call_id) > (CAST(:after_due AS timestamptz), :after_call)
      AND ((SELECT count(*) FROM near) < :limit
           OR (SELECT max(due_at) FROM near) >= (SELECT bucket FROM lowest))
    ORDER BY due_at, service_call_id LIMIT :limit)
) AS found
ORDER BY due_at, service_call_id LIMIT :limit
"""
)
# The next :scan keys of the tenant after :after (primary key order) are the window; of them,
# those in :state (NULL: either) due within the range, up to :limit.
SCAN_TENANT = sa.text(
    f"""
SELECT {_COLUMNS} FROM (
    SELECT * FROM timer_schedules WHERE tenant_id = :tenant AND service_call_id > :after
    ORDER BY tenant_id, service_call_id LIMIT :scan
) AS window_ WHERE (CAST(:state AS text) IS NULL OR state = :state)
  AND due_at >= CAST(:due_from AS timestamptz) AND due_at <= CAST(:due_until AS timestamptz)
ORDER BY service_call_id LIMIT :limit
"""
)
SCAN_TENANT_WINDOW = sa.text(
    """
SELECT count(*), max(service_call_id) FROM (
    SELECT service_call_id FROM timer_schedules
    WHERE tenant_id = :tenant AND service_call_id > :after
    ORDER BY tenant_id, service_call_id LIMIT :scan
) AS window_
"""
)
# No index starts with the correlation id (one would cost every write): each tenant is a
# seek into ix_timer_schedules_tenant_correlation, the tenants found by a loose scan of the
# primary key. Its cost grows with the number of tenants; given the tenant, the store's
# find_by_correlation is one seek.
FIND_BY_CORRELATION_ID = sa.text(
    f"""
WITH RECURSIVE tenants AS (
    (SELECT tenant_id FROM timer_schedules ORDER BY tenant_id LIMIT 1)
  UNION ALL
    SELECT f.tenant_id FROM tenants AS p CROSS JOIN LATERAL (
        SELECT tenant_id FROM timer_schedules WHERE tenant_id > p.tenant_id
        ORDER BY tenant_id LIMIT 1
    ) AS f
)
SELECT m.* FROM tenants CROSS JOIN LATERAL (
    SELECT {_COLUMNS} FROM timer_schedules AS s
    WHERE s.tenant_id = tenants.tenant_id AND s.correlation_id = :correlation
    ORDER BY s.tenant_id, s.correlation_id, s.service_call_id LIMIT :limit
) AS m
ORDER BY m.tenant_id, m.service_call_id LIMIT :limit
"""
)
_RECORD = sa.text(
    f"SELECT {_COLUMNS}, command_position FROM timer_schedules "
    "WHERE tenant_id = :tenant AND service_call_id = :call"
)
_TOMBSTONE = sa.text(
    "SELECT command_position, cancelled_at FROM timer_tombstones "
    "WHERE tenant_id = :tenant AND service_call_id = :call"
)


def _bound(value: datetime | None, open_end: str) -> datetime | str:
    return open_end if value is None else require_utc(value)


class PostgresCensus(TimerCensus, TimerLookup):
    """``TimerCensus`` and ``TimerLookup`` for :class:`PostgresTimerStore` (its threads)."""

    async def _run(
        self, action: str, work: Callable[[sa.Connection], _T], *, atomic: bool = False
    ) -> _T:
        raise NotImplementedError  # the store's own

    async def count_scheduled_due(
        self,
        *,
        after: datetime | None,
        until: datetime | None,
        cap: int,
        tenant_id: TenantId | None = None,
    ) -> int:
        params: dict[str, Any] = {
            "after": _bound(after, _EARLIEST),
            "until": _bound(until, _LATEST),
            "cap": max(cap, 0),
        }
        statement = COUNT_DUE
        if tenant_id is not None:
            statement, params["tenant"] = COUNT_TENANT_DUE, TenantId(tenant_id)
        return int(
            await self._run(
                "count pending timers by due time",
                lambda conn: conn.execute(statement, params).scalar_one(),
            )
        )

    async def oldest_scheduled_due_at(self, tenant_id: TenantId | None = None) -> datetime | None:
        statement, params = OLDEST_DUE, {}
        if tenant_id is not None:
            statement, params = TENANT_OLDEST_DUE, {"tenant": TenantId(tenant_id)}
        value = await self._run(
            "read the oldest due time", lambda conn: conn.execute(statement, params).scalar()
        )
        return None if value is None else require_utc(value)

    async def pending_tenants(
        self, *, limit: int, after: TenantId | None = None
    ) -> list[PendingTenant]:
        if limit <= 0:
            return []
        params = {"after": "" if after is None else TenantId(after), "limit": limit}
        rows = await self._run(
            "list tenants with pending timers",
            lambda conn: conn.execute(PENDING_TENANTS, params).all(),
        )
        return [PendingTenant(TenantId(row[0]), require_utc(row[1])) for row in rows]

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
        params: dict[str, Any] = {
            "tenant": TenantId(tenant_id),
            "due_from": _bound(due_from, _EARLIEST),
            "due_until": _bound(due_until, _LATEST),
            "after_due": _EARLIEST if after is None else require_utc(after.due_at),
            "after_call": "" if after is None else ServiceCallId(after.service_call_id),
            "limit": limit,
        }
        rows = await self._run(
            "list a tenant's pending timers",
            lambda conn: conn.execute(SCHEDULED_FOR_TENANT, params).all(),
        )
        return [entry_from_row(row) for row in rows]

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
        window: dict[str, Any] = {
            "tenant": TenantId(tenant_id),
            "after": "" if after is None else ServiceCallId(after),
            "scan": max(scan, 0),
        }
        params = window | {
            "state": None if state is None else TimerState(state).value,
            "due_from": _bound(due_from, _EARLIEST),
            "due_until": _bound(due_until, _LATEST),
            "limit": max(limit, 0),
        }

        def read(conn: sa.Connection) -> tuple[list[Any], Any]:
            rows = list(conn.execute(SCAN_TENANT, params).all())
            if limit > 0 and len(rows) == limit:
                return rows, None
            return rows, conn.execute(SCAN_TENANT_WINDOW, window).one()

        rows, counted = await self._run("page through a tenant's timers", read)
        found = [entry_from_row(row) for row in rows]
        if counted is None:
            return found, found[-1].service_call_id
        read_keys, last = counted
        return found, (ServiceCallId(last) if read_keys == scan and last is not None else None)

    async def find_by_correlation_id(
        self, correlation_id: CorrelationId, *, limit: int
    ) -> list[TimerEntry]:
        params = {"correlation": CorrelationId(correlation_id), "limit": max(limit, 0)}
        rows = await self._run(
            "find timers by correlation id",
            lambda conn: conn.execute(FIND_BY_CORRELATION_ID, params).all(),
        )
        return [entry_from_row(row) for row in rows]

    async def timer_record(
        self, tenant_id: TenantId, service_call_id: ServiceCallId
    ) -> TimerRecord:
        tenant, call = TenantId(tenant_id), ServiceCallId(service_call_id)
        params = {"tenant": tenant, "call": call}

        def read(conn: sa.Connection) -> tuple[Any, Any]:
            return (
                conn.execute(_RECORD, params).first(),
                conn.execute(_TOMBSTONE, params).first(),
            )

        row, tombstone = await self._run("read a timer's record", read)
        return TimerRecord(
            tenant,
            call,
            None if row is None else entry_from_row(row),
            command_position=None if row is None else row.command_position,
            cancelled_at=None if tombstone is None else require_utc(tombstone[1]),
            cancel_position=None if tombstone is None else tombstone[0],
        )
