"""The census of pending timers: how many are overdue or due within a minute, an hour, a day
or later, and how long the oldest overdue one has waited, read from a store that implements
:class:`~timer_core.ports.TimerCensus` at a cost bounded by ``cap`` whatever the table holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timedelta

import attrs

from timer_core import PendingTenant, TenantId, TimerCensus

__all__ = [
    "BUCKETS",
    "Census",
    "TenantCensus",
    "take_census",
    "tenant_census",
]

#: The census buckets: label, and the due range ``(after, until]`` in seconds from now
#: (None: open). ``overdue`` is every pending timer due by now.
BUCKETS: tuple[tuple[str, float | None, float | None], ...] = (
    ("overdue", None, 0.0),
    ("1m", 0.0, 60.0),
    ("1h", 60.0, 3600.0),
    ("1d", 3600.0, 86_400.0),
    ("later", 86_400.0, None),
)


def _at(now: datetime, seconds: float | None) -> datetime | None:
    return None if seconds is None else now + timedelta(seconds=seconds)


@attrs.frozen
class Census:
    """One reading of the census."""

    at: datetime
    counts: dict[str, int]
    """Pending timers per bucket of :data:`BUCKETS`, each counted up to ``cap``."""
    cap: int
    oldest_due_at: datetime | None
    """The earliest due time of any pending timer (None when none is pending)."""
    duration_s: float
    """How long the reading took (its cost to the database, roughly)."""

    @property
    def oldest_overdue_s(self) -> float:
        """How long the oldest overdue timer has waited; 0 when none is overdue."""
        if self.oldest_due_at is None:
            return 0.0
        return max(0.0, (self.at - self.oldest_due_at).total_seconds())

    def capped(self, bucket: str) -> bool:
        """Whether the bucket's count stopped at the cap (there may be more)."""
        return self.counts[bucket] >= self.cap


async def take_census(store: TimerCensus, now: datetime, *, cap: int) -> Census:
    """Count the store's pending timers into :data:`BUCKETS`, each up to ``cap``."""
    started = time.perf_counter()
    counts = {
        name: await store.count_scheduled_due(after=_at(now, low), until=_at(now, high), cap=cap)
        for name, low, high in BUCKETS
    }
    oldest = await store.oldest_scheduled_due_at()
    return Census(now, counts, cap, oldest, time.perf_counter() - started)


@attrs.frozen
class TenantCensus:
    """One tenant's pending timers: its earliest due time and (capped) counts."""

    tenant_id: TenantId
    earliest_due_at: datetime
    pending: int
    overdue: int

    def waited_s(self, now: datetime) -> float:
        """How long its oldest overdue timer has waited; 0 when none is overdue."""
        return max(0.0, (now - self.earliest_due_at).total_seconds())


async def tenant_census(
    store: TimerCensus,
    now: datetime,
    *,
    tenants: int,
    cap: int,
    only: Sequence[TenantId] | None = None,
) -> tuple[list[TenantCensus], bool]:
    """The first ``tenants`` tenants with pending timers (or those of ``only``), each with
    its pending and overdue timers counted up to ``cap``; and whether more tenants were left
    out. Costs a few seeks per tenant and at most ``2 * cap`` index entries each."""
    if only is not None:
        found: list[PendingTenant] = []
        for tenant in sorted(only)[:tenants]:
            earliest = await store.oldest_scheduled_due_at(tenant)
            if earliest is not None:
                found.append(PendingTenant(tenant, earliest))
        more = len(only) > tenants
    else:
        found = list(await store.pending_tenants(limit=tenants + 1))
        more = len(found) > tenants
        found = found[:tenants]
    rows = []
    for pending in found:
        rows.append(
            TenantCensus(
                pending.tenant_id,
                pending.earliest_due_at,
                await store.count_scheduled_due(
                    after=None, until=None, cap=cap, tenant_id=pending.tenant_id
                ),
                await store.count_scheduled_due(
                    after=None, until=now, cap=cap, tenant_id=pending.tenant_id
                ),
            )
        )
    return rows, more
