"""Retention through the worker: fired timers are deleted in small batches once old enough."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import (
    CommandOutcome,
    Instrumentation,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TimerState,
    TimerWorker,
)
from timer_core.commands import schedule_timer
from timer_core.maintenance import (
    BATCH_BUDGET,
    COMMANDS_QUIET_S,
    FORCED_SHARE,
    IDLE_S,
    OWED_MOST_BATCHES,
    OWED_PER_FIRED,
    Retention,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)
A = TenantId("tenant-a")
HOUR = 3600.0


def at(seconds: float) -> datetime:
    """The instant ``seconds`` after T0."""
    return T0 + timedelta(seconds=seconds)


class RecordingStore(MemoryTimerStore):
    """The memory store, recording every ``purge_reached`` call and what it deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.purges: list[tuple[datetime, int, int]] = []

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        deleted = await super().purge_reached(reached_before, limit)
        self.purges.append((reached_before, limit, deleted))
        return deleted


class Rig:
    """A recording store, a bus, a fake clock and one worker with retention over them."""

    def __init__(self) -> None:
        self.store = RecordingStore()
        self.bus = MemoryEventBus()
        self.clock = FakeClock(T0)
        self.worker: TimerWorker | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self, **options: object) -> TimerWorker:
        """Start the worker (5 s polling, 1 h retention in batches of 10, purge every 60 s)."""
        settings: dict[str, object] = {
            "polling_interval": 5.0,
            "retention": timedelta(hours=1),
            "retention_batch": 10,
            "retention_every": 60.0,
            **options,
        }
        self.worker = TimerWorker(self.store, self.bus, self.clock, **settings)  # type: ignore[arg-type]
        self.task = asyncio.create_task(self.worker.run())
        await self.clock.wait_for_sleepers(1)
        return self.worker

    async def advance(self, seconds: float, *, cancelled: int | None = None) -> None:
        """Move time on and wait until the worker has done its pass and sleeps again; with
        ``cancelled``, a batch of commands (that many of them cancellations) is stored just
        as the pass begins."""
        assert self.worker is not None
        passes = self.worker.passes
        self.clock.advance(seconds)
        if cancelled is not None:
            self.worker.notify_applied(cancelled=cancelled)
        async with asyncio.timeout(5):
            while self.worker.passes == passes or self.clock.sleepers == 0:
                await asyncio.sleep(0)
            await self.worker.wait_until_idle()  # and its purge, run beside the sleep, done

    async def schedule(self, call: str, due: float) -> CommandOutcome:
        """Schedule (or reschedule) tenant-a's timer ``call`` due ``due`` seconds after T0."""
        outcome = await schedule_timer(
            self.store, ScheduleTimer(A, ServiceCallId(call), at(due)), self.clock
        )
        if self.worker is not None:
            self.worker.notify_scheduled(at(due))
        return outcome

    async def stop(self) -> None:
        if self.worker is not None and self.task is not None:
            self.worker.stop()
            await self.task

    def states(self) -> dict[str, TimerState]:
        """Every stored timer's state, by service call id."""
        return {str(e.service_call_id): e.state for e in self.store.entries()}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """A rig whose worker is stopped after the test."""
    made = Rig()
    await made.store.start()
    try:
        yield made
    finally:
        await made.stop()


