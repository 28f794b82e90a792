"""The worker loop, driven by a FakeClock: when it sleeps, wakes, drains, backs off and stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import (
    Command,
    DueTimeReached,
    EnvelopeId,
    EventPublisher,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    ScheduleTimer,
    ServiceCallId,
    StoreUnavailable,
    SystemClock,
    TenantId,
    TimerEntry,
    TimerState,
    TimerWorker,
)
from timer_core.commands import handle_commands, schedule_timer

T0 = datetime(2030, 1, 1, tzinfo=UTC)
A = TenantId("tenant-a")


def at(seconds: float) -> datetime:
    """The instant ``seconds`` after T0."""
    return T0 + timedelta(seconds=seconds)


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate`` holds (fails after 5 real seconds)."""
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0)


class Errors(Instrumentation):
    """Counts failed worker passes."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def worker_error(self, error: BaseException) -> None:
        self.errors.append(error)


class Rig:
    """A store, a bus and a fake clock, and the workers started over them."""

    def __init__(self) -> None:
        self.store = MemoryTimerStore()
        self.bus = MemoryEventBus()
        self.clock = FakeClock(T0)
        self.instrumentation = Errors()
        self.runs: list[tuple[TimerWorker, asyncio.Future[None]]] = []

    def start(self, publisher: EventPublisher | None = None, **options: float) -> TimerWorker:
        """Start a worker (polling every 5 s, batches of 10, backoff 0.05 s to 0.4 s)."""
        settings: dict[str, float] = {
            "polling_interval": 5.0,
            "batch_size": 10,
            "initial_backoff": 0.05,
            "max_backoff": 0.4,
            **options,
        }
        worker = TimerWorker(
            self.store,
            publisher or self.bus,
            self.clock,
            polling_interval=settings["polling_interval"],
            batch_size=int(settings["batch_size"]),
            initial_backoff=settings["initial_backoff"],
            max_backoff=settings["max_backoff"],
            instrumentation=self.instrumentation,
        )
        self.runs.append((worker, asyncio.ensure_future(worker.run())))
        return worker

    async def schedule(self, call: str, due: float | datetime, tenant: str = "tenant-a") -> None:
        """Store a timer (without telling any worker)."""
        due_at = due if isinstance(due, datetime) else at(due)
        envelope: MessageEnvelope[Command] = MessageEnvelope(
            id=EnvelopeId.generate(), payload=ScheduleTimer(tenant, call, due_at), timestamp_ms=0
        )
        await handle_commands(self.store, [envelope], self.clock)

    async def asleep(self, worker: TimerWorker, seconds: float, *, after_pass: int = 0) -> None:
        """Wait until the worker, past pass ``after_pass``, sleeps with ``seconds`` to go."""
        await until(
            lambda: worker.passes >= after_pass and self.clock.pending_sleeps() == [seconds]
        )

    def published_calls(self) -> list[str]:
        """The service call ids of the accepted events, in order."""
        return [str(e.payload.service_call_id) for e in self.bus.published]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """A rig whose workers are stopped, and must return, after the test."""
    rig = Rig()
    await rig.store.start()
    try:
        yield rig
    finally:
        for worker, _ in rig.runs:
            worker.stop()
        for _, task in rig.runs:
            await asyncio.wait_for(task, 5)


class TestSleeping:
    """The worker sleeps until the next due time, capped by the polling interval."""

    async def test_sleeps_until_the_earliest_due_time(self, rig: Rig) -> None:
        """With timers pending, it sleeps exactly until the earliest and fires it then."""
        await rig.schedule("second", 3)
        await rig.schedule("first", 2)
        worker = rig.start()
        await rig.asleep(worker, 2.0)
        assert rig.bus.published == []
        rig.clock.advance(2)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.service_call_id == "first"
        assert event.payload.reached_at == at(2)
        await rig.asleep(worker, 1.0)
        rig.clock.advance(1)
        await rig.bus.wait_for_published(2)
        assert rig.published_calls() == ["first", "second"]

    async def test_never_sleeps_longer_than_the_polling_interval(self, rig: Rig) -> None:
        """With nothing due soon, it sleeps one polling interval at a time."""
        await rig.schedule("far", 60)
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        rig.clock.advance(5)
        await rig.asleep(worker, 5.0, after_pass=2)
        assert rig.bus.published == []

    async def test_empty_store_sleeps_the_polling_interval(self, rig: Rig) -> None:
        """With no timer at all, it sleeps one polling interval."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)

    async def test_polling_finds_timers_written_behind_its_back(self, rig: Rig) -> None:
        """A timer stored without notify fires at the next poll, never before its due time."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        await rig.schedule("quiet", 1)
        rig.clock.advance(1)
        await rig.asleep(worker, 4.0)
        assert rig.bus.published == []
        rig.clock.advance(4)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(5)

    async def test_notify_of_an_earlier_timer_wakes_it_at_once(self, rig: Rig) -> None:
        """notify_scheduled with a due time before the wake-up shortens the sleep at once."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        await rig.schedule("soon", 1)
        worker.notify_scheduled(at(1))
        await rig.asleep(worker, 1.0, after_pass=2)
        rig.clock.advance(1)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(1)

    async def test_notify_of_a_due_timer_fires_it_without_time_passing(self, rig: Rig) -> None:
        """A timer already due when notified fires without the clock moving."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        await rig.schedule("now", 0)
        worker.notify_scheduled(at(0))
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(0)
        assert rig.clock.monotonic() == 0

    async def test_notify_of_a_later_timer_does_not_wake_it(self, rig: Rig) -> None:
        """notify_scheduled with a due time after the wake-up leaves the worker asleep."""
        await rig.schedule("first", 2)
        worker = rig.start()
        await rig.asleep(worker, 2.0)
        passes = worker.passes
        await rig.schedule("later", 4)
        worker.notify_scheduled(at(4))
        for _ in range(20):
            await asyncio.sleep(0)
        assert worker.passes == passes
        assert rig.clock.pending_sleeps() == [2.0]


class TestBacklog:
    """A backlog is drained batch after batch with no sleep in between."""

    async def test_drains_several_full_batches_without_sleeping(self, rig: Rig) -> None:
        """35 overdue timers with batches of 10 all fire while the fake clock stands still."""
        for i in range(35):
            await rig.schedule(f"c{i:02d}", -3600 + i)
        worker = rig.start()
        await rig.bus.wait_for_published(35)
        assert rig.published_calls() == [f"c{i:02d}" for i in range(35)]
        await rig.asleep(worker, 5.0)
        assert rig.clock.monotonic() == 0
        assert worker.passes >= 4


class TestFailures:
    """Failed passes are retried with capped exponential backoff; the loop never dies."""

    async def test_store_errors_back_off_exponentially_and_recover(self, rig: Rig) -> None:
        """While the store is down the waits double up to the cap; then timers fire again."""
        rig.store.set_unavailable(True)
        worker = rig.start()
        waits = []
        for _ in range(6):
            await until(lambda: rig.clock.sleepers == 1)
            (wait,) = rig.clock.pending_sleeps()
            waits.append(wait)
            rig.clock.advance(wait)
        assert waits == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
        await until(lambda: rig.clock.pending_sleeps() == [0.4])
        assert len(rig.instrumentation.errors) == 7
        rig.store.set_unavailable(False)
        await rig.schedule("after-outage", 0)
        rig.clock.advance(0.4)
        await rig.bus.wait_for_published(1)
        await rig.asleep(worker, 5.0)
        assert not rig.runs[0][1].done()

    async def test_backoff_resets_after_a_good_pass(self, rig: Rig) -> None:
        """After a successful pass, the next failure waits the initial backoff again."""
        rig.store.fail_next(3, methods=["find_due"])
        worker = rig.start()
        for wait in (0.05, 0.1, 0.2):
            await rig.asleep(worker, wait)
            rig.clock.advance(wait)
        await rig.asleep(worker, 5.0)
        rig.store.fail_next(1, methods=["find_due"])
        rig.clock.advance(5)
        await rig.asleep(worker, 0.05)

    async def test_unexpected_errors_do_not_kill_the_loop(self, rig: Rig) -> None:
        """A publisher that raises (a bug) fails the pass, which is retried after a backoff."""

        class Flaky(EventPublisher):
            calls = 0

            async def publish_many(
                self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
            ) -> list[PublishError | None]:
                Flaky.calls += 1
                if Flaky.calls == 1:
                    raise RuntimeError("bug in a publisher")
                return await rig.bus.publish_many(envelopes)

        await rig.schedule("x", 0)
        worker = rig.start(Flaky())
        await rig.asleep(worker, 0.05)
        assert isinstance(rig.instrumentation.errors[0], RuntimeError)
        rig.clock.advance(0.05)
        await rig.bus.wait_for_published(1)

    async def test_publish_failures_back_off_instead_of_spinning(self, rig: Rig) -> None:
        """A timer whose publish keeps failing is retried after growing waits, same id."""
        rig.bus.fail_when(lambda e: e.payload.service_call_id == "bad")
        await rig.schedule("bad", 0)
        await rig.schedule("good", 0)
        worker = rig.start()
        await rig.bus.wait_for_published(1)
        await rig.asleep(worker, 0.05)
        bad_attempts = [e for e in rig.bus.publish_attempts if e.payload.service_call_id == "bad"]
        assert len(bad_attempts) == 1
        rig.clock.advance(0.05)
        await rig.asleep(worker, 0.1)
        rig.bus.fail_when(None)
        rig.clock.advance(0.1)
        await rig.bus.wait_for_published(2)
        assert rig.published_calls() == ["good", "bad"]
        ids = {e.id for e in rig.bus.publish_attempts if e.payload.service_call_id == "bad"}
        assert len(ids) == 1
        await rig.asleep(worker, 5.0)

    async def test_backoff_never_exceeds_the_polling_interval(self, rig: Rig) -> None:
        """With a polling interval below the backoff cap, failures retry once per interval."""
        rig.bus.set_unavailable(True)
        await rig.schedule("x", 0)
        worker = rig.start(polling_interval=0.15, max_backoff=30.0)
        for wait in (0.05, 0.1, 0.15, 0.15):
            await rig.asleep(worker, wait)
            rig.clock.advance(wait)
        rig.bus.set_unavailable(False)
        await rig.asleep(worker, 0.15)
        rig.clock.advance(0.15)
        await rig.bus.wait_for_published(1)

    async def test_failing_timers_do_not_starve_later_batches(self, rig: Rig) -> None:
        """Full batches of failing timers are stepped over, so later due timers still fire."""
        rig.bus.fail_when(lambda e: e.payload.service_call_id.startswith("bad"))
        for i in range(4):
            await rig.schedule(f"bad{i}", -10 + i)
        for i in range(3):
            await rig.schedule(f"good{i}", -5 + i)
        rig.start(batch_size=2)
        await rig.bus.wait_for_published(3)
        assert rig.published_calls() == ["good0", "good1", "good2"]
        assert rig.clock.monotonic() == 0


class TestStopping:
    """stop() lets the pass in flight finish, then run() returns."""

    async def test_stop_finishes_the_pass_in_flight(self, rig: Rig) -> None:
        """Stopping while a batch is being published still marks it, then run returns."""
        entered = asyncio.Event()
        release = asyncio.Event()

        class Gated(EventPublisher):
            async def publish_many(
                self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
            ) -> list[PublishError | None]:
                entered.set()
                await release.wait()
                return await rig.bus.publish_many(envelopes)

        await rig.schedule("x", 0)
        worker = rig.start(Gated())
        await asyncio.wait_for(entered.wait(), 5)
        worker.stop()
        assert worker.stopping
        for _ in range(10):
            await asyncio.sleep(0)
        task = rig.runs[0][1]
        assert not task.done()
        release.set()
        await asyncio.wait_for(task, 5)
        stored = await rig.store.get(A, ServiceCallId("x"))
        assert stored is not None
        assert stored.state is TimerState.REACHED

    async def test_stop_while_asleep_returns_at_once(self, rig: Rig) -> None:
        """A sleeping worker returns from run as soon as it is stopped, without time passing."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        worker.stop()
        await asyncio.wait_for(rig.runs[0][1], 5)

    async def test_stop_during_backoff_returns_at_once(self, rig: Rig) -> None:
        """A worker backing off from a store outage returns as soon as it is stopped."""
        rig.store.set_unavailable(True)
        worker = rig.start()
        await rig.asleep(worker, 0.05)
        worker.stop()
        await asyncio.wait_for(rig.runs[0][1], 5)

    async def test_a_worker_runs_once_at_a_time(self, rig: Rig) -> None:
        """Running one worker twice at once is refused."""
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        with pytest.raises(RuntimeError):
            await worker.run()


