"""The conformance suite of the ``TimerStore`` port: every promise of its docstrings, as tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
import pytest_asyncio

from timer_core._entry import TimerEntry, TimerKey, TimerState
from timer_core._ids import CorrelationId, ServiceCallId, TenantId
from timer_core._trace import TraceContext
from timer_core.errors import StoreUnavailable
from timer_core.ports import (
    CommandOutcome,
    DueCursor,
    FindsDueByTenant,
    PositionedOperation,
    TimerOperation,
    TimerStore,
)

__all__ = ["FindsDueByTenantContract", "TimerStoreContract"]

T0 = datetime(2030, 1, 1, tzinfo=UTC)
A = TenantId("tenant-a")
B = TenantId("tenant-b")
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACEPARENT_2 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


def at(seconds: float) -> datetime:
    """The instant ``seconds`` after the suite's reference time."""
    return T0 + timedelta(seconds=seconds)


def entry(
    tenant: str,
    call: str,
    due: float | datetime,
    *,
    correlation: str | None = None,
    registered: float | datetime = 0,
) -> TimerEntry:
    """A ``Scheduled`` timer due ``due`` seconds after the reference time."""
    return TimerEntry(
        tenant_id=TenantId(tenant),
        service_call_id=ServiceCallId(call),
        due_at=due if isinstance(due, datetime) else at(due),
        registered_at=registered if isinstance(registered, datetime) else at(registered),
        correlation_id=correlation,
    )


def positioned(
    operation: TimerEntry | TimerKey, position: int, applied: float = 0
) -> PositionedOperation:
    """``operation`` at command position ``position``, applied ``applied`` seconds in."""
    return PositionedOperation(operation, position, at(applied))


def cancel(tenant: str, call: str) -> TimerKey:
    """The cancel of a timer."""
    return TimerKey(TenantId(tenant), ServiceCallId(call))


def keys(entries: list[TimerEntry]) -> list[tuple[str, str]]:
    """The keys of ``entries`` as plain tuples, in their order."""
    return [(str(e.tenant_id), str(e.service_call_id)) for e in entries]


class _OneStore:
    """The fixtures of a suite on one store: the factory hook, and the started store."""

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        """The factory hook: override it to return a callable making unstarted stores."""
        raise NotImplementedError(f"override the make_store fixture to bind {type(self).__name__}")

    @pytest_asyncio.fixture
    async def store(self, make_store: Callable[[], TimerStore]) -> AsyncIterator[TimerStore]:
        """A started store over fresh storage, closed after the test."""
        store = make_store()
        await store.start()
        try:
            yield store
        finally:
            await store.aclose()