class TestRetention:
    async def test_fired_timers_are_kept_until_retention_has_passed(self, rig: Rig) -> None:
        """A timer fired less than the retention ago is still there, Reached."""
        await rig.schedule("call-1", 1)
        await rig.start()
        await rig.advance(1)
        assert rig.states() == {"call-1": TimerState.REACHED}
        await rig.advance(HOUR - 60)
        assert rig.states() == {"call-1": TimerState.REACHED}
        assert all(deleted == 0 for _, _, deleted in rig.store.purges)

    async def test_old_fired_timers_are_deleted_in_small_batches(self, rig: Rig) -> None:
        """Twenty-five timers fired over an hour ago go in purges of 10, 10 and 5."""
        for i in range(25):
            await rig.schedule(f"call-{i:02d}", 1)
        await rig.start()
        await rig.advance(1)
        assert len(rig.bus.published) == 25
        rig.store.purges.clear()
        await rig.advance(HOUR + 61)
        assert rig.states() == {}
        assert [(limit, deleted) for _, limit, deleted in rig.store.purges] == [
            (10, 10),
            (10, 10),
            (10, 5),
        ]
        cutoff = rig.store.purges[0][0]
        assert cutoff == rig.clock.now() - timedelta(hours=1)

    async def test_only_timers_fired_before_the_cutoff_go(self, rig: Rig) -> None:
        """Of two timers fired half an hour apart, the younger outlives the older's purge."""
        await rig.schedule("early", 1)
        await rig.schedule("late", 1801)
        await rig.start()
        await rig.advance(1)
        await rig.advance(1800)
        assert rig.states() == {"early": TimerState.REACHED, "late": TimerState.REACHED}
        await rig.advance(HOUR - 1800 + 60)
        assert rig.states() == {"late": TimerState.REACHED}
        await rig.advance(1800)
        assert rig.states() == {}

    async def test_scheduled_timers_are_never_deleted(self, rig: Rig) -> None:
        """A timer still Scheduled survives purges however long ago it was registered."""
        await rig.schedule("far-future", 30 * 86_400)
        await rig.schedule("fired", 1)
        await rig.start()
        await rig.advance(1)
        for _ in range(3):
            await rig.advance(2 * 86_400)
        assert rig.states() == {"far-future": TimerState.SCHEDULED}
        assert sum(deleted for _, _, deleted in rig.store.purges) == 1
        assert rig.bus.published[0].payload.service_call_id == "fired"

    async def test_purges_run_at_most_every_retention_every(self, rig: Rig) -> None:
        """Idle passes between two purge times do not purge again."""
        await rig.start(polling_interval=5.0, retention_every=60.0)
        assert len(rig.store.purges) == 1
        for _ in range(11):
            await rig.advance(5)
        assert len(rig.store.purges) == 1
        await rig.advance(5)
        assert len(rig.store.purges) == 2

    async def test_without_retention_nothing_is_purged(self, rig: Rig) -> None:
        """A worker without retention keeps fired timers for ever."""
        await rig.schedule("call-1", 1)
        await rig.start(retention=None)
        await rig.advance(1)
        await rig.advance(30 * 86_400)
        assert rig.states() == {"call-1": TimerState.REACHED}
        assert rig.store.purges == []

    async def test_a_failed_purge_is_retried_later(self, rig: Rig) -> None:
        """A store error during a purge is logged; the next purge time deletes the timer."""
        await rig.schedule("call-1", 1)
        await rig.start()
        await rig.advance(1)
        rig.store.fail_next(1, methods=["purge_reached"])
        await rig.advance(HOUR + 60)
        assert rig.states() == {"call-1": TimerState.REACHED}
        await rig.advance(60)
        assert rig.states() == {}
        assert len(rig.bus.published) == 1


class TestScheduleAfterDeletion:
    async def test_schedule_of_a_reached_timer_is_ignored_before_deletion(self, rig: Rig) -> None:
        """While the fired timer is kept, a ScheduleTimer for it changes nothing."""
        await rig.schedule("call-1", 1)
        await rig.start()
        await rig.advance(1)
        assert await rig.schedule("call-1", 7200) is CommandOutcome.IGNORED_REACHED
        await rig.advance(7200)
        assert len(rig.bus.published) == 1

    async def test_schedule_after_deletion_rearms_the_timer(self, rig: Rig) -> None:
        """Once retention deleted a fired timer, a ScheduleTimer for its key stores a new one."""
        await rig.schedule("call-1", 1)
        await rig.start()
        await rig.advance(1)
        await rig.advance(HOUR + 61)
        assert rig.states() == {}
        due = HOUR + 62 + 30
        assert await rig.schedule("call-1", due) is CommandOutcome.SCHEDULED
        assert rig.states() == {"call-1": TimerState.SCHEDULED}
        await rig.advance(30)
        published = rig.bus.published
        assert [e.payload.due_at for e in published] == [at(1), at(due)]
        assert published[0].id != published[1].id
        assert rig.states() == {"call-1": TimerState.REACHED}