class TestWallClock:
    """Due times are compared with the wall clock, and sleeping with the monotonic one."""

    async def test_wall_clock_jumping_back_fires_nothing_early(self, rig: Rig) -> None:
        """After the wall clock jumps back an hour, nothing fires before its due time."""
        await rig.schedule("t", 10)
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        rig.clock.set_wall(T0 - timedelta(hours=1))
        for n in range(2, 6):
            rig.clock.advance(5)
            await rig.asleep(worker, 5.0, after_pass=n)
        assert rig.bus.published == []
        rig.clock.set_wall(at(9.999))
        rig.clock.advance(5)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(14.999)
        assert event.payload.reached_at >= event.payload.due_at

    async def test_wall_clock_jumping_forward_fires_what_is_due(self, rig: Rig) -> None:
        """After the wall clock jumps forward, the next wake-up fires the timers now due."""
        await rig.schedule("t", 3600)
        worker = rig.start()
        await rig.asleep(worker, 5.0)
        rig.clock.set_wall(at(7200))
        rig.clock.advance(5)
        (event,) = await rig.bus.wait_for_published(1)
        assert event.payload.reached_at == at(7205)


class TestRealClock:
    """With the real clock, the worker wakes on the due time, not on the next poll."""

    async def test_timer_fires_on_due_time_despite_long_polling_interval(self) -> None:
        """Polling every 60 s, a timer scheduled 100 ms ahead fires in under a second."""
        store = MemoryTimerStore()
        await store.start()
        bus = MemoryEventBus()
        clock = SystemClock()
        worker = TimerWorker(store, bus, clock, polling_interval=60.0)
        task = asyncio.ensure_future(worker.run())
        try:
            await until(lambda: worker.passes >= 1)
            due = clock.now() + timedelta(milliseconds=100)
            started = time.monotonic()
            await schedule_timer(store, ScheduleTimer(A, "soon", due), clock)
            worker.notify_scheduled(due)
            (event,) = await asyncio.wait_for(bus.wait_for_published(1), 1.0)
            elapsed = time.monotonic() - started
            assert elapsed < 1.0
            assert event.payload.reached_at >= event.payload.due_at
        finally:
            worker.stop()
            await asyncio.wait_for(task, 5)