class TimerStoreContract(_OneStore):
    """Conformance tests every :class:`~timer_core.ports.TimerStore` must pass.

    Subclass it as a ``Test...`` class and override the ``make_store`` fixture: it returns a
    zero-argument callable, and each call returns a new, not yet started store over the same
    durable storage (the durability test closes one and reads through another)::

        class TestSqliteStore(TimerStoreContract):
            @pytest.fixture
            def make_store(self, tmp_path):
                return lambda: SqliteTimerStore(tmp_path / "t.db")

    The suite's own ``store`` fixture makes one store, starts it, and closes it afterwards.
    """

    # -- schedule (upsert) -------------------------------------------------------------------

    async def test_get_unknown_is_none(self, store: TimerStore) -> None:
        """Getting a key that was never scheduled returns None."""
        assert await store.get(A, ServiceCallId("nope")) is None

    async def test_schedule_stores_new_timer(self, store: TimerStore) -> None:
        """Scheduling a new key stores a Scheduled timer that reads back field for field."""
        timer = entry("tenant-a", "call-1", 60, correlation="corr-1", registered=1)
        assert await store.schedule(timer) is CommandOutcome.SCHEDULED
        stored = await store.get(A, ServiceCallId("call-1"))
        assert stored == timer
        assert stored is not None
        assert stored.state is TimerState.SCHEDULED
        assert stored.reached_at is None

    async def test_schedule_replaces_due_at_correlation_and_registered_at(
        self, store: TimerStore
    ) -> None:
        """Scheduling a Scheduled key again replaces due_at, correlation_id and registered_at."""
        await store.schedule(entry("tenant-a", "call-1", 60, correlation="first", registered=1))
        again = entry("tenant-a", "call-1", 30, correlation="second", registered=2)
        assert await store.schedule(again) is CommandOutcome.SCHEDULED
        assert await store.get(A, ServiceCallId("call-1")) == again

    async def test_reschedule_without_correlation_clears_it(self, store: TimerStore) -> None:
        """A reschedule without a correlation id leaves none (the last schedule wins)."""
        await store.schedule(entry("tenant-a", "call-1", 60, correlation="first"))
        await store.schedule(entry("tenant-a", "call-1", 90))
        stored = await store.get(A, ServiceCallId("call-1"))
        assert stored is not None
        assert stored.correlation_id is None
        assert stored.due_at == at(90)

    async def test_reached_timer_is_never_rearmed(self, store: TimerStore) -> None:
        """Scheduling a Reached key changes nothing and reports IGNORED_REACHED."""
        timer = entry("tenant-a", "call-1", 10, correlation="c1")
        await store.schedule(timer)
        reached = timer.reach(at(11))
        assert await store.mark_reached([reached]) == 1
        outcome = await store.schedule(entry("tenant-a", "call-1", 100, correlation="c2"))
        assert outcome is CommandOutcome.IGNORED_REACHED
        assert await store.get(A, ServiceCallId("call-1")) == reached
        assert await store.find_due(at(1000), 10) == []

    # -- trace context -----------------------------------------------------------------------

    async def test_trace_context_round_trips(self, store: TimerStore) -> None:
        """A timer's W3C trace context (traceparent and tracestate) reads back unchanged."""
        traced = attrs.evolve(
            entry("tenant-a", "call-1", 60), trace_context=TraceContext(TRACEPARENT, "a=1,b=2")
        )
        plain = attrs.evolve(
            entry("tenant-a", "call-2", 60), trace_context=TraceContext(TRACEPARENT_2)
        )
        await store.apply([traced, plain, entry("tenant-a", "call-3", 60)])
        assert await store.get(A, ServiceCallId("call-1")) == traced
        assert await store.get(A, ServiceCallId("call-2")) == plain
        untraced = await store.get(A, ServiceCallId("call-3"))
        assert untraced is not None
        assert untraced.trace_context is None
        assert await store.find_due(at(60), 10) == [traced, plain, entry("tenant-a", "call-3", 60)]

    async def test_reschedule_replaces_the_trace_context(self, store: TimerStore) -> None:
        """The last schedule's trace context wins, including none at all."""
        first = attrs.evolve(
            entry("tenant-a", "call-1", 60), trace_context=TraceContext(TRACEPARENT, "a=1")
        )
        second = attrs.evolve(
            entry("tenant-a", "call-1", 90), trace_context=TraceContext(TRACEPARENT_2)
        )
        await store.schedule(first)
        await store.schedule(second)
        assert await store.get(A, ServiceCallId("call-1")) == second
        await store.schedule(entry("tenant-a", "call-1", 120))
        stored = await store.get(A, ServiceCallId("call-1"))
        assert stored is not None
        assert stored.trace_context is None

    async def test_reached_timer_keeps_its_trace_context(self, store: TimerStore) -> None:
        """Marking a timer Reached keeps the trace context it was scheduled with."""
        traced = attrs.evolve(
            entry("tenant-a", "call-1", 10), trace_context=TraceContext(TRACEPARENT)
        )
        await store.schedule(traced)
        (due,) = await store.find_due(at(10), 10)
        await store.mark_reached([due.reach(at(11))])
        assert await store.get(A, ServiceCallId("call-1")) == traced.reach(at(11))

    async def test_mark_reached_keeps_the_stored_timer_not_the_callers_entry(
        self, store: TimerStore
    ) -> None:
        """A mark changes the stored timer's state and reached_at only: its trace context,
        correlation id and registered_at stay the stored ones, whatever the entry marked
        with carries (a store must not keep the caller's entry)."""
        traced = attrs.evolve(
            entry("tenant-a", "call-1", 10, correlation="corr-1", registered=3),
            trace_context=TraceContext(TRACEPARENT, "a=1"),
        )
        await store.schedule(traced)
        bare = entry("tenant-a", "call-1", 10)  # same key and due time, nothing else
        assert await store.mark_reached([bare.reach(at(11))]) == 1
        assert await store.get(A, ServiceCallId("call-1")) == traced.reach(at(11))
        (found,) = await store.list_for_tenant(A)
        assert found.trace_context == TraceContext(TRACEPARENT, "a=1")

    async def test_a_stored_timer_never_carries_the_callers_claim(self, store: TimerStore) -> None:
        """A store keeps what a timer is, not the claim the caller's entry carried (an entry
        another store found and claimed, scheduled again): reads return no claim."""
        claimed = attrs.evolve(entry("tenant-a", "call-1", 10, correlation="c"), claim=41)
        moved = attrs.evolve(entry("tenant-a", "call-2", 10, correlation="c"), claim=42)
        await store.apply([claimed, entry("tenant-a", "call-2", 5, correlation="c"), moved])
        reads = [
            await store.get(A, ServiceCallId("call-1")),
            await store.get(A, ServiceCallId("call-2")),
            *await store.list_for_tenant(A),
            *await store.find_by_correlation(A, CorrelationId("c")),
            *await store.find_due_for_tenant(A, at(100), 10),
        ]
        assert [read.claim for read in reads if read is not None] == [None] * 8

    # -- cancel ------------------------------------------------------------------------------

    async def test_cancel_removes_scheduled_timer(self, store: TimerStore) -> None:
        """Cancelling a Scheduled timer deletes it, so it is never found due."""
        await store.schedule(entry("tenant-a", "call-1", 10))
        assert await store.cancel(A, ServiceCallId("call-1")) is CommandOutcome.CANCELLED
        assert await store.get(A, ServiceCallId("call-1")) is None
        assert await store.find_due(at(1000), 10) == []
        assert await store.count_scheduled() == 0

    async def test_cancel_unknown_is_noop(self, store: TimerStore) -> None:
        """Cancelling a key that does not exist reports CANCEL_NOOP."""
        assert await store.cancel(A, ServiceCallId("ghost")) is CommandOutcome.CANCEL_NOOP

    async def test_cancel_reached_is_noop(self, store: TimerStore) -> None:
        """Cancelling a Reached timer keeps it and reports CANCEL_NOOP."""
        timer = entry("tenant-a", "call-1", 10)
        await store.schedule(timer)
        await store.mark_reached([timer.reach(at(10))])
        assert await store.cancel(A, ServiceCallId("call-1")) is CommandOutcome.CANCEL_NOOP
        assert await store.get(A, ServiceCallId("call-1")) == timer.reach(at(10))

    async def test_rescheduling_after_cancel_stores_a_new_timer(self, store: TimerStore) -> None:
        """A key cancelled while Scheduled can be scheduled again."""
        await store.schedule(entry("tenant-a", "call-1", 10))
        await store.cancel(A, ServiceCallId("call-1"))
        again = entry("tenant-a", "call-1", 20)
        assert await store.schedule(again) is CommandOutcome.SCHEDULED
        assert await store.get(A, ServiceCallId("call-1")) == again

    # -- apply -------------------------------------------------------------------------------

    async def test_apply_empty_returns_nothing(self, store: TimerStore) -> None:
        """Applying no operations returns an empty list."""
        assert await store.apply([]) == []

    async def test_apply_runs_operations_in_order(self, store: TimerStore) -> None:
        """Within one apply, later operations see earlier ones: schedule, cancel, schedule."""
        first = entry("tenant-a", "call-1", 10, correlation="one")
        second = entry("tenant-a", "call-1", 20, correlation="two")
        outcomes = await store.apply(
            [
                first,
                TimerKey(A, ServiceCallId("call-1")),
                second,
                TimerKey(A, ServiceCallId("ghost")),
                entry("tenant-b", "call-1", 5),
            ]
        )
        assert outcomes == [
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCELLED,
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCEL_NOOP,
            CommandOutcome.SCHEDULED,
        ]
        assert await store.get(A, ServiceCallId("call-1")) == second
        assert await store.count_scheduled() == 2

    async def test_apply_schedule_then_cancel_leaves_nothing(self, store: TimerStore) -> None:
        """A schedule followed by a cancel of the same key in one apply leaves no timer."""
        outcomes = await store.apply(
            [entry("tenant-a", "call-1", 10), TimerKey(A, ServiceCallId("call-1"))]
        )
        assert outcomes == [CommandOutcome.SCHEDULED, CommandOutcome.CANCELLED]
        assert await store.get(A, ServiceCallId("call-1")) is None

    async def test_apply_sees_reached_state(self, store: TimerStore) -> None:
        """Within one apply, a Reached key ignores both schedule and cancel."""
        timer = entry("tenant-a", "call-1", 10)
        await store.schedule(timer)
        await store.mark_reached([timer.reach(at(10))])
        outcomes = await store.apply(
            [entry("tenant-a", "call-1", 50), TimerKey(A, ServiceCallId("call-1"))]
        )
        assert outcomes == [CommandOutcome.IGNORED_REACHED, CommandOutcome.CANCEL_NOOP]

    # -- tenants -----------------------------------------------------------------------------

    async def test_find_due_for_tenant_returns_only_that_tenant(self, store: TimerStore) -> None:
        """With due timers in two tenants, find_due_for_tenant returns only the asked one's."""
        await store.schedule(entry("tenant-a", "call-a", 0, correlation="corr-a"))
        await store.schedule(entry("tenant-b", "call-b", 0, correlation="corr-b"))
        results = await store.find_due_for_tenant(A, at(0), 100)
        assert len(results) == 1
        assert results[0].tenant_id == A

    async def test_same_service_call_id_in_two_tenants_are_two_timers(
        self, store: TimerStore
    ) -> None:
        """One service call id in two tenants is two timers; changing one leaves the other."""
        call = ServiceCallId("shared-call")
        a_timer = entry("tenant-a", call, 10)
        b_timer = entry("tenant-b", call, 20)
        await store.apply([a_timer, b_timer])
        assert await store.get(A, call) == a_timer
        assert await store.get(B, call) == b_timer
        assert await store.cancel(A, call) is CommandOutcome.CANCELLED
        assert await store.get(B, call) == b_timer
        await store.schedule(entry("tenant-a", call, 99))
        assert await store.mark_reached([b_timer.reach(at(20))]) == 1
        a_now = await store.get(A, call)
        assert a_now is not None
        assert a_now.is_scheduled
        assert a_now.due_at == at(99)

    async def test_tenant_reads_never_cross(self, store: TimerStore) -> None:
        """get, list_for_tenant and find_by_correlation never return another tenant's timer."""
        await store.schedule(entry("tenant-a", "call-1", 10, correlation="same"))
        await store.schedule(entry("tenant-b", "call-2", 10, correlation="same"))
        assert await store.get(B, ServiceCallId("call-1")) is None
        assert keys(await store.list_for_tenant(B)) == [("tenant-b", "call-2")]
        found = await store.find_by_correlation(A, CorrelationId("same"))
        assert keys(found) == [("tenant-a", "call-1")]
        assert await store.find_due_for_tenant(TenantId("tenant-c"), at(100), 10) == []

    # -- find_due ----------------------------------------------------------------------------

    async def test_find_due_is_inclusive_of_now(self, store: TimerStore) -> None:
        """A timer with due_at == now is due; one a millisecond later is not."""
        await store.schedule(entry("tenant-a", "on-time", 10))
        await store.schedule(entry("tenant-a", "later", at(10) + timedelta(milliseconds=1)))
        assert keys(await store.find_due(at(10), 10)) == [("tenant-a", "on-time")]
        assert keys(await store.find_due_for_tenant(A, at(10), 10)) == [("tenant-a", "on-time")]
        assert await store.find_due(at(10) - timedelta(milliseconds=1), 10) == []

    async def test_no_find_returns_a_timer_a_millisecond_early(self, store: TimerStore) -> None:
        """Never early, to the millisecond: a timer due 1 ms after ``now`` is found by no
        find (a store that compares whole seconds, or rounds, fires it early)."""
        soon = entry("tenant-a", "soon", at(10) + timedelta(milliseconds=1))
        await store.apply([soon, entry("tenant-a", "late", at(10) + timedelta(milliseconds=999))])
        assert await store.find_due(at(10), 10) == []
        assert await store.find_due_for_tenant(A, at(10), 10) == []
        assert keys(await store.find_due(at(10) + timedelta(milliseconds=1), 10)) == keys([soon])
        if isinstance(store, FindsDueByTenant):
            assert await store.find_due_by_tenant(at(10), 10, after={}) == []
            due = await store.find_due_by_tenant(at(10) + timedelta(milliseconds=998), 10, after={})
            assert keys(due) == keys([soon])

    async def test_find_due_orders_by_due_at_then_tenant_then_call(self, store: TimerStore) -> None:
        """Due timers of all tenants come in (due_at, tenant_id, service_call_id) order."""
        timers = [
            entry("tenant-b", "call-2", 5),
            entry("tenant-a", "call-9", 7),
            entry("tenant-b", "call-1", 5),
            entry("tenant-a", "call-3", 5),
            entry("tenant-c", "call-0", 1),
            entry("tenant-a", "call-1", 7),
        ]
        await store.apply(timers)
        expected = sorted(timers, key=DueCursor.of)
        assert await store.find_due(at(10), 100) == expected

    async def test_find_due_orders_ids_by_code_point(self, store: TimerStore) -> None:
        """Ids sort by code point ('-' < digits < upper case < '_' < lower case), as in C.

        A SQL adapter needs a binary collation for this (``COLLATE "C"`` in PostgreSQL).
        """
        tokens = ["a", "A", "_x", "-x", "0", "Z", "z", "a-b", "aB", "a_b", "ab"]
        timers = [entry(token, token, 5) for token in tokens]
        await store.apply(timers)
        found = await store.find_due(at(5), 100)
        assert [str(e.tenant_id) for e in found] == sorted(tokens)
        await store.apply([entry("tenant-t", token, 5) for token in tokens])
        calls = await store.find_due_for_tenant(TenantId("tenant-t"), at(5), 100)
        assert [str(e.service_call_id) for e in calls] == sorted(tokens)
        listed = await store.list_for_tenant(TenantId("tenant-t"))
        assert [str(e.service_call_id) for e in listed] == sorted(tokens)

    async def test_find_due_respects_limit(self, store: TimerStore) -> None:
        """find_due returns at most limit timers, the earliest ones."""
        await store.apply([entry("tenant-a", f"call-{i:02d}", i) for i in range(10)])
        found = await store.find_due(at(100), 3)
        assert keys(found) == [
            ("tenant-a", "call-00"),
            ("tenant-a", "call-01"),
            ("tenant-a", "call-02"),
        ]
        assert len(await store.find_due_for_tenant(A, at(100), 4)) == 4

    async def test_find_due_pages_with_keyset_cursor(self, store: TimerStore) -> None:
        """Paging with after=DueCursor.of(last) visits every due timer once, in order."""
        timers = [
            entry(tenant, f"call-{i}", i % 4)
            for i in range(9)
            for tenant in ("tenant-a", "tenant-b", "tenant-c")
        ]
        await store.apply(timers)
        expected = sorted(timers, key=DueCursor.of)
        pages: list[TimerEntry] = []
        after: DueCursor | None = None
        for _ in range(len(timers)):  # bounded: a cursor that does not advance must fail
            page = await store.find_due(at(10), 4, after=after)
            if not page:
                break
            assert len(page) <= 4
            pages.extend(page)
            after = DueCursor.of(page[-1])
        assert pages == expected

    async def test_find_due_after_is_strict_and_needs_no_stored_key(
        self, store: TimerStore
    ) -> None:
        """after excludes its own position and may point between stored timers."""
        await store.apply(
            [
                entry("tenant-a", "call-1", 1),
                entry("tenant-a", "call-2", 1),
                entry("tenant-b", "x", 2),
            ]
        )
        after_first = DueCursor(at(1), A, ServiceCallId("call-1"))
        assert keys(await store.find_due(at(5), 10, after=after_first)) == [
            ("tenant-a", "call-2"),
            ("tenant-b", "x"),
        ]
        between = DueCursor(at(1), A, ServiceCallId("call-15"))
        assert keys(await store.find_due(at(5), 10, after=between)) == [
            ("tenant-a", "call-2"),
            ("tenant-b", "x"),
        ]
        assert keys(
            await store.find_due(at(5), 10, after=DueCursor(at(1.5), B, ServiceCallId("a")))
        ) == [("tenant-b", "x")]

    async def test_find_due_skips_reached_timers(self, store: TimerStore) -> None:
        """Reached timers are never found due."""
        timer = entry("tenant-a", "call-1", 1)
        await store.apply([timer, entry("tenant-a", "call-2", 2)])
        await store.mark_reached([timer.reach(at(3))])
        assert keys(await store.find_due(at(10), 10)) == [("tenant-a", "call-2")]
        assert keys(await store.find_due_for_tenant(A, at(10), 10)) == [("tenant-a", "call-2")]

    async def test_find_due_for_tenant_orders_by_due_at(self, store: TimerStore) -> None:
        """find_due_for_tenant returns the tenant's due timers earliest first."""
        await store.apply(
            [entry("tenant-a", "z", 1), entry("tenant-a", "a", 3), entry("tenant-a", "m", 2)]
        )
        found = await store.find_due_for_tenant(A, at(2), 10)
        assert keys(found) == [("tenant-a", "z"), ("tenant-a", "m")]

    # -- mark_reached ------------------------------------------------------------------------

    async def test_mark_reached_records_the_firing(self, store: TimerStore) -> None:
        """mark_reached moves Scheduled timers to Reached with their reached_at, in one call."""
        first = entry("tenant-a", "call-1", 1, correlation="c")
        second = entry("tenant-b", "call-2", 2)
        await store.apply([first, second, entry("tenant-a", "call-3", 3)])
        changed = await store.mark_reached([first.reach(at(5)), second.reach(at(6))])
        assert changed == 2
        assert await store.get(A, ServiceCallId("call-1")) == first.reach(at(5))
        assert await store.get(B, ServiceCallId("call-2")) == second.reach(at(6))
        assert await store.count_scheduled() == 1

    async def test_mark_reached_skips_a_rescheduled_timer(self, store: TimerStore) -> None:
        """A timer rescheduled after it was read is not marked: its new due time stands."""
        timer = entry("tenant-a", "call-1", 1)
        await store.schedule(timer)
        (read,) = await store.find_due(at(1), 10)
        moved = entry("tenant-a", "call-1", 50, registered=1)
        await store.schedule(moved)
        assert await store.mark_reached([read.reach(at(1))]) == 0
        assert await store.get(A, ServiceCallId("call-1")) == moved

    async def test_mark_reached_does_not_resurrect_a_cancelled_timer(
        self, store: TimerStore
    ) -> None:
        """A timer cancelled after it was read stays gone when the firing is marked."""
        timer = entry("tenant-a", "call-1", 1)
        await store.schedule(timer)
        await store.cancel(A, ServiceCallId("call-1"))
        assert await store.mark_reached([timer.reach(at(2))]) == 0
        assert await store.get(A, ServiceCallId("call-1")) is None

    async def test_second_mark_keeps_first_reached_at(self, store: TimerStore) -> None:
        """Marking an already Reached timer again changes nothing: the first reached_at stays."""
        timer = entry("tenant-a", "call-1", 1)
        await store.schedule(timer)
        assert await store.mark_reached([timer.reach(at(2))]) == 1
        assert await store.mark_reached([timer.reach(at(9))]) == 0
        assert await store.get(A, ServiceCallId("call-1")) == timer.reach(at(2))

    async def test_mark_reached_counts_only_changed_timers(self, store: TimerStore) -> None:
        """In a mixed batch, only the timers still Scheduled at the read due_at are counted."""
        timers = [entry("tenant-a", f"call-{i}", i) for i in range(5)]
        await store.apply(timers)
        await store.mark_reached([timers[0].reach(at(10))])
        await store.cancel(A, ServiceCallId("call-1"))
        await store.schedule(entry("tenant-a", "call-2", 70))
        changed = await store.mark_reached([t.reach(at(20)) for t in timers])
        assert changed == 2
        assert await store.mark_reached([]) == 0
        states = {str(e.service_call_id): e.state for e in await store.list_for_tenant(A)}
        assert states == {
            "call-0": TimerState.REACHED,
            "call-2": TimerState.SCHEDULED,
            "call-3": TimerState.REACHED,
            "call-4": TimerState.REACHED,
        }

    # -- instants and ids --------------------------------------------------------------------

    async def test_instants_round_trip_at_millisecond_precision(self, store: TimerStore) -> None:
        """due_at, registered_at and reached_at read back exactly, as aware UTC datetimes."""
        instants = [
            datetime(1970, 1, 1, 0, 0, 0, 1000, tzinfo=UTC),
            datetime(2030, 6, 15, 12, 34, 56, 789000, tzinfo=UTC),
            datetime(2031, 3, 1, 8, 0, 0, 999000, tzinfo=timezone(timedelta(hours=5, minutes=30))),
            datetime(2999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
        ]
        timers = [
            entry("tenant-a", f"call-{i}", due, registered=instants[-1 - i], correlation="c")
            for i, due in enumerate(instants)
        ]
        await store.apply(timers)
        reached = [t.reach(t.due_at + timedelta(milliseconds=i)) for i, t in enumerate(timers)]
        await store.mark_reached(reached[:2])
        expected = reached[:2] + timers[2:]
        listed = await store.list_for_tenant(A)
        assert listed == expected
        assert await store.find_by_correlation(A, CorrelationId("c")) == expected
        assert await store.find_due(instants[-1], 10) == timers[2:]
        for stored in listed:
            for value in (stored.due_at, stored.registered_at, stored.reached_at):
                if value is not None:
                    assert value.utcoffset() == timedelta(0)
                    assert value.microsecond % 1000 == 0

    async def test_longest_ids_round_trip(self, store: TimerStore) -> None:
        """128-character ids using every allowed character are stored and read back intact."""
        alphabet = "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz"
        long_id = (alphabet * 3)[:128]
        timer = entry(long_id, long_id[::-1], 1, correlation=long_id)
        await store.schedule(timer)
        assert await store.get(TenantId(long_id), ServiceCallId(long_id[::-1])) == timer
        assert await store.find_by_correlation(TenantId(long_id), CorrelationId(long_id)) == [timer]

    # -- find_by_correlation, list_for_tenant ------------------------------------------------

    async def test_find_by_correlation(self, store: TimerStore) -> None:
        """find_by_correlation returns the tenant's timers with that id, in key order."""
        await store.apply(
            [
                entry("tenant-a", "call-2", 1, correlation="x"),
                entry("tenant-a", "call-1", 2, correlation="x"),
                entry("tenant-a", "call-3", 3, correlation="y"),
                entry("tenant-a", "call-4", 4),
                entry("tenant-b", "call-5", 5, correlation="x"),
            ]
        )
        found = await store.find_by_correlation(A, CorrelationId("x"))
        assert keys(found) == [("tenant-a", "call-1"), ("tenant-a", "call-2")]
        assert await store.find_by_correlation(A, CorrelationId("none-such")) == []

    async def test_find_by_correlation_follows_reschedules(self, store: TimerStore) -> None:
        """A reschedule with another correlation id moves the timer to that id."""
        await store.schedule(entry("tenant-a", "call-1", 1, correlation="old"))
        await store.schedule(entry("tenant-a", "call-1", 2, correlation="new"))
        assert await store.find_by_correlation(A, CorrelationId("old")) == []
        assert keys(await store.find_by_correlation(A, CorrelationId("new"))) == [
            ("tenant-a", "call-1")
        ]

    async def test_list_for_tenant_pages_in_service_call_order(self, store: TimerStore) -> None:
        """list_for_tenant pages through Scheduled and Reached timers by service_call_id."""
        timers = [entry("tenant-a", f"call-{i}", 10 - i) for i in (4, 0, 6, 2, 5, 1, 3)]
        await store.apply([*timers, entry("tenant-b", "call-0", 1)])
        await store.mark_reached([timers[1].reach(at(20))])
        page1 = await store.list_for_tenant(A, limit=3)
        assert [str(e.service_call_id) for e in page1] == ["call-0", "call-1", "call-2"]
        assert page1[0].state is TimerState.REACHED
        page2 = await store.list_for_tenant(A, limit=3, after=page1[-1].service_call_id)
        assert [str(e.service_call_id) for e in page2] == ["call-3", "call-4", "call-5"]
        page3 = await store.list_for_tenant(A, limit=3, after=page2[-1].service_call_id)
        assert [str(e.service_call_id) for e in page3] == ["call-6"]
        assert await store.list_for_tenant(A, after=ServiceCallId("call-6")) == []
        assert len(await store.list_for_tenant(A)) == 7

    # -- next_due_at, count_scheduled, purge_reached -----------------------------------------

    async def test_next_due_at(self, store: TimerStore) -> None:
        """next_due_at is the earliest Scheduled due_at of any tenant, or None."""
        assert await store.next_due_at() is None
        late = entry("tenant-a", "late", 10)
        early = entry("tenant-b", "early", 5)
        await store.apply([late, early])
        assert await store.next_due_at() == at(5)
        await store.mark_reached([early.reach(at(5))])
        assert await store.next_due_at() == at(10)
        await store.cancel(A, ServiceCallId("late"))
        assert await store.next_due_at() is None

    async def test_count_scheduled(self, store: TimerStore) -> None:
        """count_scheduled counts Scheduled timers of all tenants, not Reached or cancelled."""
        assert await store.count_scheduled() == 0
        timers = [entry(t, f"c{i}", i) for i in range(3) for t in ("tenant-a", "tenant-b")]
        await store.apply(timers)
        assert await store.count_scheduled() == 6
        await store.mark_reached([timers[0].reach(at(0))])
        await store.cancel(B, ServiceCallId("c1"))
        await store.schedule(entry("tenant-a", "c2", 40))
        assert await store.count_scheduled() == 4

    async def test_count_scheduled_for_tenant(self, store: TimerStore) -> None:
        """count_scheduled_for_tenant counts only that tenant's Scheduled timers."""
        fired = entry("tenant-a", "fired", 1)
        await store.apply(
            [
                fired,
                entry("tenant-a", "a1", 5),
                entry("tenant-a", "a2", 9),
                entry("tenant-b", "b", 1),
            ]
        )
        await store.mark_reached([fired.reach(at(2))])
        await store.cancel(A, ServiceCallId("a2"))
        assert await store.count_scheduled_for_tenant(A) == 1
        assert await store.count_scheduled_for_tenant(B) == 1
        assert await store.count_scheduled_for_tenant(TenantId("tenant-c")) == 0

    async def test_purge_reached(self, store: TimerStore) -> None:
        """purge_reached deletes only Reached timers fired before the cutoff, up to limit."""
        reached = [entry("tenant-a", f"r{i}", i) for i in range(1, 6)]
        pending = [entry("tenant-b", "s1", 0), entry("tenant-b", "s2", 100)]
        await store.apply([*reached, *pending])
        await store.mark_reached([t.reach(at(i)) for i, t in enumerate(reached, start=1)])
        assert await store.purge_reached(at(4), 2) == 2
        assert await store.purge_reached(at(4), 10) == 1
        assert await store.purge_reached(at(4), 10) == 0
        left = await store.list_for_tenant(A)
        assert [e.reached_at for e in left] == [at(4), at(5)]
        assert len(await store.list_for_tenant(B)) == 2
        assert await store.purge_reached(at(1000), 0) == 0
        assert await store.purge_reached(at(1000), 100) == 2
        assert await store.count_scheduled() == 2

    # -- timers set days or weeks ahead ------------------------------------------------------
    # A store may keep timers due far ahead apart from those coming due (the SQL stores do:
    # out of their due-order indexes until their time is near); none of it may show.

    async def test_timers_weeks_ahead_come_due_in_order(self, store: TimerStore) -> None:
        """Timers due seconds, a day and weeks ahead are each found once due, in due order,
        however long the store went without a find (the instants are close to buckets of
        any size a store may use)."""
        week = 7 * 86_400
        timers = [
            entry("tenant-a", "soon", 5),
            entry("tenant-b", "day", 86_400),
            entry("tenant-a", "weeks", 3 * week),
            entry("tenant-b", "weeks", 3 * week),
            entry("tenant-a", "weeks-later", 3 * week + 0.001),
            entry("tenant-b", "month", 30 * 86_400 - 0.001),
        ]
        await store.apply(list(reversed(timers)))
        assert keys(await store.find_due(at(10), 10)) == keys(timers[:1])
        assert keys(await store.find_due(at(86_399.999), 10)) == keys(timers[:1])
        assert keys(await store.find_due(at(86_400), 10)) == keys(timers[:2])
        assert keys(await store.find_due(at(3 * week), 10)) == keys(timers[:4])
        assert keys(await store.find_due(at(40 * 86_400), 10)) == keys(timers)
        assert keys(await store.find_due_for_tenant(B, at(3 * week), 10)) == [
            ("tenant-b", "day"),
            ("tenant-b", "weeks"),
        ]

    async def test_a_find_far_ahead_first_still_sees_everything_due(
        self, store: TimerStore
    ) -> None:
        """A first find weeks after the timers' due times (a store started after a long
        stop) returns every one of them, and the next finds see later timers come due."""
        await store.apply([entry("tenant-a", f"t{i}", i * 86_400) for i in range(1, 4)])
        found = await store.find_due(at(60 * 86_400), 10)
        assert keys(found) == [("tenant-a", "t1"), ("tenant-a", "t2"), ("tenant-a", "t3")]
        later = entry("tenant-a", "later", 90 * 86_400)
        await store.schedule(later)
        assert keys(await store.find_due(at(60 * 86_400), 10)) == keys(found)
        assert keys(await store.find_due(at(90 * 86_400), 10)) == [*keys(found), keys([later])[0]]

    async def test_reschedules_between_soon_and_weeks_ahead(self, store: TimerStore) -> None:
        """A timer moved from weeks ahead to seconds ahead fires at its new time, and one
        moved the other way no longer comes due early."""
        month = 30 * 86_400
        await store.apply([entry("tenant-a", "was-soon", 5), entry("tenant-a", "was-far", month)])
        assert keys(await store.find_due(at(5), 10)) == [("tenant-a", "was-soon")]
        await store.apply([entry("tenant-a", "was-soon", month), entry("tenant-a", "was-far", 6)])
        assert keys(await store.find_due(at(10), 10)) == [("tenant-a", "was-far")]
        assert keys(await store.find_due(at(month - 1), 10)) == [("tenant-a", "was-far")]
        assert keys(await store.find_due(at(month), 10)) == [
            ("tenant-a", "was-far"),
            ("tenant-a", "was-soon"),
        ]

    async def test_cancel_and_mark_of_timers_weeks_ahead(self, store: TimerStore) -> None:
        """A timer weeks ahead can be cancelled, or marked reached without having been
        found; neither comes due afterwards."""
        month = 30 * 86_400
        cancelled = entry("tenant-a", "cancelled", month)
        marked = entry("tenant-a", "marked", month)
        kept = entry("tenant-b", "kept", month)
        await store.apply([cancelled, marked, kept])
        assert await store.cancel(A, ServiceCallId("cancelled")) is CommandOutcome.CANCELLED
        assert await store.mark_reached([marked.reach(at(month))]) == 1
        got = await store.get(A, ServiceCallId("marked"))
        assert got is not None and got.state is TimerState.REACHED
        assert keys(await store.find_due(at(2 * month), 10)) == [("tenant-b", "kept")]

    async def test_counts_and_next_due_include_timers_weeks_ahead(self, store: TimerStore) -> None:
        """count_scheduled, count_scheduled_for_tenant and next_due_at see timers weeks
        ahead exactly as they see timers due soon."""
        month = 30 * 86_400
        await store.apply(
            [
                entry("tenant-a", "late", month + 0.003),
                entry("tenant-a", "early", month + 0.001),
                entry("tenant-b", "later", 2 * month),
            ]
        )
        assert await store.next_due_at() == at(month + 0.001)
        assert await store.count_scheduled() == 3
        assert await store.count_scheduled_for_tenant(A) == 2
        assert await store.count_scheduled_for_tenant(B) == 1
        await store.schedule(entry("tenant-b", "soon", 5))
        assert await store.next_due_at() == at(5)
        assert await store.count_scheduled_for_tenant(B) == 2
        assert await store.count_scheduled() == 4
        (soon,) = await store.find_due(at(5), 10)
        await store.mark_reached([soon.reach(at(5))])
        assert await store.next_due_at() == at(month + 0.001)

    # -- command order (PositionedOperation) -------------------------------------------------

    async def test_older_schedule_after_a_cancel_does_not_rearm(self, store: TimerStore) -> None:
        """A schedule redelivered after a newer cancel of its timer is stale: nothing re-arms."""
        first = entry("tenant-a", "k", 10)
        assert await store.apply(
            [positioned(first, 5), positioned(cancel("tenant-a", "k"), 6)]
        ) == [
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCELLED,
        ]
        assert await store.apply([positioned(first, 5)]) == [CommandOutcome.STALE]
        assert await store.get(A, ServiceCallId("k")) is None
        assert await store.count_scheduled() == 0

    async def test_older_schedule_after_a_reschedule_keeps_the_newer(
        self, store: TimerStore
    ) -> None:
        """A schedule older than the reschedule already applied leaves the newer due time."""
        await store.apply([positioned(entry("tenant-a", "k", 10), 5)])
        await store.apply([positioned(entry("tenant-a", "k", 20, registered=1), 8)])
        assert await store.apply([positioned(entry("tenant-a", "k", 10, registered=2), 5)]) == [
            CommandOutcome.STALE
        ]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 20, registered=1)

    async def test_older_cancel_after_a_schedule_keeps_the_timer(self, store: TimerStore) -> None:
        """A cancel older than the schedule already applied to its timer changes nothing."""
        await store.apply([positioned(entry("tenant-a", "k", 10), 9)])
        assert await store.apply([positioned(cancel("tenant-a", "k"), 4)]) == [CommandOutcome.STALE]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 10)

    async def test_cancel_of_an_unknown_timer_still_orders_its_key(self, store: TimerStore) -> None:
        """A positioned cancel with nothing to delete still makes older schedules stale."""
        assert await store.apply([positioned(cancel("tenant-a", "k"), 7)]) == [
            CommandOutcome.CANCEL_NOOP
        ]
        assert await store.apply([positioned(entry("tenant-a", "k", 10), 6)]) == [
            CommandOutcome.STALE
        ]
        assert await store.apply([positioned(entry("tenant-a", "k", 10), 8)]) == [
            CommandOutcome.SCHEDULED
        ]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 10)

    async def test_same_position_again_is_the_same_command_applied_again(
        self, store: TimerStore
    ) -> None:
        """A command redelivered at its own position is applied again (no change), not stale."""
        again = positioned(entry("tenant-a", "k", 10), 5)
        assert await store.apply([again]) == [CommandOutcome.SCHEDULED]
        assert await store.apply([again]) == [CommandOutcome.SCHEDULED]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 10)

    async def test_stale_command_in_the_same_batch(self, store: TimerStore) -> None:
        """Order holds within one apply: a command older than one before it is stale."""
        first = entry("tenant-a", "k", 10)
        outcomes = await store.apply(
            [positioned(first, 5), positioned(cancel("tenant-a", "k"), 6), positioned(first, 5)]
        )
        assert outcomes == [
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCELLED,
            CommandOutcome.STALE,
        ]
        assert await store.get(A, ServiceCallId("k")) is None

    async def test_a_run_of_positioned_cancels_gets_each_its_outcome(
        self, store: TimerStore
    ) -> None:
        """Cancels one after another in a batch: each stale, cancelled or a no-op on its own."""
        await store.apply(
            [
                positioned(entry("tenant-a", "newer", 10), 50),
                positioned(entry("tenant-a", "pending", 10), 5),
                positioned(entry("tenant-a", "fired", 1), 5),
            ]
        )
        await store.mark_reached([entry("tenant-a", "fired", 1).reach(at(2))])
        outcomes = await store.apply(
            [
                positioned(cancel("tenant-a", "newer"), 20),
                positioned(cancel("tenant-a", "pending"), 20),
                positioned(cancel("tenant-a", "fired"), 20),
                positioned(cancel("tenant-a", "unknown"), 20),
            ]
        )
        assert outcomes == [
            CommandOutcome.STALE,
            CommandOutcome.CANCELLED,
            CommandOutcome.CANCEL_NOOP,
            CommandOutcome.CANCEL_NOOP,
        ]
        assert keys(await store.list_for_tenant(A)) == [
            ("tenant-a", "fired"),
            ("tenant-a", "newer"),
        ]
        assert await store.apply(
            [
                positioned(entry("tenant-a", "pending", 10), 19),
                positioned(entry("tenant-a", "unknown", 10), 19),
            ]
        ) == [CommandOutcome.STALE, CommandOutcome.STALE]

    async def test_positions_are_per_key(self, store: TimerStore) -> None:
        """A high position on one timer does not make another tenant's or call's command stale."""
        await store.apply(
            [positioned(entry("tenant-a", "k", 10), 100), positioned(cancel("tenant-a", "x"), 100)]
        )
        assert await store.apply(
            [
                positioned(entry("tenant-b", "k", 10), 1),
                positioned(entry("tenant-a", "other", 10), 2),
            ]
        ) == [CommandOutcome.SCHEDULED, CommandOutcome.SCHEDULED]

    async def test_unpositioned_operations_always_apply(self, store: TimerStore) -> None:
        """Schedules and cancels without a position apply whatever position the key has seen."""
        await store.apply([positioned(cancel("tenant-a", "k"), 50)])
        assert await store.schedule(entry("tenant-a", "k", 10)) is CommandOutcome.SCHEDULED
        assert await store.apply([positioned(entry("tenant-a", "k", 30), 49)]) == [
            CommandOutcome.STALE
        ]
        assert await store.cancel(A, ServiceCallId("k")) is CommandOutcome.CANCELLED
        await store.apply([positioned(entry("tenant-a", "k", 10), 60)])
        assert await store.schedule(entry("tenant-a", "k", 40)) is CommandOutcome.SCHEDULED
        # The in-process reschedule kept the key's position: the old command is still stale.
        assert await store.apply([positioned(entry("tenant-a", "k", 30), 59)]) == [
            CommandOutcome.STALE
        ]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 40)

    async def test_stale_schedule_of_a_reached_timer_changes_nothing(
        self, store: TimerStore
    ) -> None:
        """A Reached timer stays Reached under old and new positioned commands alike."""
        timer = entry("tenant-a", "k", 1)
        await store.apply([positioned(timer, 5)])
        await store.mark_reached([timer.reach(at(2))])
        assert await store.apply([positioned(timer, 4)]) == [CommandOutcome.STALE]
        assert await store.apply([positioned(entry("tenant-a", "k", 9), 6)]) == [
            CommandOutcome.IGNORED_REACHED
        ]
        assert await store.get(A, ServiceCallId("k")) == timer.reach(at(2))

    async def test_replaying_every_older_command_changes_nothing(self, store: TimerStore) -> None:
        """Commands replayed after newer ones (a broker that forgot its acks): 0 stale re-arms."""
        history: list[PositionedOperation] = []
        position = 0
        for i in range(40):
            call = f"k{i}"
            steps: list[TimerEntry | TimerKey] = [entry("tenant-a", call, 100 + i)]
            if i % 4 != 0:
                steps.append(entry("tenant-a", call, 200 + i, registered=1))
            if i % 2 == 1:
                steps.append(cancel("tenant-a", call))
            if i % 8 == 7:
                steps.append(entry("tenant-a", call, 300 + i, registered=2))
            for step in steps:
                position += 1
                history.append(positioned(step, position, applied=position))
        await store.apply(history)
        before = await store.list_for_tenant(A)
        # Everything again, newest first, in small batches: every command is older than (or
        # the same as) the last one applied to its timer.
        replay = list(reversed(history))
        outcomes: list[CommandOutcome] = []
        for start in range(0, len(replay), 7):
            outcomes += await store.apply(replay[start : start + 7])
        assert await store.list_for_tenant(A) == before
        assert await store.count_scheduled() == len([e for e in before if e.is_scheduled])
        assert CommandOutcome.STALE in outcomes

    async def test_purge_deletes_old_tombstones(self, store: TimerStore) -> None:
        """Retention purges cancel tombstones written before the cutoff, counting them."""
        await store.apply(
            [
                positioned(cancel("tenant-a", "old"), 5, applied=1),
                positioned(cancel("tenant-a", "new"), 5, applied=100),
            ]
        )
        assert await store.purge_reached(at(50), 10) == 1
        assert await store.purge_reached(at(50), 10) == 0
        # The old tombstone is gone, so the old key's position is forgotten; the other's holds.
        assert await store.apply(
            [
                positioned(entry("tenant-a", "old", 10), 4),
                positioned(entry("tenant-a", "new", 10), 4),
            ]
        ) == [CommandOutcome.SCHEDULED, CommandOutcome.STALE]

    async def test_purge_of_tombstones_keeps_to_its_limit(self, store: TimerStore) -> None:
        """Tombstones are purged within ``limit`` too, oldest first, the rest left for the
        next purge (still ordering their keys meanwhile)."""
        await store.apply(
            [positioned(cancel("tenant-a", f"k{i}"), 5, applied=i) for i in range(1, 4)]
        )
        assert await store.purge_reached(at(50), 2) == 2
        assert await store.apply([positioned(entry("tenant-a", "k3", 10), 4)]) == [
            CommandOutcome.STALE
        ]
        assert await store.purge_reached(at(50), 2) == 1
        assert await store.purge_reached(at(50), 2) == 0

    async def test_purge_shares_its_limit_between_timers_and_tombstones(
        self, store: TimerStore
    ) -> None:
        """One limit for both: Reached timers and tombstones together never exceed it."""
        timer = entry("tenant-a", "fired", 1)
        await store.apply([timer, positioned(cancel("tenant-a", "gone"), 5, applied=1)])
        await store.mark_reached([timer.reach(at(2))])
        assert await store.purge_reached(at(50), 1) == 1
        assert await store.purge_reached(at(50), 1) == 1
        assert await store.purge_reached(at(50), 1) == 0

    async def test_positioned_schedule_of_a_reached_timer_keeps_the_keys_position(
        self, store: TimerStore
    ) -> None:
        """IGNORED_REACHED changes nothing, the key's position included: an older command
        after it is IGNORED_REACHED again, not STALE (the port's decision)."""
        timer = entry("tenant-a", "k", 1)
        await store.apply([positioned(timer, 5)])
        await store.mark_reached([timer.reach(at(2))])
        assert await store.apply([positioned(entry("tenant-a", "k", 9), 10)]) == [
            CommandOutcome.IGNORED_REACHED
        ]
        assert await store.apply([positioned(entry("tenant-a", "k", 9), 7)]) == [
            CommandOutcome.IGNORED_REACHED
        ]

    async def test_plain_cancel_takes_the_timers_position_with_it(self, store: TimerStore) -> None:
        """A cancel without a position deletes the timer and the position stored with it
        (it leaves no tombstone): an older positioned schedule then stores a new timer."""
        await store.apply([positioned(entry("tenant-a", "k", 10), 5)])
        assert await store.cancel(A, ServiceCallId("k")) is CommandOutcome.CANCELLED
        assert await store.apply([positioned(entry("tenant-a", "k", 20), 3)]) == [
            CommandOutcome.SCHEDULED
        ]
        assert await store.get(A, ServiceCallId("k")) == entry("tenant-a", "k", 20)

    async def test_plain_cancel_keeps_a_tombstone_already_there(self, store: TimerStore) -> None:
        """A cancel without a position leaves a key's cancel tombstone where it is: a
        positioned schedule older than that tombstone stays STALE after it."""
        assert await store.apply([positioned(cancel("tenant-a", "k"), 7)]) == [
            CommandOutcome.CANCEL_NOOP
        ]
        assert await store.cancel(A, ServiceCallId("k")) is CommandOutcome.CANCEL_NOOP
        assert await store.apply([positioned(entry("tenant-a", "k", 10), 6)]) == [
            CommandOutcome.STALE
        ]
        await store.apply([positioned(entry("tenant-a", "j", 10), 5)])
        await store.apply([positioned(cancel("tenant-a", "j"), 8)])
        assert await store.schedule(entry("tenant-a", "j", 20)) is CommandOutcome.SCHEDULED
        assert await store.cancel(A, ServiceCallId("j")) is CommandOutcome.CANCELLED
        assert await store.apply([positioned(entry("tenant-a", "j", 30), 7)]) == [
            CommandOutcome.STALE
        ]
        assert await store.get(A, ServiceCallId("k")) is None
        assert await store.get(A, ServiceCallId("j")) is None

    async def test_plain_cancel_of_a_reached_timer_keeps_its_position(
        self, store: TimerStore
    ) -> None:
        """A cancel without a position of a ``Reached`` timer changes nothing, its position
        included: an older positioned schedule is still STALE, not IGNORED_REACHED."""
        timer = entry("tenant-a", "k", 1)
        await store.apply([positioned(timer, 5)])
        await store.mark_reached([timer.reach(at(2))])
        assert await store.cancel(A, ServiceCallId("k")) is CommandOutcome.CANCEL_NOOP
        assert await store.apply([positioned(entry("tenant-a", "k", 9), 4)]) == [
            CommandOutcome.STALE
        ]
        assert await store.get(A, ServiceCallId("k")) == timer.reach(at(2))

    # -- concurrency and durability ----------------------------------------------------------

    async def test_concurrent_schedules_are_all_stored(self, store: TimerStore) -> None:
        """A hundred schedules awaited at once from one loop are all stored."""
        timers = [entry(f"tenant-{i % 4}", f"call-{i}", i) for i in range(100)]
        outcomes = await asyncio.gather(*(store.schedule(t) for t in timers))
        assert outcomes == [CommandOutcome.SCHEDULED] * 100
        assert await store.count_scheduled() == 100
        assert await store.find_due(at(1000), 1000) == sorted(timers, key=DueCursor.of)

    async def test_concurrent_applies_of_one_key_keep_per_call_order(
        self, store: TimerStore
    ) -> None:
        """Concurrent applies each see their own operations in order; no call is lost."""
        batches: list[list[TimerOperation]] = [
            [
                entry("tenant-a", f"k{i}", 1),
                TimerKey(A, ServiceCallId(f"k{i}")),
                entry("tenant-a", f"k{i}", 2),
            ]
            for i in range(30)
        ]
        results = await asyncio.gather(*(store.apply(batch) for batch in batches))
        for outcomes in results:
            assert outcomes == [
                CommandOutcome.SCHEDULED,
                CommandOutcome.CANCELLED,
                CommandOutcome.SCHEDULED,
            ]
        assert {e.due_at for e in await store.list_for_tenant(A)} == {at(2)}
        assert await store.count_scheduled() == 30

    # -- lifecycle ----------------------------------------------------------------------------

    async def test_calls_before_start_raise_store_unavailable(
        self, make_store: Callable[[], TimerStore]
    ) -> None:
        """A store never started refuses reads and writes with StoreUnavailable."""
        store = make_store()
        with pytest.raises(StoreUnavailable):
            await store.get(A, ServiceCallId("call-1"))
        with pytest.raises(StoreUnavailable):
            await store.apply([entry("tenant-a", "call-1", 1)])
        with pytest.raises(StoreUnavailable):
            await store.find_due(at(10), 10)
        with pytest.raises(StoreUnavailable):
            await store.next_due_at()
        await store.aclose()  # closing a store that was never started is harmless

    async def test_calls_after_aclose_raise_store_unavailable(
        self, make_store: Callable[[], TimerStore]
    ) -> None:
        """A closed store refuses reads and writes with StoreUnavailable; aclose is idempotent."""
        store = make_store()
        await store.start()
        await store.schedule(entry("tenant-a", "call-1", 1))
        await store.aclose()
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await store.get(A, ServiceCallId("call-1"))
        with pytest.raises(StoreUnavailable):
            await store.apply([entry("tenant-a", "call-2", 1)])
        with pytest.raises(StoreUnavailable):
            await store.mark_reached([entry("tenant-a", "call-1", 1).reach(at(2))])
        with pytest.raises(StoreUnavailable):
            await store.count_scheduled()

    async def test_timers_survive_a_new_store_instance(
        self, make_store: Callable[[], TimerStore]
    ) -> None:
        """Everything a closed store returned is there when a new instance opens the storage."""
        first = make_store()
        await first.start()
        await first.start()  # start is idempotent
        try:
            fired = entry("tenant-a", "fired", 1, correlation="c")
            await first.apply(
                [
                    fired,
                    entry("tenant-a", "pending", 50, correlation="c"),
                    entry("tenant-b", "moved", 5),
                    entry("tenant-b", "gone", 6),
                ]
            )
            await first.schedule(entry("tenant-b", "moved", 70, registered=3))
            await first.cancel(B, ServiceCallId("gone"))
            await first.mark_reached([fired.reach(at(2))])
            before = (await first.list_for_tenant(A), await first.list_for_tenant(B))
        finally:
            await first.aclose()
        second = make_store()
        async with second:
            assert (await second.list_for_tenant(A), await second.list_for_tenant(B)) == before
            assert await second.next_due_at() == at(50)
            assert await second.count_scheduled() == 2
            assert keys(await second.find_due(at(100), 10)) == [
                ("tenant-a", "pending"),
                ("tenant-b", "moved"),
            ]