class SlowPurgeStore(RecordingStore):
    """A store whose purges take 0.04 s of (fake) time a timer, like a big first purge."""

    clock: FakeClock

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        deleted = await super().purge_reached(reached_before, limit)
        self.clock.advance(0.04 * limit)
        return deleted


class TestPurgeYieldsToFiring:
    async def test_a_long_purge_stops_when_a_timer_comes_due(self, rig: Rig) -> None:
        """A purge of many batches pauses for a due timer and finishes in later idle time."""
        store = SlowPurgeStore()
        await store.start()
        store.clock = rig.clock
        rig.store = store
        for i in range(60):
            await rig.schedule(f"old-{i:02d}", 1)
        await rig.start(retention_every=HOUR)
        await rig.advance(1)
        assert len(rig.bus.published) == 60
        await rig.schedule("urgent", HOUR + 62)
        store.purges.clear()
        await rig.advance(HOUR + 60)
        # The whole purge would take 2.4 s, but the timer due 2 s after it began fires at
        # most one (shrunken) batch late.
        async with asyncio.timeout(5):
            while len(rig.bus.published) < 61:
                if rig.clock.sleepers:
                    rig.clock.advance(0.01)
                await asyncio.sleep(0)
        urgent = rig.bus.published[-1].payload
        assert urgent.service_call_id == "urgent"
        assert urgent.reached_at - urgent.due_at <= timedelta(seconds=0.4)
        async with asyncio.timeout(5):
            await rig.worker.wait_until_idle()  # the purge, resumed beside the sleep, done
        assert rig.states() == {"urgent": TimerState.REACHED}


class TestPurgeYieldsToCommands:
    async def test_commands_being_stored_hold_the_idle_purge_back(self, rig: Rig) -> None:
        """While batches of commands are stored, an idle worker starts no purge batch (it
        owes none for what it fired); once they have been quiet for COMMANDS_QUIET_S, its
        next idle moment purges them all."""
        await rig.start()
        await fired_long_ago(rig, 25)
        await rig.advance(2 * HOUR, cancelled=0)
        for _ in range(3):  # a storm across three more idle passes
            await rig.advance(5, cancelled=0)
        assert sum(deleted for _, _, deleted in rig.store.purges) == 0
        assert len(rig.store.entries()) == 25
        assert COMMANDS_QUIET_S < 5
        await rig.advance(5)  # no commands since the last batch
        assert rig.store.entries() == []
        assert [deleted for _, _, deleted in rig.store.purges] == [10, 10, 5]

    async def test_a_cancellation_counts_towards_what_a_busy_worker_purges(self, rig: Rig) -> None:
        """Tombstones of cancellations expire as fired timers do: a worker that fires
        nothing while commands flow deletes nothing for plain schedules, and for
        cancellations at most OWED_PER_FIRED a cancellation."""
        await rig.start()
        await fired_long_ago(rig, 40)
        rig.clock.advance(2 * HOUR)
        for _ in range(4):
            await rig.advance(5, cancelled=0)
        assert sum(deleted for _, _, deleted in rig.store.purges) == 0
        for _ in range(6):
            await rig.advance(5, cancelled=2)
        deleted = sum(deleted for _, _, deleted in rig.store.purges)
        assert 0 < deleted <= OWED_PER_FIRED * 2 * 6
        assert len(rig.store.entries()) == 40 - deleted


async def fired_long_ago(rig: Rig, count: int) -> None:
    """``count`` timers of tenant-a fired at T0, put in the store behind the worker's back
    (it owes no deletions for them), and what was purged so far forgotten."""
    timers = [TimerEntry(A, ServiceCallId(f"old-{i:02d}"), at(0), at(0)) for i in range(count)]
    await rig.store.apply(timers)
    await rig.store.mark_reached([t.reach(at(0)) for t in timers])
    rig.store.purges.clear()


