"""The workflows over the memory adapters: applying commands, and firing due timers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryCommandSource, MemoryEventBus, MemoryTimerStore
from timer_core import (
    CancelTimer,
    Command,
    CommandOutcome,
    DueTimeReached,
    EnvelopeId,
    EventPublisher,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    ScheduleTimer,
    ServiceCallId,
    StoreError,
    TenantId,
    TimerEntry,
    TimerState,
)
from timer_core.commands import cancel_timer, handle_commands, schedule_timer
from timer_core.firing import FiringPipeline, FiringReport
from timer_core.instants import to_epoch_ms

T0 = datetime(2030, 1, 1, tzinfo=UTC)
A = TenantId("tenant-a")
B = TenantId("tenant-b")


def at(seconds: float) -> datetime:
    """The instant ``seconds`` after T0."""
    return T0 + timedelta(seconds=seconds)


def schedule(
    tenant: str, call: str, due: float, correlation: str | None = None
) -> MessageEnvelope[Command]:
    """A ScheduleTimer envelope due ``due`` seconds after T0."""
    return MessageEnvelope(
        id=EnvelopeId.generate(),
        payload=ScheduleTimer(tenant, call, at(due)),
        timestamp_ms=0,
        correlation_id=correlation,
    )


def cancel(tenant: str, call: str) -> MessageEnvelope[Command]:
    """A CancelTimer envelope."""
    return MessageEnvelope(
        id=EnvelopeId.generate(), payload=CancelTimer(tenant, call), timestamp_ms=0
    )


class Recording(Instrumentation):
    """Instrumentation that remembers what it was told."""

    def __init__(self) -> None:
        self.handled: list[str] = []
        self.fired: list[TimerEntry] = []
        self.failed: list[TimerEntry] = []
        self.polls: list[int] = []

    def command_handled(self, envelope: MessageEnvelope[Command], outcome: str) -> None:
        self.handled.append(outcome)

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self.fired.extend(entries)

    def publish_failed(self, entry: TimerEntry, error: PublishError) -> None:
        self.failed.append(entry)

    def poll_completed(self, duration_s: float, fired: int) -> None:
        self.polls.append(fired)


class StateAtPublish(EventPublisher):
    """Publishes through a bus, noting each timer's stored state at the moment of publishing."""

    def __init__(self, bus: MemoryEventBus, store: MemoryTimerStore) -> None:
        self.bus = bus
        self.store = store
        self.states: list[TimerState | None] = []

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        for envelope in envelopes:
            stored = await self.store.get(envelope.tenant_id, envelope.payload.service_call_id)
            self.states.append(None if stored is None else stored.state)
        return await self.bus.publish_many(envelopes)


@pytest.fixture
async def store() -> AsyncIterator[MemoryTimerStore]:
    """An empty memory store, started."""
    async with MemoryTimerStore() as store:
        yield store


