"""The Timer runtime: lifecycle order, the command path, wake-ups, health, failures surfacing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryCommandSource, MemoryEventBus, MemoryTimerStore
from timer_core import (
    Command,
    CommandBatchHandler,
    CommandOutcome,
    CommandSource,
    ComponentFailed,
    DecodeError,
    EnvelopeId,
    InvalidTimestamp,
    MessageEnvelope,
    RemoteScheduleCallback,
    ReportsRemoteSchedules,
    ScheduleTimer,
    ServiceCallId,
    SharedClockStore,
    StoreInUse,
    StoreUnavailable,
    SystemClock,
    TenantId,
    Timer,
    TimerEntry,
    TimerOperation,
    TimerState,
    TimerWorker,
    ValidationError,
)
from timer_core.codec import decode_command, encode_envelope
from timer_core.instants import format_timestamp, to_epoch_ms

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def schedule_command(call: str, due_at: datetime) -> MessageEnvelope[Command]:
    """A ScheduleTimer envelope for tenant-a, as a producer would send it."""
    return MessageEnvelope(
        id=EnvelopeId.generate(),
        payload=ScheduleTimer("tenant-a", call, due_at),
        timestamp_ms=to_epoch_ms(T0),
        aggregate_id=ServiceCallId(call),
    )


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Let the event loop run until ``predicate`` holds (fails after ``within`` real s)."""
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0)


class JournalStore(MemoryTimerStore, ReportsRemoteSchedules):
    """A memory store that notes its lifecycle and its remote-schedule registrations."""

    def __init__(self, journal: list[str]) -> None:
        super().__init__()
        self.journal = journal
        self.remote: RemoteScheduleCallback | None = None
        self.hold_apply: asyncio.Event | None = None

    async def start(self) -> None:
        self.journal.append("store started")
        await super().start()

    async def aclose(self) -> None:
        self.journal.append("store closed")
        await super().aclose()

    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        self.remote = callback
        return True

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        if self.hold_apply is not None:
            self.journal.append("apply held")
            await self.hold_apply.wait()
        return await super().apply(operations)


class JournalBus(MemoryEventBus):
    """A memory bus that notes its lifecycle, and can refuse to start."""

    def __init__(self, journal: list[str], *, start_error: Exception | None = None) -> None:
        super().__init__()
        self.journal = journal
        self.start_error = start_error

    async def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.journal.append("publisher started")

    async def aclose(self) -> None:
        self.journal.append("publisher closed")


class JournalSource(MemoryCommandSource):
    """A memory command source that notes when its loop returns."""

    def __init__(self, journal: list[str]) -> None:
        super().__init__()
        self.journal = journal

    async def run(self, handler: CommandBatchHandler) -> None:
        await super().run(handler)
        self.journal.append("command loop returned")


class BrokenSource(CommandSource):
    """A command source whose loop dies, as one whose consumer was deleted would."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def run(self, handler: CommandBatchHandler) -> None:
        await self.go.wait()
        raise RuntimeError("consumer timer-service was deleted")

    async def stop(self) -> None:
        pass


class TestFiring:
    async def test_a_scheduled_timer_fires_at_its_due_time(self) -> None:
        """Scheduled in-process, a timer is published when the fake clock reaches it, not before."""
        clock, bus = FakeClock(T0), MemoryEventBus()
        async with Timer(MemoryTimerStore(), bus, clock=clock, polling_interval=60) as timer:
            assert await timer.schedule("tenant-a", "call-1", at(30)) is CommandOutcome.SCHEDULED
            await until(lambda: clock.pending_sleeps() == [30.0])
            clock.advance(29.999)
            await clock.wait_for_sleepers(1)
            assert bus.published == []
            clock.advance(0.001)
            (event,) = await bus.wait_for_published(1)
            await clock.wait_for_sleepers(1)
            stored = await timer.get("tenant-a", "call-1")
        assert event.payload.due_at == at(30)
        assert stored is not None and stored.state is TimerState.REACHED

    async def test_schedule_wakes_a_worker_sleeping_longer(self) -> None:
        """A timer due before the worker's planned wake-up wakes it: it then sleeps until due."""
        clock = FakeClock(T0)
        async with Timer(
            MemoryTimerStore(), MemoryEventBus(), clock=clock, polling_interval=60.0
        ) as timer:
            await until(lambda: clock.pending_sleeps() == [60.0])
            await timer.schedule("tenant-a", "call-1", at(2))
            await until(lambda: clock.pending_sleeps() == [2.0])

    async def test_cancel_and_get(self) -> None:
        """cancel removes a Scheduled timer (then is a no-op); get reads the store."""
        async with Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0)) as timer:
            await timer.schedule("tenant-a", "call-1", at(60), correlation_id="req-1")
            stored = await timer.get("tenant-a", "call-1")
            assert stored is not None and stored.correlation_id == "req-1"
            assert await timer.cancel("tenant-a", "call-1") is CommandOutcome.CANCELLED
            assert await timer.cancel("tenant-a", "call-1") is CommandOutcome.CANCEL_NOOP
            assert await timer.get("tenant-a", "call-1") is None

    async def test_a_fired_timer_is_not_rearmed(self) -> None:
        """Scheduling a timer that already fired reports IGNORED_REACHED and fires nothing."""
        clock, bus = FakeClock(T0), MemoryEventBus()
        async with Timer(MemoryTimerStore(), bus, clock=clock) as timer:
            await timer.schedule("tenant-a", "call-1", T0)
            await bus.wait_for_published(1)
            await clock.wait_for_sleepers(1)  # asleep again: the mark is done
            outcome = await timer.schedule("tenant-a", "call-1", at(10))
        assert outcome is CommandOutcome.IGNORED_REACHED