class FindsDueByTenantContract(_OneStore):
    """Conformance tests of a store that shares finds among tenants
    (:class:`~timer_core.ports.FindsDueByTenant`), bound like :class:`TimerStoreContract`
    (the same ``make_store`` hook)."""

    async def test_the_store_has_the_capability(self, store: TimerStore) -> None:
        """The store is a :class:`~timer_core.ports.FindsDueByTenant`, so drains use it."""
        assert isinstance(store, FindsDueByTenant)

    async def test_find_due_by_tenant_shares_a_batch_among_tenants(self, store: Any) -> None:
        """A tenant's backlog takes only its share: every tenant with due timers gets some."""
        storm = [entry("tenant-a", f"a{i:02d}", 1) for i in range(20)]
        others = [entry("tenant-b", f"b{i}", 5) for i in range(3)]
        others += [entry("tenant-c", f"c{i}", 2) for i in range(3)]
        await store.apply([*storm, *others])
        found = await store.find_due_by_tenant(at(10), 10, after={})
        assert sorted(keys(found)) == sorted(keys(storm[:4] + others))
        assert found == sorted(found, key=DueCursor.of)

    async def test_find_due_by_tenant_gives_unused_shares_to_others(self, store: Any) -> None:
        """What a tenant leaves of its share goes to the others: a batch is short only when
        nothing more is due, and not-yet-due or Reached timers never come back."""
        storm = [entry("tenant-a", f"a{i:02d}", i) for i in range(20)]
        fired = entry("tenant-b", "fired", 1)
        await store.apply([*storm, fired, entry("tenant-b", "b", 3), entry("tenant-c", "c", 60)])
        await store.mark_reached([fired.reach(at(2))])
        found = await store.find_due_by_tenant(at(10), 10, after={})
        assert keys(found) == keys(
            sorted([*storm[:9], entry("tenant-b", "b", 3)], key=DueCursor.of)
        )
        rest = await store.find_due_by_tenant(at(10), 100, after={})
        assert len(rest) == 12  # a0..a10 and b: everything due at 10 s
        assert await store.find_due_by_tenant(at(0), 10, after={}) == [storm[0]]

    async def test_find_due_by_tenant_sees_timers_set_weeks_ahead(self, store: Any) -> None:
        """Timers set weeks ahead are shared among tenants once due, like any others, and
        not before."""
        month = 30 * 86_400
        timers = [entry(f"tenant-{name}", "x", month + n) for n, name in enumerate("abc")]
        await store.apply([*timers, entry("tenant-d", "later", 2 * month)])
        assert await store.find_due_by_tenant(at(month - 1), 10, after={}) == []
        found = await store.find_due_by_tenant(at(month + 5), 10, after={})
        assert keys(found) == keys(timers)

    async def test_find_due_by_tenant_continues_after_each_tenants_cursor(self, store: Any) -> None:
        """Each tenant's timers come in (due_at, service_call_id) order after its cursor."""
        a = [entry("tenant-a", f"a{i}", 1) for i in range(6)]
        b = [entry("tenant-b", f"b{i}", i) for i in range(6)]
        await store.apply([*reversed(a), *b])
        after = {A: DueCursor.of(a[3]), B: DueCursor.of(b[1])}
        found = await store.find_due_by_tenant(at(10), 4, after=after)
        assert keys(found) == keys(sorted([a[4], a[5], b[2], b[3]], key=DueCursor.of))
        after = {A: DueCursor.of(a[5]), B: DueCursor.of(b[5])}
        assert await store.find_due_by_tenant(at(10), 4, after=after) == []

    async def test_find_due_by_tenant_serves_the_longest_waiting_tenants_first(
        self, store: Any
    ) -> None:
        """With more tenants than room, the tenants whose earliest due timer is oldest come
        first, so a later tenant id never waits behind earlier ones."""
        timers = [
            entry(f"tenant-{name}", "x", due) for name, due in zip("edcba", range(5), strict=True)
        ]
        await store.apply(timers)
        found = await store.find_due_by_tenant(at(10), 2, after={})
        assert keys(found) == [("tenant-e", "x"), ("tenant-d", "x")]

    async def test_find_due_by_tenant_breaks_ties_by_tenant_id(self, store: Any) -> None:
        """Tenants whose earliest timers are due at the same instant are served in tenant id
        order (timer_core.fair_share's tie-break)."""
        await store.apply([entry(f"tenant-{name}", "x", 5) for name in "cab"])
        found = await store.find_due_by_tenant(at(10), 2, after={})
        assert keys(found) == [("tenant-a", "x"), ("tenant-b", "x")]

    async def test_find_due_by_tenant_gives_the_rest_to_the_longest_waiting(
        self, store: Any
    ) -> None:
        """10 among 3 tenants with plenty due: 4, 3 and 3, the longest waiting getting the one
        that does not divide evenly."""
        await store.apply(
            [
                entry(f"tenant-{name}", f"{name}{i:02d}", n + i)
                for n, name in enumerate("abc")
                for i in range(10)
            ]
        )
        found = await store.find_due_by_tenant(at(100), 10, after={})
        counts = {tenant: sum(e.tenant_id == tenant for e in found) for tenant in (A, B)}
        assert counts == {A: 4, B: 3}
        assert len(found) == 10
