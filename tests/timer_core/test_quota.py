"""Per-tenant quota: a ScheduleTimer over the cap of pending timers is refused and dead-lettered."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from timer_adapters_memory import FakeClock, MemoryCommandSource, MemoryEventBus, MemoryTimerStore
from timer_core import (
    CancelTimer,
    Command,
    CommandOutcome,
    MessageEnvelope,
    ScheduleTimer,
    Timer,
    TimerEntry,
    rejection_reason,
)
from timer_core.commands import handle_commands

T0 = datetime(2030, 1, 1, tzinfo=UTC)
IDS = iter(range(10**6))


def envelope(command: Command) -> MessageEnvelope[Command]:
    """A command in an envelope with a fresh id."""
    return MessageEnvelope(
        id=f"01900000-0000-7000-8000-{next(IDS):012d}", payload=command, timestamp_ms=0
    )


def schedule(tenant: str, call: str) -> MessageEnvelope[Command]:
    return envelope(ScheduleTimer(tenant, call, T0 + timedelta(hours=1)))


def cancel(tenant: str, call: str) -> MessageEnvelope[Command]:
    return envelope(CancelTimer(tenant, call))


class TestHandleCommands:
    async def test_new_timers_over_the_cap_are_refused(self) -> None:
        """At the cap, a new timer is OVER_QUOTA and not stored; a reschedule still passes."""
        async with MemoryTimerStore() as store:
            clock = FakeClock(T0)
            first = [schedule("tenant-a", f"c{i}") for i in range(3)]
            assert (
                await handle_commands(store, first, clock, max_pending_per_tenant=3)
                == [CommandOutcome.SCHEDULED] * 3
            )
            outcomes = await handle_commands(
                store,
                [schedule("tenant-a", "c3"), schedule("tenant-a", "c0"), schedule("tenant-b", "x")],
                clock,
                max_pending_per_tenant=3,
            )
            assert outcomes == [
                CommandOutcome.OVER_QUOTA,
                CommandOutcome.SCHEDULED,  # a reschedule adds no pending timer
                CommandOutcome.SCHEDULED,  # another tenant has its own cap
            ]
            assert await store.get("tenant-a", "c3") is None
            assert await store.count_scheduled_for_tenant("tenant-a") == 3

    async def test_the_batch_is_followed_in_order(self) -> None:
        """A cancel earlier in the batch frees room for a later schedule; later ones over the
        cap are refused, and fired timers do not count."""
        async with MemoryTimerStore() as store:
            clock = FakeClock(T0)
            fired = TimerEntry("tenant-a", "fired", T0, registered_at=T0)
            await store.apply([fired, TimerEntry("tenant-a", "p", T0, registered_at=T0)])
            await store.mark_reached([fired.reach(T0)])
            batch = [
                schedule("tenant-a", "n1"),  # 2 pending
                schedule("tenant-a", "n2"),  # over
                cancel("tenant-a", "p"),  # 1 pending
                schedule("tenant-a", "n3"),  # 2 pending
                schedule("tenant-a", "fired"),  # ignored, no room needed
            ]
            outcomes = await handle_commands(store, batch, clock, max_pending_per_tenant=2)
            assert outcomes == [
                CommandOutcome.SCHEDULED,
                CommandOutcome.OVER_QUOTA,
                CommandOutcome.CANCELLED,
                CommandOutcome.SCHEDULED,
                CommandOutcome.IGNORED_REACHED,
            ]
            assert await store.count_scheduled_for_tenant("tenant-a") == 2

    def test_the_reason_names_the_cap(self) -> None:
        """The dead-letter reason names the tenant, the call and the cap's parameter (none of a
        host's settings: the core does not know them)."""
        reason = rejection_reason(schedule("tenant-a", "c9"), CommandOutcome.OVER_QUOTA)
        assert reason is not None
        assert "'tenant-a'" in reason and "'c9'" in reason
        assert "max_pending_per_tenant" in reason and "TIMER_" not in reason
        assert rejection_reason(schedule("tenant-a", "c9"), CommandOutcome.SCHEDULED) is None


class TestTimerRuntime:
    async def test_commands_over_the_cap_are_dead_lettered(self) -> None:
        """Through a Timer, a command source dead-letters refused commands and acks the rest."""
        source = MemoryCommandSource(batch_size=10)
        store, bus = MemoryTimerStore(), MemoryEventBus()
        for i in range(5):
            source.send(schedule("tenant-a", f"c{i}"))
        source.send(schedule("tenant-b", "c0"))
        timer = Timer(store, bus, commands=source, clock=FakeClock(T0), max_pending_per_tenant=3)
        async with timer:
            await asyncio.wait_for(source.wait_until_drained(), 10)
            assert await store.count_scheduled_for_tenant("tenant-a") == 3
            assert await store.count_scheduled_for_tenant("tenant-b") == 1
        assert len(source.acked) == 4
        assert [reason.split(":")[0] for _, reason in source.dead_letters] == [
            "tenant 'tenant-a' is at its cap of pending timers (max_pending_per_tenant)"
        ] * 2
