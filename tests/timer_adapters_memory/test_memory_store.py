"""MemoryTimerStore beyond the port contract: failure controls, sharing, threads."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import MemoryTimerStore
from timer_core import (
    ServiceCallId,
    StoreError,
    StoreUnavailable,
    TenantId,
    TimerEntry,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def entry(call: str, due: float = 0, tenant: str = "tenant-a") -> TimerEntry:
    """A Scheduled timer due ``due`` seconds after T0."""
    return TimerEntry(
        tenant_id=tenant,
        service_call_id=call,
        due_at=T0 + timedelta(seconds=due),
        registered_at=T0,
    )


class TestFailureControls:
    """The store fails on purpose the way a database that is down would."""

    async def test_unavailable_store_raises_store_unavailable(self) -> None:
        """While unavailable, reads and writes raise StoreUnavailable and change nothing."""
        store = MemoryTimerStore()
        await store.start()
        await store.schedule(entry("a"))
        store.set_unavailable(True)
        with pytest.raises(StoreUnavailable):
            await store.schedule(entry("b"))
        with pytest.raises(StoreUnavailable):
            await store.find_due(T0, 10)
        with pytest.raises(StoreUnavailable):
            await store.next_due_at()
        store.set_unavailable(False)
        assert [e.service_call_id for e in await store.list_for_tenant(TenantId("tenant-a"))] == [
            "a"
        ]

    async def test_fail_next_fails_that_many_calls(self) -> None:
        """fail_next(n) makes the next n calls raise, then the store works again."""
        store = MemoryTimerStore()
        await store.start()
        store.fail_next(2)
        for _ in range(2):
            with pytest.raises(StoreError):
                await store.count_scheduled()
        assert await store.count_scheduled() == 0

    async def test_fail_next_can_target_methods(self) -> None:
        """fail_next with methods fails only calls of those methods; others go through."""
        store = MemoryTimerStore()
        await store.start()
        await store.schedule(entry("a"))
        store.fail_next(1, methods=["mark_reached"])
        assert len(await store.find_due(T0, 10)) == 1
        with pytest.raises(StoreUnavailable):
            await store.mark_reached([entry("a").reach(T0)])
        assert await store.mark_reached([entry("a").reach(T0)]) == 1

    async def test_unavailability_is_shared_by_instances(self) -> None:
        """An instance sharing storage sees the same outage, like a shared database."""
        store = MemoryTimerStore()
        await store.start()
        other = MemoryTimerStore(shared_with=store)
        await other.start()
        store.set_unavailable(True)
        with pytest.raises(StoreUnavailable):
            await other.get(TenantId("t"), ServiceCallId("c"))

    async def test_closed_instance_raises_until_started(self) -> None:
        """A closed instance raises StoreUnavailable; another over the same storage works."""
        store = MemoryTimerStore()
        await store.start()
        await store.schedule(entry("a"))
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await store.count_scheduled()
        async with MemoryTimerStore(shared_with=store) as other:
            assert await other.count_scheduled() == 1
        await store.start()
        assert await store.count_scheduled() == 1

    async def test_rejects_reached_entries_in_apply(self) -> None:
        """apply refuses a Reached entry (a programming error) before changing anything."""
        store = MemoryTimerStore()
        await store.start()
        with pytest.raises(ValueError):
            await store.apply([entry("a"), entry("b").reach(T0)])
        assert await store.count_scheduled() == 0

    async def test_entries_lists_everything(self) -> None:
        """entries() returns every timer of every tenant in key order."""
        store = MemoryTimerStore()
        await store.start()
        await store.apply([entry("b", tenant="t2"), entry("a", tenant="t1"), entry("c")])
        assert [(e.tenant_id, e.service_call_id) for e in store.entries()] == [
            ("t1", "a"),
            ("t2", "b"),
            ("tenant-a", "c"),
        ]


class TestThreads:
    """The store is safe to use from several threads, each with its own loop."""

    def test_schedules_from_threads_are_all_stored(self) -> None:
        """Eight threads scheduling 200 timers each lose none and keep the index in order."""
        store = MemoryTimerStore()
        asyncio.run(store.start())

        async def work(n: int) -> None:
            for i in range(200):
                await store.schedule(entry(f"call-{n}-{i}", due=(i * 7 + n) % 50))
                if i % 3 == 0:
                    await store.cancel(TenantId("tenant-a"), ServiceCallId(f"call-{n}-{i}"))

        threads = [threading.Thread(target=asyncio.run, args=(work(n),)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        async def check() -> None:
            due = await store.find_due(T0 + timedelta(seconds=100), 10_000)
            assert len(due) == 8 * (200 - 67) == await store.count_scheduled()
            order = [(e.due_at, e.tenant_id, e.service_call_id) for e in due]
            assert order == sorted(order)

        asyncio.run(check())