class SharedClockMemoryStore(MemoryTimerStore):
    """A memory store that offers a clock of its own, as PostgreSQL's offers the database's."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.own_clock = clock

    def shared_clock(self) -> FakeClock:
        return self.own_clock


class TestWhichClockDecides:
    async def test_a_store_that_shares_a_clock_decides_by_it(self) -> None:
        """Without a clock given, Timer decides due times and stamps reachedAt by the clock
        the store offers (SharedClockStore), not the host's."""
        shared = FakeClock(T0 - timedelta(hours=1))  # the store's clock: an hour behind
        store, bus = SharedClockMemoryStore(shared), MemoryEventBus()
        assert isinstance(store, SharedClockStore)
        async with Timer(store, bus, polling_interval=3600) as timer:
            assert timer.clock is shared
            await timer.schedule("tenant-a", "call-1", T0 - timedelta(minutes=30))
            await until(lambda: shared.pending_sleeps() == [1800.0])
            shared.advance(1800)
            (event,) = await bus.wait_for_published(1)
        assert event.payload.reached_at == T0 - timedelta(minutes=30)

    def test_a_clock_given_wins_and_other_stores_get_the_hosts(self) -> None:
        """A clock passed to Timer is used as it is; a store offering none gets SystemClock."""
        fake = FakeClock(T0)
        offering = SharedClockMemoryStore(FakeClock(T0))
        assert Timer(offering, MemoryEventBus(), clock=fake).clock is fake
        assert isinstance(Timer(MemoryTimerStore(), MemoryEventBus()).clock, SystemClock)
        assert not isinstance(MemoryTimerStore(), SharedClockStore)


class TestCommandPath:
    async def test_delivered_commands_are_stored_acked_and_wake_the_worker(self) -> None:
        """A command from the source is stored before its ack, and the worker wakes for it."""
        clock, store = FakeClock(T0), MemoryTimerStore()
        source = MemoryCommandSource()
        async with Timer(
            store, MemoryEventBus(), commands=source, clock=clock, polling_interval=60.0
        ) as timer:
            await until(lambda: clock.pending_sleeps() == [60.0])
            command = schedule_command("call-1", at(3))
            source.send(command)
            await source.wait_until_drained()
            assert source.acked == [command]
            assert await timer.get("tenant-a", "call-1") is not None
            await until(lambda: clock.pending_sleeps() == [3.0])

    async def test_remote_schedules_wake_the_worker_until_closed(self) -> None:
        """The store's remote-schedule hook is the worker's wake-up while running, then cleared."""
        clock, journal = FakeClock(T0), list[str]()
        store = JournalStore(journal)
        async with Timer(store, MemoryEventBus(), clock=clock, polling_interval=60.0):
            await until(lambda: clock.pending_sleeps() == [60.0])
            async with MemoryTimerStore(shared_with=store) as other:  # another instance
                await other.schedule(TimerEntry("tenant-a", "call-1", at(4), T0))
            assert store.remote is not None
            store.remote(at(4))
            await until(lambda: clock.pending_sleeps() == [4.0])
        assert store.remote is None


