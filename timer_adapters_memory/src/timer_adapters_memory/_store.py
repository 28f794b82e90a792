"""A timer store held in process memory: the reference implementation of ``TimerStore``."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import threading
from collections.abc import Collection, Hashable, Mapping, Sequence
from datetime import datetime

import attrs

from timer_adapters_memory._census import MemoryCensus
from timer_core import (
    Clock,
    CommandOutcome,
    CorrelationId,
    DueCursor,
    FindsDueByTenant,
    LeasesClaims,
    ServiceCallId,
    StoreUnavailable,
    SystemClock,
    TenantId,
    TimerEntry,
    TimerKey,
    TimerOperation,
    TimerStore,
)
from timer_core.fair_share import FairShare, longest_waiting_first
from timer_core.instants import require_utc
from timer_core.leases import Lease, claim_token
from timer_core.replay import StoredKey, marked, operation_keys, replay

__all__ = ["LeasingMemoryTimerStore", "MemoryTimerStore"]

_owner_numbers = itertools.count(1)
_FREE = Lease()


class _Storage:
    """The 'database' several store instances can share, so a test can reopen a store.

    The sorted due index mirrors what a SQL adapter's index on ``(due_at, tenant_id,
    service_call_id)`` does, so ``find_due`` costs O(log n + limit), not a full scan.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.timers: dict[TimerKey, TimerEntry] = {}
        self.due_index: list[DueCursor] = []
        # The same per tenant, in (due_at, service_call_id) order: find_due_by_tenant.
        self.tenant_index: dict[TenantId, list[tuple[datetime, ServiceCallId]]] = {}
        # The claim columns of a SQL store, on monotonic seconds (timer_core.leases' rules).
        self.leases: dict[TimerKey, Lease] = {}
        # The highest command position applied per key (PositionedOperation), and the
        # tombstones of positioned cancels: key -> (position, when cancelled).
        self.positions: dict[TimerKey, int | None] = {}
        self.tombstones: dict[TimerKey, tuple[int, datetime]] = {}
        self.unavailable = False
        self.failures_left = 0
        self.failing_methods: frozenset[str] | None = None

    def put(self, entry: TimerEntry) -> None:
        old = self.timers.get(entry.key)
        if old is not None and old.is_scheduled:
            self._unindex(old)
        self.timers[entry.key] = entry
        if entry.is_scheduled:
            bisect.insort(self.due_index, DueCursor.of(entry))
            bisect.insort(
                self.tenant_index.setdefault(entry.tenant_id, []),
                (entry.due_at, entry.service_call_id),
            )

    def delete(self, key: TimerKey) -> None:
        old = self.timers.pop(key)
        self.positions.pop(key, None)
        self.leases.pop(key, None)
        if old.is_scheduled:
            self._unindex(old)

    def drop_lease(self, key: TimerKey) -> None:
        lease = self.leases.get(key)
        if lease is not None:
            self.leases[key] = lease.released()

    def stored_key(self, key: TimerKey) -> StoredKey:
        """What is stored for ``key``, as :func:`~timer_core.replay.replay` reads it."""
        timer = self.timers.get(key)
        tombstone = self.tombstones.get(key)
        return StoredKey(
            None if timer is None else timer.state,
            self.positions.get(key),
            None if tombstone is None else tombstone[0],
        )

    def _unindex(self, entry: TimerEntry) -> None:
        cursor = DueCursor.of(entry)
        at = bisect.bisect_left(self.due_index, cursor)
        # The index and the dict are only changed together under the lock.
        assert self.due_index[at] == cursor
        del self.due_index[at]
        mine = self.tenant_index[entry.tenant_id]
        del mine[bisect.bisect_left(mine, (entry.due_at, entry.service_call_id))]
        if not mine:
            del self.tenant_index[entry.tenant_id]


