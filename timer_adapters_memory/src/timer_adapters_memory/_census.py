"""The memory store's census and operator look-ups (``TimerCensus``, ``TimerLookup``): a mixin
over the store's indexes, read under its lock."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from timer_core import (
    CorrelationId,
    DueCursor,
    PendingTenant,
    ServiceCallId,
    TenantId,
    TimerCensus,
    TimerEntry,
    TimerKey,
    TimerLookup,
    TimerRecord,
    TimerState,
)
from timer_core.instants import require_utc

if TYPE_CHECKING:
    from timer_adapters_memory._store import _Storage

__all__ = ["MemoryCensus"]


class MemoryCensus(TimerCensus, TimerLookup):
    """``TimerCensus`` and ``TimerLookup`` for :class:`MemoryTimerStore` (its storage)."""

    _storage: _Storage

    def _check(self, method: str) -> _Storage:
        raise NotImplementedError  # the store's own

    async def count_scheduled_due(
        self,
        *,
        after: datetime | None,
        until: datetime | None,
        cap: int,
        tenant_id: TenantId | None = None,
    ) -> int:
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("count_scheduled_due")
            if tenant_id is None:
                index: Sequence[tuple[Any, ...]] = storage.due_index
            else:
                index = storage.tenant_index.get(TenantId(tenant_id), [])
            low = (
                0
                if after is None
                else bisect.bisect_right(index, (require_utc(after), "\U0010ffff"))
            )
            high = (
                len(index)
                if until is None
                else bisect.bisect_right(index, (require_utc(until), "\U0010ffff"))
            )
            return max(0, min(cap, high - low))

    async def oldest_scheduled_due_at(self, tenant_id: TenantId | None = None) -> datetime | None:
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("oldest_scheduled_due_at")
            if tenant_id is not None:
                mine = storage.tenant_index.get(TenantId(tenant_id))
                return mine[0][0] if mine else None
            return storage.due_index[0].due_at if storage.due_index else None

    async def pending_tenants(
        self, *, limit: int, after: TenantId | None = None
    ) -> list[PendingTenant]:
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("pending_tenants")
            tenants = sorted(t for t in storage.tenant_index if after is None or t > after)
            return [
                PendingTenant(tenant, storage.tenant_index[tenant][0][0])
                for tenant in tenants[: max(limit, 0)]
            ]

    async def scheduled_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        due_from: datetime | None,
        due_until: datetime | None,
        limit: int,
        after: DueCursor | None = None,
    ) -> list[TimerEntry]:
        tenant_id = TenantId(tenant_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("scheduled_for_tenant")
            index = storage.tenant_index.get(tenant_id, [])
            start = 0 if due_from is None else bisect.bisect_left(index, (require_utc(due_from),))
            if after is not None:
                start = max(
                    start, bisect.bisect_right(index, (after.due_at, after.service_call_id))
                )
            found: list[TimerEntry] = []
            for due_at, call in index[start:]:
                if len(found) >= limit or (due_until is not None and due_at > due_until):
                    break
                found.append(storage.timers[TimerKey(tenant_id, call)])
            return found

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
        tenant_id = TenantId(tenant_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("scan_tenant")
            keys = sorted(
                key.service_call_id
                for key in storage.timers
                if key.tenant_id == tenant_id and (after is None or key.service_call_id > after)
            )
            read = [storage.timers[TimerKey(tenant_id, call)] for call in keys[: max(scan, 0)]]
        found: list[TimerEntry] = []
        for entry in read:
            if (
                (state is None or entry.state is state)
                and (due_from is None or entry.due_at >= due_from)
                and (due_until is None or entry.due_at <= due_until)
            ):
                found.append(entry)
                if len(found) == limit:
                    return found, entry.service_call_id
        return found, (read[-1].service_call_id if len(read) == scan and read else None)

    async def find_by_correlation_id(
        self, correlation_id: CorrelationId, *, limit: int
    ) -> list[TimerEntry]:
        correlation_id = CorrelationId(correlation_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("find_by_correlation_id")
            found = [e for e in storage.timers.values() if e.correlation_id == correlation_id]
        found.sort(key=lambda entry: entry.key)
        return found[: max(limit, 0)]

    async def timer_record(
        self, tenant_id: TenantId, service_call_id: ServiceCallId
    ) -> TimerRecord:
        key = TimerKey(TenantId(tenant_id), ServiceCallId(service_call_id))
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("timer_record")
            tombstone = storage.tombstones.get(key)
            return TimerRecord(
                key.tenant_id,
                key.service_call_id,
                storage.timers.get(key),
                command_position=storage.positions.get(key),
                cancelled_at=None if tombstone is None else tombstone[1],
                cancel_position=None if tombstone is None else tombstone[0],
            )