class TestLifecycle:
    async def test_start_and_stop_order(self) -> None:
        """Store, publisher, then loops start; the command loop stops first and the store last."""
        journal: list[str] = []
        store, source = JournalStore(journal), JournalSource(journal)
        timer = Timer(store, JournalBus(journal), commands=source, clock=FakeClock(T0))
        assert journal == []  # no I/O in the constructor
        async with timer:
            assert journal == ["store started", "publisher started"]
            await until(lambda: all(timer.health().components.values()))
        assert journal == [
            "store started",
            "publisher started",
            "command loop returned",
            "publisher closed",
            "store closed",
        ]
        assert timer.health().components == {"worker": False, "command loop": False}

    async def test_the_batch_in_flight_is_stored_and_acked_before_the_store_closes(
        self,
    ) -> None:
        """Closing while a command batch is being stored lets it finish and be acked first."""
        journal: list[str] = []
        store, source = JournalStore(journal), MemoryCommandSource()
        timer = Timer(store, MemoryEventBus(), commands=source, clock=FakeClock(T0))
        await timer.start()
        store.hold_apply = asyncio.Event()
        command = schedule_command("call-1", at(60))
        source.send(command)
        await until(lambda: "apply held" in journal)
        closing = asyncio.create_task(timer.aclose())
        await asyncio.sleep(0.01)
        assert not closing.done()
        assert "store closed" not in journal
        store.hold_apply.set()
        await closing
        assert source.acked == [command]
        assert journal[-1] == "store closed"
        async with MemoryTimerStore(shared_with=store) as reopened:
            assert await reopened.get(TenantId("tenant-a"), ServiceCallId("call-1")) is not None

    async def test_a_publisher_that_cannot_start_closes_the_store_again(self) -> None:
        """A publisher failing to start closes the store started before it; the error is raised."""
        journal: list[str] = []
        store = JournalStore(journal)
        bus = JournalBus(journal, start_error=ConnectionError("broker down"))
        with pytest.raises(ConnectionError, match="broker down"):
            async with Timer(store, bus, clock=FakeClock(T0)):
                pytest.fail("the body must not run")
        assert journal == ["store started", "store closed"]
        with pytest.raises(StoreUnavailable):
            await store.count_scheduled()

    async def test_a_timer_runs_once(self) -> None:
        """Starting a Timer again after it ran is refused; aclose stays idempotent."""
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0))
        async with timer:
            pass
        await timer.aclose()
        with pytest.raises(RuntimeError, match="runs only once"):
            await timer.start()

    async def test_closing_a_timer_never_started_is_harmless(self) -> None:
        """aclose on a Timer that never started does nothing and raises nothing."""
        await Timer(MemoryTimerStore(), MemoryEventBus()).aclose()

    async def test_schedule_before_start_raises_store_unavailable(self) -> None:
        """Scheduling on a Timer that was never started fails clearly: its store is not open."""
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0))
        with pytest.raises(StoreUnavailable, match="not started"):
            await timer.schedule("tenant-a", "call-1", at(1))

    async def test_wait_returns_once_closed(self) -> None:
        """wait() returns when the timer is closed by someone else."""
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0))
        async with timer:
            waiting = asyncio.create_task(timer.wait())
            await asyncio.sleep(0)
            assert not waiting.done()
        await asyncio.wait_for(waiting, 5)