@pytest.fixture
def bus() -> MemoryEventBus:
    """A memory bus that accepts everything."""
    return MemoryEventBus()


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at T0."""
    return FakeClock(T0)


class TestFireDueTimers:
    """FiringPipeline.fire: find due timers, publish them, then mark the published ones."""

    async def test_publishes_then_marks(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """A due timer is published while still Scheduled, then marked Reached at now."""
        await handle_commands(store, [schedule("tenant-a", "call-1", 0)], clock)
        publisher = StateAtPublish(bus, store)
        clock.advance(1.5)
        report = await FiringPipeline(store, publisher, clock, batch_size=10).fire()
        assert publisher.states == [TimerState.SCHEDULED]
        assert [e.service_call_id for e in report.fired] == ["call-1"]
        stored = await store.get(A, ServiceCallId("call-1"))
        assert stored is not None
        assert stored.state is TimerState.REACHED
        assert stored.reached_at == at(1.5)
        assert len(bus.published) == 1

    async def test_fires_only_due_timers(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """A timer due exactly now fires; one due a millisecond later does not."""
        await handle_commands(
            store, [schedule("tenant-a", "now", 5), schedule("tenant-a", "later", 5.001)], clock
        )
        clock.advance(5)
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in report.fired] == ["now"]
        later = await store.get(A, ServiceCallId("later"))
        assert later is not None
        assert later.is_scheduled
        assert await FiringPipeline(store, bus, clock, batch_size=10).fire() == FiringReport(
            found=0, fired=[], failed=[], cursor=None
        )

    async def test_event_fields_follow_the_contract(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """aggregateId is the serviceCallId, correlationId that of the last schedule, no cause."""
        await handle_commands(
            store,
            [
                schedule("tenant-a", "call-1", 1, correlation="first"),
                schedule("tenant-a", "call-1", 2, correlation="second"),
                schedule("tenant-b", "call-2", 2),
            ],
            clock,
        )
        clock.advance(3.25)
        await FiringPipeline(store, bus, clock, batch_size=10).fire()
        events = {e.tenant_id: e for e in bus.published}
        first = events[A]
        assert first.type == "DueTimeReached"
        assert first.aggregate_id == "call-1"
        assert first.correlation_id == "second"
        assert first.causation_id is None
        assert first.payload == DueTimeReached(A, "call-1", at(2), at(3.25))
        assert first.timestamp_ms == to_epoch_ms(at(3.25))
        assert first.payload.reached_at >= first.payload.due_at
        assert events[B].correlation_id is None
        assert events[B].aggregate_id == "call-2"

    async def test_publish_failure_leaves_timer_scheduled_and_others_fire(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """A refused publish keeps that timer Scheduled; the rest of the batch fires."""
        await handle_commands(
            store,
            [
                schedule("tenant-a", "x", 1),
                schedule("tenant-b", "y", 1),
                schedule("tenant-a", "z", 2),
            ],
            clock,
        )
        bus.fail_when(lambda e: e.tenant_id == B)
        recording = Recording()
        clock.advance(2)
        report = await FiringPipeline(
            store, bus, clock, batch_size=10, instrumentation=recording
        ).fire()
        assert [e.service_call_id for e in report.fired] == ["x", "z"]
        assert [(e.service_call_id, type(err)) for e, err in report.failed] == [("y", PublishError)]
        assert [e.service_call_id for e in recording.failed] == ["y"]
        assert [e.service_call_id for e in recording.fired] == ["x", "z"]
        assert recording.polls == [2]
        failed = await store.get(B, ServiceCallId("y"))
        assert failed is not None
        assert failed.is_scheduled
        bus.fail_when(None)
        clock.advance(1)
        again = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in again.fired] == ["y"]

    async def test_envelope_id_is_stable_across_republishes(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """Every publish of one firing carries the same id; a new due time gets a new id."""
        await handle_commands(store, [schedule("tenant-a", "call-1", 1)], clock)
        clock.advance(1)
        bus.fail_next(2)
        await FiringPipeline(store, bus, clock, batch_size=10).fire()
        clock.advance(1)
        await FiringPipeline(store, bus, clock, batch_size=10).fire()
        clock.advance(1)
        await FiringPipeline(store, bus, clock, batch_size=10).fire()
        ids = {e.id for e in bus.publish_attempts}
        assert len(bus.publish_attempts) == 3
        assert ids == {EnvelopeId.for_firing(A, ServiceCallId("call-1"), to_epoch_ms(at(1)))}
        assert [e.id for e in bus.published] == list(ids)
        other = EnvelopeId.for_firing(A, ServiceCallId("call-1"), to_epoch_ms(at(2)))
        assert other not in ids

    async def test_mark_failure_republishes_the_same_firing(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """If marking fails after the publish, the next pass re-publishes the same id."""
        await handle_commands(store, [schedule("tenant-a", "call-1", 1)], clock)
        clock.advance(1)
        store.fail_next(1, methods=["mark_reached"])
        with pytest.raises(StoreError):
            await FiringPipeline(store, bus, clock, batch_size=10).fire()
        unmarked = await store.get(A, ServiceCallId("call-1"))
        assert unmarked is not None
        assert unmarked.is_scheduled
        clock.advance(1)
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert len(report.fired) == 1
        attempts = bus.publish_attempts
        assert len(attempts) == 2
        assert attempts[0].id == attempts[1].id
        assert len(bus.published) == 1
        assert bus.duplicates == 1

    async def test_batches_and_cursor(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """A full batch reports a cursor; continuing after it reaches the rest."""
        await handle_commands(store, [schedule("tenant-a", f"c{i}", i) for i in range(5)], clock)
        bus.fail_next(2)
        clock.advance(10)
        first = await FiringPipeline(store, bus, clock, batch_size=2).fire()
        assert first.found == 2
        assert first.batch_full
        assert len(first.failed) == 2
        second = await FiringPipeline(store, bus, clock, batch_size=2).fire(first.cursor)
        assert [e.service_call_id for e in second.fired] == ["c2", "c3"]
        third = await FiringPipeline(store, bus, clock, batch_size=2).fire(second.cursor)
        assert [e.service_call_id for e in third.fired] == ["c4"]
        assert not third.batch_full
        assert third.cursor is None

    async def test_store_failure_raises_and_publishes_nothing(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """When the store cannot be read, the pass raises StoreError and publishes nothing."""
        await handle_commands(store, [schedule("tenant-a", "c", 0)], clock)
        store.set_unavailable(True)
        with pytest.raises(StoreError):
            await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert bus.publish_attempts == []

    async def test_publish_many_is_one_call_per_batch(
        self, store: MemoryTimerStore, clock: FakeClock
    ) -> None:
        """The whole batch is handed to the publisher at once, so publishes overlap."""
        calls: list[int] = []

        class Counting(MemoryEventBus):
            async def publish_many(
                self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
            ) -> list[PublishError | None]:
                calls.append(len(envelopes))
                return await super().publish_many(envelopes)

        await handle_commands(store, [schedule("tenant-a", f"c{i}", 0) for i in range(7)], clock)
        await FiringPipeline(store, Counting(), clock, batch_size=5).fire()
        assert calls == [5]


class TestHandleCommands:
    """handle_commands applies a batch in order, in one store call."""

    async def test_applies_in_order(self, store: MemoryTimerStore, clock: FakeClock) -> None:
        """Schedule, cancel and schedule of one key in one batch leave the last schedule."""
        recording = Recording()
        outcomes = await handle_commands(
            store,
            [
                schedule("tenant-a", "k", 10, correlation="one"),
                cancel("tenant-a", "k"),
                schedule("tenant-a", "k", 20, correlation="two"),
                cancel("tenant-a", "unknown"),
            ],
            clock,
            instrumentation=recording,
        )
        assert outcomes == [
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCELLED,
            CommandOutcome.SCHEDULED,
            CommandOutcome.CANCEL_NOOP,
        ]
        assert recording.handled == ["scheduled", "cancelled", "scheduled", "cancel_noop"]
        stored = await store.get(A, ServiceCallId("k"))
        assert stored == TimerEntry(A, "k", at(20), T0, "two")

    async def test_registered_at_is_now(self, store: MemoryTimerStore, clock: FakeClock) -> None:
        """A scheduled timer's registered_at is the clock's now, to the millisecond."""
        clock.advance(timedelta(seconds=3, microseconds=1500))
        await handle_commands(store, [schedule("tenant-a", "k", 100)], clock)
        stored = await store.get(A, ServiceCallId("k"))
        assert stored is not None
        assert stored.registered_at == at(3.001)

    async def test_reached_timer_is_not_rearmed(
        self, store: MemoryTimerStore, bus: MemoryEventBus, clock: FakeClock
    ) -> None:
        """A ScheduleTimer for a Reached timer is ignored, and a cancel of it is a no-op."""
        await handle_commands(store, [schedule("tenant-a", "k", 1)], clock)
        clock.advance(1)
        await FiringPipeline(store, bus, clock, batch_size=10).fire()
        outcomes = await handle_commands(
            store, [schedule("tenant-a", "k", 50), cancel("tenant-a", "k")], clock
        )
        assert outcomes == [CommandOutcome.IGNORED_REACHED, CommandOutcome.CANCEL_NOOP]
        clock.advance(100)
        assert (await FiringPipeline(store, bus, clock, batch_size=10).fire()).found == 0

    async def test_empty_batch_touches_nothing(
        self, store: MemoryTimerStore, clock: FakeClock
    ) -> None:
        """An empty batch returns no outcomes without calling the store."""
        store.set_unavailable(True)
        assert await handle_commands(store, [], clock) == []

    async def test_store_failure_applies_nothing(
        self, store: MemoryTimerStore, clock: FakeClock
    ) -> None:
        """If the store fails, handle_commands raises and no command of the batch is applied."""
        store.fail_next(1)
        with pytest.raises(StoreError):
            await handle_commands(
                store, [schedule("tenant-a", "a", 1), schedule("tenant-a", "b", 1)], clock
            )
        assert store.entries() == []

    async def test_single_command_helpers(self, store: MemoryTimerStore, clock: FakeClock) -> None:
        """schedule_timer and cancel_timer do what one-command batches do."""
        command = ScheduleTimer(A, "k", at(5))
        assert await schedule_timer(store, command, clock, correlation_id="c") == (
            CommandOutcome.SCHEDULED
        )
        assert await store.get(A, ServiceCallId("k")) == TimerEntry(A, "k", at(5), T0, "c")
        assert await cancel_timer(store, CancelTimer(A, "k")) is CommandOutcome.CANCELLED
        assert await cancel_timer(store, CancelTimer(A, "k")) is CommandOutcome.CANCEL_NOOP

    async def test_commands_acked_only_once_stored(
        self, store: MemoryTimerStore, clock: FakeClock
    ) -> None:
        """Through a command source, a batch the store refused is redelivered, then acked."""
        source = MemoryCommandSource(redelivery_delay=0.25, clock=clock)

        async def handler(batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
            return await handle_commands(store, batch, clock)

        task = asyncio.ensure_future(source.run(handler))
        try:
            store.set_unavailable(True)
            sent = [schedule("tenant-a", "a", 1), schedule("tenant-b", "b", 2)]
            for envelope in sent:
                source.send(envelope)
            await clock.wait_for_sleepers(1)
            assert source.acked == []
            store.set_unavailable(False)
            clock.advance(0.25)
            await asyncio.wait_for(source.wait_until_drained(), 5)
            assert source.acked == sent
            assert len(store.entries()) == 2
        finally:
            await source.stop()
            await asyncio.wait_for(task, 5)
