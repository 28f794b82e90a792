"""The conformance suite of the optional ``TimerCensus`` and ``TimerLookup`` capabilities."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from timer_core._census import TimerCensus, TimerLookup
from timer_core._entry import TimerKey, TimerState
from timer_core._ids import CorrelationId, ServiceCallId, TenantId
from timer_core.ports import DueCursor, PositionedOperation, TimerStore
from timer_core.testing._store_contract import A, B, at, entry, keys

__all__ = ["TimerCensusContract"]


class TimerCensusContract:
    """Conformance tests of a store implementing :class:`~timer_core.ports.TimerCensus` and
    :class:`~timer_core.ports.TimerLookup`; bound like
    :class:`~timer_core.testing.TimerStoreContract`, by overriding ``make_store``."""

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        """The factory hook: override it to return a callable making unstarted stores."""
        raise NotImplementedError("override the make_store fixture to bind TimerCensusContract")

    @pytest_asyncio.fixture
    async def store(self, make_store: Callable[[], TimerStore]) -> AsyncIterator[Any]:
        """A started store over fresh storage with both capabilities, closed after the test."""
        store = make_store()
        assert isinstance(store, TimerCensus)
        assert isinstance(store, TimerLookup)
        await store.start()
        try:
            yield store
        finally:
            await store.aclose()

    async def test_counts_by_due_range(self, store: Any) -> None:
        """A count takes the timers with after < due_at <= until, of every tenant."""
        await store.apply([entry("tenant-a", f"a{i}", i) for i in range(10)])
        await store.apply([entry("tenant-b", "b0", 5)])
        assert await store.count_scheduled_due(after=None, until=at(4), cap=100) == 5
        assert await store.count_scheduled_due(after=at(4), until=at(5), cap=100) == 2
        assert await store.count_scheduled_due(after=at(5), until=None, cap=100) == 4
        assert await store.count_scheduled_due(after=None, until=None, cap=100) == 11

    async def test_count_stops_at_its_cap(self, store: Any) -> None:
        """A range holding more timers than the cap counts as the cap."""
        await store.apply([entry("tenant-a", f"a{i}", i) for i in range(10)])
        assert await store.count_scheduled_due(after=None, until=None, cap=3) == 3

    async def test_count_leaves_out_fired_and_cancelled_timers(self, store: Any) -> None:
        """Reached and cancelled timers are not pending and do not count."""
        first, second = entry("tenant-a", "a0", 1), entry("tenant-a", "a1", 2)
        await store.apply([first, second, entry("tenant-a", "a2", 3)])
        await store.mark_reached([first.reach(at(1))])
        await store.cancel(A, ServiceCallId("a1"))
        assert await store.count_scheduled_due(after=None, until=None, cap=100) == 1

    async def test_count_for_one_tenant(self, store: Any) -> None:
        """With a tenant, only its timers count."""
        await store.apply([entry("tenant-a", "a0", 1), entry("tenant-b", "b0", 1)])
        await store.apply([entry("tenant-b", "b1", 2)])
        counted = await store.count_scheduled_due(after=None, until=at(1), cap=100, tenant_id=B)
        assert counted == 1

    async def test_oldest_scheduled_due_at(self, store: Any) -> None:
        """The oldest pending due time is the earliest Scheduled one (of a tenant's, given
        one), None with none."""
        assert await store.oldest_scheduled_due_at() is None
        await store.apply([entry("tenant-a", "a0", 7), entry("tenant-b", "b0", 3)])
        assert await store.oldest_scheduled_due_at() == at(3)
        assert await store.oldest_scheduled_due_at(A) == at(7)
        assert await store.oldest_scheduled_due_at(TenantId("tenant-z")) is None

    async def test_pending_tenants_in_order_with_earliest_due(self, store: Any) -> None:
        """Tenants with pending timers come in tenant order, each with its earliest due time."""
        await store.apply(
            [entry("tenant-b", "b0", 9), entry("tenant-a", "a0", 4), entry("tenant-a", "a1", 2)]
        )
        await store.apply([entry("tenant-c", "c0", 1)])
        await store.mark_reached([entry("tenant-c", "c0", 1).reach(at(1))])
        tenants = await store.pending_tenants(limit=10)
        assert [(t.tenant_id, t.earliest_due_at) for t in tenants] == [(A, at(2)), (B, at(9))]
        assert [t.tenant_id for t in await store.pending_tenants(limit=1)] == [A]
        assert [t.tenant_id for t in await store.pending_tenants(limit=5, after=A)] == [B]

    async def test_scheduled_for_tenant_pages_in_due_order(self, store: Any) -> None:
        """A tenant's pending timers come in due order within the range, page after page."""
        await store.apply([entry("tenant-a", f"a{i}", 10 - i) for i in range(8)])
        await store.apply([entry("tenant-b", "b0", 5)])
        page = await store.scheduled_for_tenant(A, due_from=at(3), due_until=at(8), limit=3)
        assert keys(page) == [("tenant-a", "a7"), ("tenant-a", "a6"), ("tenant-a", "a5")]
        rest = await store.scheduled_for_tenant(
            A, due_from=at(3), due_until=at(8), limit=10, after=DueCursor.of(page[-1])
        )
        assert keys(rest) == [("tenant-a", "a4"), ("tenant-a", "a3"), ("tenant-a", "a2")]

    async def test_find_by_correlation_id_across_tenants(self, store: Any) -> None:
        """A correlation id finds its timers in every tenant, in key order."""
        await store.apply(
            [
                entry("tenant-b", "b0", 1, correlation="order-1"),
                entry("tenant-a", "a0", 1, correlation="order-1"),
                entry("tenant-a", "a1", 1, correlation="order-2"),
            ]
        )
        found = await store.find_by_correlation_id(CorrelationId("order-1"), limit=10)
        assert keys(found) == [("tenant-a", "a0"), ("tenant-b", "b0")]

    async def test_timer_record_keeps_position_and_tombstone(self, store: Any) -> None:
        """A record holds the timer and its command position, or a cancel's tombstone."""
        timer = entry("tenant-a", "a0", 5)
        await store.apply([PositionedOperation(timer, 7, at(0))])
        record = await store.timer_record(A, ServiceCallId("a0"))
        assert (record.entry, record.command_position, record.cancelled_at) == (timer, 7, None)
        await store.apply([PositionedOperation(TimerKey(A, ServiceCallId("a0")), 9, at(2))])
        record = await store.timer_record(A, ServiceCallId("a0"))
        assert (record.entry, record.cancel_position, record.cancelled_at) == (None, 9, at(2))
        unknown = await store.timer_record(TenantId("tenant-z"), ServiceCallId("x"))
        assert unknown.entry is None
        assert unknown.cancelled_at is None

    async def test_scan_tenant_filters_a_bounded_window(self, store: Any) -> None:
        """A scan reads at most its window of keys, returns the matches in key order, and
        says where to go on: after the last match when the page filled, after the window
        when it did not, nowhere at the tenant's end."""
        timers = [entry("tenant-a", f"a{i}", i) for i in range(10)]
        await store.apply([*timers, entry("tenant-b", "b0", 1)])
        await store.mark_reached(
            [t.reach(at(20)) for t in timers if int(t.service_call_id[1:]) % 3 == 0]
        )
        fired, after = await store.scan_tenant(
            A, state=TimerState.REACHED, due_from=None, due_until=None, limit=2, scan=100
        )
        assert (keys(fired), after) == ([("tenant-a", "a0"), ("tenant-a", "a3")], "a3")
        window, after = await store.scan_tenant(
            A, state=TimerState.REACHED, due_from=None, due_until=None, limit=5, scan=2, after="a3"
        )
        assert (keys(window), after) == ([], "a5")
        rest, after = await store.scan_tenant(
            A, state=None, due_from=at(8), due_until=None, limit=5, scan=100, after="a5"
        )
        assert (keys(rest), after) == ([("tenant-a", "a8"), ("tenant-a", "a9")], None)