class ClockedPurgeStore(RecordingStore):
    """A store whose purges take ``per_timer`` seconds of the fake clock a timer."""

    clock: FakeClock
    per_timer = 0.0008

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        deleted = await super().purge_reached(reached_before, limit)
        self.clock.advance(self.per_timer * limit)
        return deleted


def clocked_store() -> tuple[ClockedPurgeStore, FakeClock]:
    """A clocked store and its fake clock."""
    store = ClockedPurgeStore()
    store.clock = clock = FakeClock(T0)
    return store, clock


async def fill(store: ClockedPurgeStore, clock: FakeClock, count: int) -> None:
    """``count`` timers of tenant-a fired at T0, then the clock two hours on."""
    await store.start()
    timers = [TimerEntry(A, ServiceCallId(f"old-{i:02d}"), at(0), at(0)) for i in range(count)]
    await store.apply(timers)
    await store.mark_reached([t.reach(at(0)) for t in timers])
    clock.advance(2 * HOUR)


class TestPurgeOfABusyWorker:
    async def test_a_worker_never_idle_still_purges_half_the_time(self) -> None:
        """Interrupted at every call (timers coming due all the time), an unfinished purge
        still deletes a batch per call, but no sooner than its own duration after the last
        such batch (FORCED_SHARE of the time)."""
        assert FORCED_SHARE == 0.5
        store, clock = clocked_store()
        await fill(store, clock, 30)
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=10, every=60.0)
        await retention.purge(None, lambda: True)
        assert [deleted for _, _, deleted in store.purges] == [10]
        clock.advance(0.006)  # less than the 0.008 s the batch took
        await retention.purge(None, lambda: True)
        assert len(store.purges) == 1
        clock.advance(0.006)
        await retention.purge(None, lambda: True)
        assert [deleted for _, _, deleted in store.purges] == [10, 10]


class TestBatchBudget:
    async def test_batches_shrink_to_the_budget_and_grow_back(self) -> None:
        """A batch that took longer than BATCH_BUDGET makes the next ones smaller in
        proportion; quick ones double them again, up to ``batch``."""
        store, clock = clocked_store()
        await fill(store, clock, 40)
        store.per_timer = BATCH_BUDGET / 2.5  # a batch of 10 takes four budgets
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=10, every=60.0)
        await retention.purge(None, lambda: False)
        assert [limit for _, limit, _ in store.purges][:3] == [10, 2, 2]
        assert retention.size == 2
        store.per_timer = BATCH_BUDGET / 100
        await store.apply([TimerEntry(A, ServiceCallId("new"), at(0), at(0))])
        await store.mark_reached([TimerEntry(A, ServiceCallId("new"), at(0), at(0)).reach(at(0))])
        clock.advance(60)
        store.purges.clear()
        await retention.purge(None, lambda: False)
        assert [limit for _, limit, _ in store.purges] == [2]
        assert retention.size == 4

    async def test_no_idle_batch_starts_that_would_run_past_the_next_due_time(self) -> None:
        """Once a batch has taken longer than the time left until the next timer is due, only
        the batch a busy worker is owed runs: the timer is not held back by another."""
        store, clock = clocked_store()
        await fill(store, clock, 40)
        store.per_timer = BATCH_BUDGET / 12.5  # a batch of 10 takes 0.8 budgets
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=10, every=60.0)
        due_soon = clock.now() + timedelta(seconds=BATCH_BUDGET * 1.5)
        await retention.purge(due_soon, lambda: False)
        assert [deleted for _, _, deleted in store.purges] == [10]
        await retention.purge(clock.now() + timedelta(seconds=BATCH_BUDGET * 2), lambda: False)
        assert [deleted for _, _, deleted in store.purges] == [10, 10, 10]