class EqualStore(MemoryTimerStore):
    """A user's own store that equals every other of its kind (and so is unhashable)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EqualStore)


def assert_names_the_fix(error: StoreInUse) -> None:
    message = str(error)
    assert "another Timer runs on this store object" in message
    assert "a store object serves one Timer at a time" in message
    assert "Close that Timer first, or share it" in message
    assert "a store object of its own" in message
    assert error.owner == "this process"


class TestOneTimerPerStoreObject:
    """A store object given to two Timers at once would have each fire every timer: the
    second is refused at start, whatever the store; one after the other is fine."""

    async def test_a_second_timer_on_a_running_store_object_is_refused_at_start(self) -> None:
        """The second Timer's ``async with`` raises StoreInUse naming the fix, touching
        neither the store nor its own publisher; the first publishes each timer once."""
        journal: list[str] = []
        store, clock = JournalStore(journal), FakeClock(T0)
        bus, other_bus = MemoryEventBus(), JournalBus(journal)
        calls = [f"call-{n}" for n in range(40)]
        async with Timer(store, bus, clock=clock) as timer:
            refused = Timer(store, other_bus, clock=clock)
            with pytest.raises(StoreInUse) as caught:
                async with refused:
                    pytest.fail("the second Timer started")
            assert_names_the_fix(caught.value)
            assert journal == ["store started"]  # the refused Timer opened and closed nothing
            assert not refused.health().running
            for call in calls:
                await timer.schedule("tenant-a", call, T0)
            published = await bus.wait_for_published(len(calls))
            await timer.wait_until_idle()
        fired = Counter(str(event.payload.service_call_id) for event in published)
        assert fired == Counter(calls)  # every timer, once
        assert other_bus.published == []

    async def test_closing_a_refused_timer_leaves_the_store_object_to_the_first(self) -> None:
        """A refused Timer closed (or started again) takes nothing from the running one: a
        third is still refused, and the first keeps firing."""
        store, clock, bus = MemoryTimerStore(), FakeClock(T0), MemoryEventBus()
        async with Timer(store, bus, clock=clock) as timer:
            refused = Timer(store, MemoryEventBus(), clock=clock)
            with pytest.raises(StoreInUse):
                await refused.start()
            await refused.aclose()
            with pytest.raises(RuntimeError, match="runs only once"):
                await refused.start()
            with pytest.raises(StoreInUse):
                await Timer(store, MemoryEventBus(), clock=clock).start()
            await timer.schedule("tenant-a", "after-the-refusals", T0)
            (event,) = await bus.wait_for_published(1)
        assert event.payload.service_call_id == "after-the-refusals"

    async def test_a_closed_timers_store_object_runs_a_new_timer(self) -> None:
        """Timers one after the other on one store object (a host restarting its Timer,
        a test after another) each start and fire."""
        store, clock = MemoryTimerStore(), FakeClock(T0)
        for n in range(3):
            bus = MemoryEventBus()
            async with Timer(store, bus, clock=clock) as timer:
                await timer.schedule("tenant-a", f"call-{n}", T0)
                (event,) = await bus.wait_for_published(1)
            assert event.payload.service_call_id == f"call-{n}"

    async def test_a_failed_start_gives_the_store_object_back(self) -> None:
        """A Timer whose publisher cannot start holds no store object afterwards."""
        store, clock = MemoryTimerStore(), FakeClock(T0)
        failing = JournalBus([], start_error=ConnectionError("broker down"))
        with pytest.raises(ConnectionError, match="broker down"):
            async with Timer(store, failing, clock=clock):
                pytest.fail("the body must not run")
        bus = MemoryEventBus()
        async with Timer(store, bus, clock=clock) as timer:
            await timer.schedule("tenant-a", "call-1", T0)
            (event,) = await bus.wait_for_published(1)
        assert event.payload.service_call_id == "call-1"

    async def test_store_objects_are_told_apart_by_identity(self) -> None:
        """A user's store that equals (and cannot be hashed like) every other of its kind:
        two such objects run a Timer each, and the same one is still refused."""
        clock = FakeClock(T0)
        first, second = EqualStore(), EqualStore()
        assert first == second
        async with (
            Timer(first, MemoryEventBus(), clock=clock),
            Timer(second, MemoryEventBus(), clock=clock),
        ):
            with pytest.raises(StoreInUse):
                await Timer(first, MemoryEventBus(), clock=clock).start()


class TestFailures:
    async def test_a_dead_command_loop_surfaces_from_wait(self) -> None:
        """A command loop that dies is raised by wait() as ComponentFailed, with its cause."""
        source = BrokenSource()
        async with Timer(
            MemoryTimerStore(), MemoryEventBus(), commands=source, clock=FakeClock(T0)
        ) as timer:
            source.go.set()
            with pytest.raises(ComponentFailed, match="command loop stopped") as raised:
                await asyncio.wait_for(timer.wait(), 5)
            health = timer.health()
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert not health.running
        assert health.components == {"worker": True, "command loop": False}
        assert health.failure is not None and "consumer timer-service was deleted" in health.failure

    @staticmethod
    async def run_until_the_loop_dies(*, then_raise: BaseException | None = None) -> None:
        """Run a Timer whose command loop dies, leaving the block once that is seen."""
        source = BrokenSource()
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), commands=source, clock=FakeClock(T0))
        async with timer:
            source.go.set()
            await until(lambda: timer.health().failure is not None)
            if then_raise is not None:
                raise then_raise

    async def test_a_dead_component_surfaces_on_leaving_the_block(self) -> None:
        """A failure nobody waited for is raised when the host leaves ``async with``."""
        with pytest.raises(ComponentFailed, match="consumer timer-service was deleted"):
            await self.run_until_the_loop_dies()

    async def test_the_hosts_own_error_is_not_masked(self) -> None:
        """If the block raises, that error propagates, not the component's failure."""
        with pytest.raises(KeyError):
            await self.run_until_the_loop_dies(then_raise=KeyError("the host's own"))