class MemoryTimerStore(TimerStore, FindsDueByTenant, MemoryCensus):
    """An in-memory, thread-safe :class:`~timer_core.ports.TimerStore`.

    It keeps every promise of the port (it passes :class:`timer_core.testing.TimerStoreContract`)
    and adds controls for tests: :meth:`set_unavailable` and :meth:`fail_next` make calls raise
    :class:`~timer_core.errors.StoreUnavailable` like a database that is down.
    ``MemoryTimerStore(shared_with=other)`` opens a second instance over the same storage, the
    way a restarted service reopens its database file. Like the SQL stores, an instance
    raises ``StoreUnavailable`` before :meth:`start` and after :meth:`aclose` (until started
    again), so a host tested on it does not miss a forgotten ``async with``.

    With ``lease_s`` it leases as the PostgreSQL store does, for tests of several instances
    (it passes :class:`timer_core.testing.TimerStoreLeaseContract`): :meth:`find_due` claims
    the timers it returns for ``lease_s`` seconds of ``clock`` (monotonic time; instances
    over one storage should share the clock), marks and releases are fenced by the claim,
    and each instance is its own owner (``owner_id``, default a new name per instance). Such
    an instance is a :class:`LeasingMemoryTimerStore`, a
    :class:`~timer_core.ports.LeasesClaims`.
    """

    def __new__(cls, *_: object, lease_s: float | None = None, **__: object) -> MemoryTimerStore:
        if lease_s is not None and not issubclass(cls, LeasesClaims):
            if cls is not MemoryTimerStore:
                raise TypeError(
                    f"{cls.__name__} takes a lease_s: subclass LeasingMemoryTimerStore instead"
                )
            cls = LeasingMemoryTimerStore
        return super().__new__(cls)

    def __init__(
        self,
        *,
        shared_with: MemoryTimerStore | None = None,
        lease_s: float | None = None,
        clock: Clock | None = None,
        owner_id: str | None = None,
    ) -> None:
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self._storage: _Storage = _Storage() if shared_with is None else shared_with._storage
        self._not_open: str | None = "not started"
        self._lease_s = lease_s
        self._clock: Clock = clock or SystemClock()
        self._owner = owner_id or f"memory-{next(_owner_numbers)}"

    async def start(self) -> None:
        self._not_open = None

    async def aclose(self) -> None:
        if self._not_open is None:
            self._not_open = "closed"

    def set_unavailable(self, flag: bool) -> None:
        """While ``flag`` is true, every call on any instance over this storage fails."""
        with self._storage.lock:
            self._storage.unavailable = flag

    def fail_next(self, count: int, *, methods: Collection[str] | None = None) -> None:
        """Make the next ``count`` calls (on any instance over this storage) fail.

        With ``methods`` (names such as ``"mark_reached"``), only calls of those count.
        """
        with self._storage.lock:
            self._storage.failures_left = count
            self._storage.failing_methods = None if methods is None else frozenset(methods)

    def entries(self) -> list[TimerEntry]:
        """Every stored timer of every tenant, in key order (for test assertions)."""
        with self._storage.lock:
            return [self._storage.timers[key] for key in sorted(self._storage.timers)]

    def _check(self, method: str) -> _Storage:
        """Raise the error a real store would raise now; called with the lock held."""
        storage = self._storage
        if self._not_open is not None:
            raise StoreUnavailable(f"the memory timer store is {self._not_open}")
        if storage.unavailable:
            raise StoreUnavailable("the memory timer store is unavailable")
        if storage.failures_left > 0 and (
            storage.failing_methods is None or method in storage.failing_methods
        ):
            storage.failures_left -= 1
            raise StoreUnavailable(f"the memory timer store failed {method} on purpose")
        return storage

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        keys = operation_keys(operations)
        # Yield like a real driver would, so concurrent callers interleave between calls.
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("apply")
            # Decided in full before anything is written: atomic.
            replayed = replay(operations, {key: storage.stored_key(key) for key in keys})
            for timer in replayed.inserts + replayed.updates:
                storage.put(timer.entry)
                storage.positions[timer.entry.key] = timer.position
            for timer in replayed.updates:
                storage.drop_lease(timer.entry.key)  # the old claim was for the old due time
            for key in replayed.deletes:
                storage.delete(key)
            for tombstone in replayed.tombstones:
                storage.tombstones[tombstone.key] = (tombstone.position, tombstone.at)
            return replayed.outcomes

    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        key = TimerKey(TenantId(tenant_id), ServiceCallId(service_call_id))
        await asyncio.sleep(0)
        with self._storage.lock:
            return self._check("get").timers.get(key)

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        now = require_utc(now, "now")
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("find_due")
            index = storage.due_index
            start = 0 if after is None else bisect.bisect_right(index, DueCursor(*after))
            leasing = self._lease_s is not None
            instant = self._clock.monotonic() if leasing else 0.0
            found: list[TimerEntry] = []
            for at in range(start, len(index)):
                cursor = index[at]
                if cursor.due_at > now or len(found) >= limit:
                    break
                key = TimerKey(cursor.tenant_id, cursor.service_call_id)
                claimed = self._claimed(storage, key, instant) if leasing else storage.timers[key]
                if claimed is not None:
                    found.append(claimed)
            return found

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        now = require_utc(now, "now")
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("find_due_by_tenant")
            leasing = self._lease_s is not None
            instant = self._clock.monotonic() if leasing else 0.0
            # Where each tenant's due timers start (after its cursor), earliest due first.
            starts: dict[TenantId, int] = {}
            for tenant, index in storage.tenant_index.items():
                cursor = after.get(tenant)
                start = (
                    0
                    if cursor is None
                    else bisect.bisect_right(index, (cursor.due_at, cursor.service_call_id))
                )
                if start < len(index) and index[start][0] <= now:
                    starts[tenant] = start
            plan = FairShare(
                limit,
                longest_waiting_first(
                    {tenant: storage.tenant_index[tenant][at][0] for tenant, at in starts.items()}
                ),
            )
            found: list[TimerEntry] = []
            while shares := plan.next_round():
                taken: dict[TenantId, int] = {}
                for tenant, share in shares:
                    index, at, took = storage.tenant_index[tenant], starts[tenant], 0
                    while took < share and at < len(index) and index[at][0] <= now:
                        key = TimerKey(tenant, index[at][1])
                        at += 1
                        claimed = (
                            self._claimed(storage, key, instant) if leasing else storage.timers[key]
                        )
                        if claimed is not None:
                            found.append(claimed)
                            took += 1
                    starts[tenant], taken[tenant] = at, took
                plan.took(taken)
            found.sort(key=DueCursor.of)
            return found

    def _claimed(self, storage: _Storage, key: TimerKey, instant: float) -> TimerEntry | None:
        """The timer of ``key`` claimed for this instance, carrying its claim (the lease
        token), unless another instance holds a live claim on it."""
        assert self._lease_s is not None
        lease = storage.leases.get(key, _FREE)
        if not lease.claimable_by(self._owner, instant):
            return None
        lease = storage.leases[key] = lease.claimed(self._owner, instant, self._lease_s)
        return attrs.evolve(storage.timers[key], claim=lease.token)

    def _fenced(self, storage: _Storage, key: TimerKey, claim: Hashable | None) -> bool:
        """Whether this instance may no longer mark or release ``key`` (the fence)."""
        if self._lease_s is None:
            return False
        lease = storage.leases.get(key, _FREE)
        return not lease.settles(self._owner, claim, self._clock.monotonic())

    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        tenant_id = TenantId(tenant_id)
        now = require_utc(now, "now")
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("find_due_for_tenant")
            due = [
                entry
                for key, entry in storage.timers.items()
                if key.tenant_id == tenant_id and entry.is_due(now)
            ]
        due.sort(key=DueCursor.of)
        return due[: max(limit, 0)]

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        for entry in entries:
            if entry.reached_at is None:
                raise ValueError(f"mark_reached needs Reached entries, got {entry}")
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("mark_reached")
            changed = 0
            for entry in entries:
                reached = marked(storage.timers.get(entry.key), entry)
                if reached is None or self._fenced(storage, entry.key, entry.claim):
                    continue
                storage.put(reached)
                storage.drop_lease(entry.key)
                changed += 1
            return changed

    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        tenant_id = TenantId(tenant_id)
        correlation_id = CorrelationId(correlation_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("find_by_correlation")
            found = [
                entry
                for key, entry in storage.timers.items()
                if key.tenant_id == tenant_id and entry.correlation_id == correlation_id
            ]
        found.sort(key=lambda entry: entry.key)
        return found

    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        tenant_id = TenantId(tenant_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("list_for_tenant")
            found = [
                entry
                for key, entry in storage.timers.items()
                if key.tenant_id == tenant_id and (after is None or key.service_call_id > after)
            ]
        found.sort(key=lambda entry: entry.service_call_id)
        return found[: max(limit, 0)]

    async def next_due_at(self) -> datetime | None:
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("next_due_at")
            if self._lease_s is None:
                return storage.due_index[0].due_at if storage.due_index else None
            # Timers another instance holds are left out: it is firing them.
            instant = self._clock.monotonic()
            for cursor in storage.due_index:
                key = TimerKey(cursor.tenant_id, cursor.service_call_id)
                if storage.leases.get(key, _FREE).claimable_by(self._owner, instant):
                    return cursor.due_at
            return None

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        tenant_id = TenantId(tenant_id)
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("count_scheduled_for_tenant")
            return len(storage.tenant_index.get(tenant_id, ()))

    async def count_scheduled(self) -> int:
        await asyncio.sleep(0)
        with self._storage.lock:
            return len(self._check("count_scheduled").due_index)

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        reached_before = require_utc(reached_before, "reached_before")
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("purge_reached")
            old = sorted(
                (entry.reached_at, key)
                for key, entry in storage.timers.items()
                if entry.reached_at is not None and entry.reached_at < reached_before
            )
            budget = max(limit, 0)
            for _, key in old[:budget]:
                storage.delete(key)
            deleted = min(len(old), budget)
            tombstones = sorted(
                (at, key) for key, (_, at) in storage.tombstones.items() if at < reached_before
            )
            for _, key in tombstones[: budget - deleted]:
                del storage.tombstones[key]
            return deleted + min(len(tombstones), budget - deleted)


class LeasingMemoryTimerStore(MemoryTimerStore, LeasesClaims):
    """A :class:`MemoryTimerStore` made with ``lease_s``: it claims what it finds."""

    @property
    def claim_lease_s(self) -> float:
        assert self._lease_s is not None
        return self._lease_s

    async def release_claims(self, entries: Sequence[TimerEntry]) -> None:
        await asyncio.sleep(0)
        with self._storage.lock:
            storage = self._check("release_claims")
            for entry in entries:
                token = claim_token(entry)
                current = storage.timers.get(entry.key)
                if token is None or current is None or not current.is_scheduled:
                    continue
                if not self._fenced(storage, entry.key, token):
                    storage.drop_lease(entry.key)