class TestPurgeOwedByFiring:
    async def test_a_busy_worker_purges_no_more_than_it_owes_for_what_it_fired(self) -> None:
        """Told how many timers it fired, a never-idle worker's purge deletes a batch only
        once OWED_PER_FIRED deletions a fired timer add up to one, however much time passed."""
        store, clock = clocked_store()
        await fill(store, clock, 30)
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=10, every=60.0)
        await retention.purge(None, lambda: True, fired=0)
        assert store.purges == []  # nothing fired yet: nothing owed
        short = (10 - 1) // OWED_PER_FIRED  # owes less than a batch of 10
        clock.advance(1)
        await retention.purge(None, lambda: True, fired=short)
        assert store.purges == []
        enough = -(-10 // OWED_PER_FIRED)  # owes a batch at least
        clock.advance(1)
        await retention.purge(None, lambda: True, fired=enough)
        assert [deleted for _, _, deleted in store.purges] == [10]
        clock.advance(1)
        await retention.purge(None, lambda: True, fired=enough)  # what is left owes too little
        assert len(store.purges) == 1

    async def test_gaps_of_a_stream_purge_only_what_is_owed_an_idle_worker_all(self) -> None:
        """With a timer due within IDLE_S, a worker told what it fired deletes no batch it
        does not owe, even in a gap the batch would fit; with none due that soon, it purges
        everything past retention."""
        store, clock = clocked_store()
        await fill(store, clock, 30)
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=10, every=60.0)
        soon = clock.now() + timedelta(seconds=IDLE_S / 2)
        await retention.purge(soon, lambda: False, fired=0)
        assert store.purges == []
        later = clock.now() + timedelta(seconds=IDLE_S * 2)
        await retention.purge(later, lambda: False, fired=0)
        assert [deleted for _, _, deleted in store.purges] == [10, 10, 10, 0]

    async def test_what_a_busy_worker_owes_is_capped(self) -> None:
        """However many timers it fired while it could not purge, a busy worker owes at most
        OWED_MOST_BATCHES batches: no burst of deletions makes up for the pause."""
        store, clock = clocked_store()
        await fill(store, clock, 100)
        retention = Retention(store, clock, keep=timedelta(hours=1), batch=5, every=60.0)
        await retention.purge(None, lambda: True, fired=0)
        soon = clock.now() + timedelta(seconds=IDLE_S / 2)
        await retention.purge(soon, lambda: False, fired=1000)
        assert sum(deleted for _, _, deleted in store.purges) == OWED_MOST_BATCHES * 5


class HeldPurgeStore(RecordingStore):
    """A store whose purge batches wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        self.entered.set()
        await self.release.wait()
        return await super().purge_reached(reached_before, limit)


class TestPurgeBesideFiring:
    async def test_a_timer_due_during_a_purge_batch_fires_without_waiting_for_it(
        self, rig: Rig
    ) -> None:
        """The purge runs beside the worker's sleep: a timer coming due while a batch is
        under way is fired on time, and the batch finishes afterwards."""
        store = HeldPurgeStore()
        await store.start()
        rig.store = store
        await rig.start()
        async with asyncio.timeout(5):
            await store.entered.wait()  # the first idle moment's batch, held
        await rig.schedule("call-1", 1)
        rig.clock.advance(1)
        async with asyncio.timeout(5):
            while not rig.bus.published:
                await asyncio.sleep(0)
        assert rig.bus.published[0].payload.reached_at == at(1)
        assert store.purges == []  # still under way
        store.release.set()
        assert rig.worker is not None
        async with asyncio.timeout(5):
            await rig.worker.wait_until_idle()
        assert len(store.purges) == 1


class PurgeCounts(Instrumentation):
    """Collects what retention reports it deleted."""

    def __init__(self) -> None:
        self.purged: list[int] = []

    def timers_purged(self, count: int) -> None:
        self.purged.append(count)


class TestPurgeIsCounted:
    async def test_every_deleting_batch_is_reported_with_its_count(self) -> None:
        """The instrumentation hears of each batch that deleted timers, with how many (the
        service's timer_timers_purged_total); the last, empty batch is not reported."""
        store, clock = clocked_store()
        await fill(store, clock, 25)
        counts = PurgeCounts()
        retention = Retention(
            store, clock, keep=timedelta(hours=1), batch=10, every=60.0, instrumentation=counts
        )
        await retention.purge(None, lambda: False)
        assert counts.purged == [10, 10, 5]
        assert [deleted for _, _, deleted in store.purges] == [10, 10, 5]