class TestHealth:
    async def test_health_reports_components_and_the_last_pass(self) -> None:
        """Before start nothing runs; once running, both loops run and a pass is recorded."""
        clock = FakeClock(T0)
        timer = Timer(
            MemoryTimerStore(), MemoryEventBus(), commands=MemoryCommandSource(), clock=clock
        )
        before = timer.health()
        assert (before.running, before.components, before.last_pass_age_s) == (False, {}, None)
        async with timer:
            await until(lambda: timer.health().passes >= 1)
            clock.advance(1.5)
            health = timer.health()
        assert health.running
        assert health.components == {"worker": True, "command loop": True}
        assert health.last_pass_age_s == pytest.approx(1.5)
        assert not timer.health().running

    async def test_health_reports_how_long_commands_have_been_quiet(self) -> None:
        """last_commands_age_s is None until a batch of commands is stored (from the source
        or by schedule()/cancel()), then the time since the last one."""
        clock, source = FakeClock(T0), MemoryCommandSource()
        async with Timer(
            MemoryTimerStore(), MemoryEventBus(), commands=source, clock=clock
        ) as timer:
            assert timer.health().last_commands_age_s is None
            source.send(schedule_command("call-1", at(3600)))
            await source.wait_until_drained()
            clock.advance(2.0)
            assert timer.health().last_commands_age_s == pytest.approx(2.0)
            await timer.cancel("tenant-a", "call-1")
            clock.advance(0.5)
            assert timer.health().last_commands_age_s == pytest.approx(0.5)


class TestBadInput:
    @pytest.mark.parametrize(
        "options",
        [
            {"polling_interval": 0},
            {"polling_interval": -1.0},
            {"polling_interval": float("nan")},
            {"polling_interval": float("inf")},
            {"batch_size": 0},
            {"batch_size": -5},
            {"batch_size": 2.5},
            {"retention": timedelta(days=-1)},
            {"retention": timedelta(0)},
        ],
        ids=repr,
    )
    def test_nonsensical_worker_settings_are_rejected_at_once(
        self, options: dict[str, object]
    ) -> None:
        """A Timer (and a TimerWorker) refuses a nonsensical setting, naming it, when built."""
        (name,) = options
        with pytest.raises(ValidationError, match=name):
            Timer(MemoryTimerStore(), MemoryEventBus(), **options)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=name):
            TimerWorker(MemoryTimerStore(), MemoryEventBus(), FakeClock(T0), **options)  # type: ignore[arg-type]

    async def test_the_last_microsecond_of_9999_is_a_validation_error(self) -> None:
        """A due time that cannot be rounded up to a millisecond is a ValidationError."""
        last = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
        async with Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(T0)) as timer:
            with pytest.raises(ValidationError, match="9999-12-31"):
                await timer.schedule("tenant-a", "call-1", last)
            assert await timer.store.count_scheduled() == 0

    def test_the_last_microsecond_of_9999_is_refused_by_the_message_and_the_codec(self) -> None:
        """ScheduleTimer and the wire codec both turn the overflow into a ValidationError."""
        last = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
        with pytest.raises(InvalidTimestamp, match="9999-12-31"):
            ScheduleTimer("tenant-a", "call-1", last)
        wire = encode_envelope(schedule_command("call-1", at(1))).replace(
            format_timestamp(at(1)).encode(), b"9999-12-31T23:59:59.9999995Z"
        )
        with pytest.raises(DecodeError, match="dueAt"):
            decode_command(wire)