class HeldMarks(MemoryTimerStore):
    """A memory store whose marks wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.marking = 0

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        self.marking += 1
        await self.release.wait()
        return await super().mark_reached(entries)


class TestMarksInTheBackground:
    """The worker looks for newly due timers while the last ones are being marked."""

    async def test_a_timer_due_meanwhile_fires_before_the_last_mark_ends(self, rig: Rig) -> None:
        """With x's mark held, y (due meanwhile) is published without waiting for it."""
        rig.store = store = HeldMarks()
        await store.start()
        await rig.schedule("x", 0)
        rig.start()
        await until(lambda: rig.published_calls() == ["x"] and store.marking == 1)
        await rig.schedule("y", 0)
        rig.runs[0][0].notify_scheduled(at(0))  # as the service does for a stored command
        await until(lambda: rig.published_calls() == ["x", "y"])
        states = {str(e.service_call_id): e.state for e in store.entries()}
        assert states == {"x": TimerState.SCHEDULED, "y": TimerState.SCHEDULED}
        store.release.set()
        await until(lambda: {e.state for e in store.entries()} == {TimerState.REACHED})
        assert rig.published_calls() == ["x", "y"]  # each once

    async def test_stop_waits_for_the_last_mark(self, rig: Rig) -> None:
        """run() returns only once the mark in the background is done."""
        rig.store = store = HeldMarks()
        await store.start()
        await rig.schedule("x", 0)
        worker = rig.start()
        await until(lambda: store.marking == 1)
        worker.stop()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not rig.runs[0][1].done()
        store.release.set()
        await asyncio.wait_for(rig.runs[0][1], 5)
        assert [e.state for e in store.entries()] == [TimerState.REACHED]

    async def test_failing_marks_back_off_like_failing_passes(self, rig: Rig) -> None:
        """A mark finished in the background that fails counts as a failed pass: the worker
        backs off, doubling, instead of publishing and failing again in a spin."""

        class FailingMarks(MemoryTimerStore):
            async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
                raise StoreUnavailable("disk full (test)")

        rig.store = FailingMarks()
        await rig.store.start()
        await rig.schedule("x", 0)
        rig.start()
        waits = []
        for _ in range(4):
            await until(lambda: rig.clock.sleepers == 1)
            (wait,) = rig.clock.pending_sleeps()
            waits.append(wait)
            rig.clock.advance(wait)
        assert waits == [0.05, 0.1, 0.2, 0.4]
        assert all(isinstance(e, StoreUnavailable) for e in rig.instrumentation.errors)
