"""Timer(store, handler=...): the host's function is called with each due timer, in memory."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryTimerStore
from timer_core import (
    BatchObserver,
    ConfigurationError,
    DueCursor,
    DueTimeReached,
    HandlerFailed,
    HandlerSettings,
    Instrumentation,
    MessageEnvelope,
    Timer,
    TimerEntry,
    TimerState,
    TraceContext,
    ValidationError,
)

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
Event = MessageEnvelope[DueTimeReached]


class Recorder:
    """A handler that records what it was called with, failing for the calls told to."""

    def __init__(self, failing: set[str] | None = None) -> None:
        self.calls: list[Event] = []
        self.failing = failing or set()

    async def __call__(self, event: Event) -> None:
        self.calls.append(event)
        if event.payload.service_call_id in self.failing:
            raise RuntimeError(f"cannot handle {event.payload.service_call_id}")


class Counting(Instrumentation):
    """Counts what the handler path reports, as metrics would."""

    def __init__(self) -> None:
        self.fired: list[TimerEntry] = []
        self.failed: list[HandlerFailed] = []
        self.quarantined: list[int] = []

    def timers_fired(self, entries: object) -> None:
        self.fired.extend(entries)  # type: ignore[call-overload]

    def publish_failed(self, entry: TimerEntry, error: object) -> None:
        assert isinstance(error, HandlerFailed)
        self.failed.append(error)

    def timer_quarantined(self, entry: TimerEntry, error: object, failures: int) -> None:
        self.quarantined.append(failures)


class TestDelivery:
    async def test_a_due_timer_is_handed_to_the_handler_and_then_marked(self) -> None:
        """The handler gets the DueTimeReached envelope; the timer is Reached after it returned."""
        handler = Recorder()
        clock = FakeClock(T0)
        async with Timer(MemoryTimerStore(), handler=handler, clock=clock) as timer:
            await timer.schedule(
                "shop-1", "order-1", T0 + timedelta(seconds=30), correlation_id="r"
            )
            await timer.wait_until_idle()
            assert handler.calls == []  # never early
            clock.advance(30)
            await timer.wait_until_idle()
            (event,) = handler.calls
            stored = await timer.get("shop-1", "order-1")
        assert event.payload.due_at == T0 + timedelta(seconds=30)
        assert event.correlation_id == "r"
        assert stored is not None and stored.state is TimerState.REACHED
        assert stored.reached_at == event.payload.reached_at

    async def test_a_sync_handler_runs_in_a_thread(self) -> None:
        """A plain function is called off the event loop's thread."""
        threads: list[str] = []

        def handler(event: Event) -> None:
            threads.append(threading.current_thread().name)

        async with Timer(MemoryTimerStore(), handler=handler, clock=FakeClock(T0)) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.wait_until_idle()
        assert len(threads) == 1 and threads[0].startswith("timer-handler")

    async def test_a_failing_handler_is_retried_with_backoff_then_quarantined(self) -> None:
        """Failures back off (doubling, no jitter here) and end in quarantine with the error."""
        handler = Recorder(failing={"order-1"})
        clock = FakeClock(T0)
        settings = HandlerSettings(max_attempts=3, retry_delay_s=1.0, jitter=0.0)
        metrics = Counting()
        async with Timer(
            MemoryTimerStore(),
            handler=handler,
            handler_settings=settings,
            clock=clock,
            instrumentation=metrics,
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.schedule("shop-1", "order-2", T0)
            await timer.wait_until_idle()
            assert [c.payload.service_call_id for c in handler.calls].count("order-1") == 1
            assert [e.service_call_id for e in metrics.fired] == ["order-2"]
            clock.advance(0.999)
            await timer.wait_until_idle()
            assert len(handler.calls) == 2  # not retried before its delay
            clock.advance(0.001)
            await timer.wait_until_idle()
            assert len(handler.calls) == 3
            clock.advance(2.0)
            await timer.wait_until_idle()
            assert len(handler.calls) == 4
            (quarantined,) = timer.quarantined
            assert quarantined.failures == 3
            assert "RuntimeError: cannot handle order-1" in quarantined.error
            clock.advance(3600)
            await timer.wait_until_idle()
            assert len(handler.calls) == 4  # left out
            stored = await timer.get("shop-1", "order-1")
            assert stored is not None and stored.state is TimerState.SCHEDULED
            handler.failing.clear()
            assert timer.retry_quarantined() == 1
            await timer.wait_until_idle()
            stored = await timer.get("shop-1", "order-1")
        assert stored is not None and stored.state is TimerState.REACHED
        assert metrics.quarantined == [3] and len(metrics.failed) == 3

    async def test_a_call_past_its_timeout_counts_as_failed(self) -> None:
        """An async handler that outlives timeout_s is cancelled and retried."""
        calls = 0

        async def handler(event: Event) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                await asyncio.sleep(3600)

        settings = HandlerSettings(timeout_s=0.05, retry_delay_s=0.01, jitter=0.0)
        async with Timer(MemoryTimerStore(), handler=handler, handler_settings=settings) as timer:
            await timer.schedule("shop-1", "order-1", datetime.now(UTC))
            deadline = time.monotonic() + 60  # a budget for a busy machine, not a figure
            while (stored := await timer.get("shop-1", "order-1")) is not None and (
                stored.state is not TimerState.REACHED
            ):
                assert time.monotonic() < deadline, f"not Reached after {calls} calls"
                await asyncio.sleep(0.01)
        assert calls == 2
        assert stored is not None and stored.state is TimerState.REACHED

    async def test_a_timeout_is_each_calls_own_whenever_it_started(self) -> None:
        """The calls a find hands out share one deadline, from the turn they begin on: the
        hung call of the first find times out, the quick one beside it does not, and a call
        of a later find that outlives the first find's deadline keeps its own."""
        hung = asyncio.Event()
        ended: list[str] = []

        async def handler(event: Event) -> None:
            call = event.payload.service_call_id
            if call == "hangs" and not hung.is_set():
                hung.set()
                await asyncio.sleep(3600)
            if call == "later":
                await asyncio.sleep(0.6)
            ended.append(call)

        metrics = Counting()
        settings = HandlerSettings(timeout_s=1.0, retry_delay_s=0.01, jitter=0.0)
        now = datetime.now(UTC)
        async with Timer(
            MemoryTimerStore(), handler=handler, handler_settings=settings, instrumentation=metrics
        ) as timer:
            await timer.schedule("shop-1", "hangs", now)
            await timer.schedule("shop-1", "quick", now)
            await timer.schedule("shop-2", "later", now + timedelta(seconds=0.6))
            deadline = time.monotonic() + 60  # a budget for a busy machine, not a figure
            while len(metrics.fired) < 3:
                assert time.monotonic() < deadline, f"only {ended} handled"
                await asyncio.sleep(0.01)
        assert [str(error) for error in metrics.failed] == [
            "the handler of shop-1/hangs failed: timed out after 1s"
        ]
        assert sorted(ended) == ["hangs", "later", "quick"]

    async def test_calls_run_under_an_eager_task_factory(self) -> None:
        """A host's task factory makes the calls' tasks (an eager one, where Python has it,
        runs a call that needs no wait to its end at once): every timer is handled and the
        Timer closes at once, waiting on no call that has ended."""
        loop = asyncio.get_running_loop()
        eager = getattr(asyncio, "eager_task_factory", None)
        loop.set_task_factory(eager or (lambda loop, coro, **kw: asyncio.Task(coro, loop=loop)))
        try:
            handler = Recorder()
            metrics = Counting()
            timer = Timer(MemoryTimerStore(), handler=handler, instrumentation=metrics)
            async with timer:
                for n in range(50):
                    await timer.schedule("shop-1", f"order-{n}", datetime.now(UTC))
                deadline = time.monotonic() + 60  # a budget for a busy machine, not a figure
                while len(metrics.fired) < 50:
                    assert time.monotonic() < deadline, f"{len(metrics.fired)} of 50 handled"
                    await asyncio.sleep(0.01)
            assert len(handler.calls) == 50
        finally:
            loop.set_task_factory(None)


class Tracing(Instrumentation):
    """Puts a span's trace context on each firing, as the OpenTelemetry instrumentation does,
    and records what its observer is told."""

    def __init__(self) -> None:
        self.results: list[object] = []
        self.finished = 0

    def firing_started(self, envelopes: list[Event]) -> BatchObserver:
        span = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        envelopes[:] = [envelope.with_trace_context(span) for envelope in envelopes]
        tracer = self

        class Observer(BatchObserver):
            def published(self, results: object) -> None:
                tracer.results.append(list(results))  # type: ignore[call-overload]

            def finished(self, error: BaseException | None = None) -> None:
                tracer.finished += 1

        return Observer()


class TestInstrumentation:
    async def test_the_handler_gets_the_firing_span_and_the_observer_its_results(self) -> None:
        """The envelope the instrumentation traced is the one handed over; the batch's
        observer sees one result per call (None for success), then its end."""
        handler = Recorder(failing={"order-2"})
        tracing = Tracing()
        async with Timer(
            MemoryTimerStore(), handler=handler, clock=FakeClock(T0), instrumentation=tracing
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.schedule("shop-1", "order-2", T0)
            await timer.wait_until_idle()
        assert {c.trace_context.span_id for c in handler.calls} == {"b7ad6b7169203331"}  # type: ignore[union-attr]
        results = [result for batch in tracing.results for result in batch]  # type: ignore[attr-defined]
        assert results.count(None) == 1
        assert [type(r) for r in results if r is not None] == [HandlerFailed]
        assert tracing.finished == len(tracing.results)


class TestForgetting:
    async def test_a_cancelled_timer_backing_off_is_forgotten_not_waited_for(self) -> None:
        """Cancelled during its backoff, a failing timer leaves the worker idle after the
        retry time instead of waking it for a retry that cannot come."""
        handler = Recorder(failing={"order-1"})
        clock = FakeClock(T0)
        settings = HandlerSettings(retry_delay_s=1.0, jitter=0.0)
        async with Timer(
            MemoryTimerStore(), handler=handler, handler_settings=settings, clock=clock
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.wait_until_idle()
            await timer.cancel("shop-1", "order-1")
            clock.advance(1.0)
            await timer.wait_until_idle(timeout=5)
            passes = timer.health().passes
            clock.advance(1.0)
            await timer.wait_until_idle(timeout=5)
            assert timer.health().passes - passes <= 1
        assert len(handler.calls) == 1

    async def test_a_quarantined_timer_cancelled_meanwhile_leaves_the_list(self) -> None:
        """Within a minute of its cancel, a quarantined timer is no longer listed."""
        handler = Recorder(failing={"order-1"})
        clock = FakeClock(T0)
        settings = HandlerSettings(max_attempts=1)
        async with Timer(
            MemoryTimerStore(), handler=handler, handler_settings=settings, clock=clock
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.wait_until_idle()
            assert len(timer.quarantined) == 1
            await timer.cancel("shop-1", "order-1")
            clock.advance(61)
            await timer.wait_until_idle()
            clock.advance(5)
            await timer.wait_until_idle()
            assert timer.quarantined == []


class GatedReads(MemoryTimerStore):
    """A store whose next find, once armed, answers late (its snapshot taken, its answer
    held until ``answer`` is set) and whose marks wait for ``commit``: the interleaving of
    a read and a mark on another thread, made to order."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.reading = asyncio.Event()
        self.answer = asyncio.Event()
        self.marking = asyncio.Event()
        self.commit = asyncio.Event()

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        found = await super().find_due(now, limit, after=after)
        if self.armed:
            self.armed = False
            self.reading.set()
            await self.answer.wait()
        return found

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        self.marking.set()
        await self.commit.wait()
        return await super().mark_reached(entries)


class TestMarkedWhileRead:
    async def test_a_timer_marked_while_a_find_read_is_not_handed_out_again(self) -> None:
        """A find that read a timer before its mark committed, and answers after, does not
        hand it to the handler a second time."""
        handler = Recorder()
        clock = FakeClock(T0)
        store = GatedReads()
        metrics = Counting()
        async with Timer(store, handler=handler, clock=clock, instrumentation=metrics) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await asyncio.wait_for(store.marking.wait(), 60)  # handled, its mark waits
            store.armed = True
            await timer.schedule("shop-1", "order-2", T0)  # wakes a pass, whose find...
            await asyncio.wait_for(store.reading.wait(), 60)  # ...read order-1 Scheduled
            store.commit.set()
            deadline = time.monotonic() + 60
            while not metrics.fired:  # the worker has seen the mark end
                assert time.monotonic() < deadline, "order-1 was never marked"
                await asyncio.sleep(0.001)
            store.answer.set()  # the read answers after the mark
            await timer.wait_until_idle()
        assert [c.payload.service_call_id for c in handler.calls] == ["order-1", "order-2"]


class TestReadAhead:
    async def test_a_page_read_ahead_and_not_taken_at_once_is_read_again(self) -> None:
        """With every place taken, the page read ahead is dropped: a timer cancelled before a
        place frees up is not handed out from it."""
        release = asyncio.Event()
        calls: list[str] = []

        async def handler(event: Event) -> None:
            calls.append(event.payload.service_call_id)
            if event.payload.service_call_id == "order-1":
                await release.wait()

        clock = FakeClock(T0)
        settings = HandlerSettings(max_concurrency=1)
        async with Timer(
            MemoryTimerStore(),
            handler=handler,
            handler_settings=settings,
            clock=clock,
            batch_size=1,
        ) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            await timer.schedule("shop-1", "order-2", T0)
            await clock.wait_for_sleepers(timeout=60)  # order-1 runs, order-2 read ahead
            assert calls == ["order-1"]
            await timer.cancel("shop-1", "order-2")
            release.set()
            await timer.wait_until_idle()
        assert calls == ["order-1"]

    async def test_a_timer_cancelled_during_a_drain_is_not_handed_out_from_a_read_ahead(
        self,
    ) -> None:
        """A drain reads its next page before this one is handed out; a timer of that page
        cancelled meanwhile (here by the first call) is not handed out from it."""
        timer: Timer
        calls: list[str] = []

        async def handler(event: Event) -> None:
            calls.append(event.payload.service_call_id)
            if event.payload.service_call_id == "order-00":
                await timer.cancel("shop-1", "order-15")

        clock = FakeClock(T0)
        async with Timer(MemoryTimerStore(), handler=handler, clock=clock, batch_size=10) as timer:
            for n in range(30):
                await timer.schedule("shop-1", f"order-{n:02d}", T0 + timedelta(seconds=1))
            await timer.wait_until_idle()
            clock.advance(1)
            await timer.wait_until_idle()
        assert "order-15" not in calls and len(calls) == 29


class TestConfiguration:
    def test_a_timer_needs_a_publisher_or_a_handler_not_both(self) -> None:
        """Neither or both is refused at once."""
        with pytest.raises(ConfigurationError, match="neither"):
            Timer(MemoryTimerStore())
        with pytest.raises(ConfigurationError, match="both"):
            Timer(MemoryTimerStore(), object(), handler=print)  # type: ignore[arg-type]

    def test_bad_settings_are_validation_errors(self) -> None:
        """A concurrency of 0 or a negative timeout is refused."""
        with pytest.raises(ValidationError, match="max_concurrency"):
            HandlerSettings(max_concurrency=0)
        with pytest.raises(ValidationError, match="timeout_s"):
            HandlerSettings(timeout_s=-1)


class TestLeasingStore:
    async def test_a_slow_handler_on_a_leasing_store_is_marked_after_later_passes(self) -> None:
        """Passes that find the timer again while its handler runs claim it anew; the mark
        goes under the latest claim, so the timer ends Reached, handled once."""
        release = asyncio.Event()
        calls: list[Event] = []

        async def slow(event: Event) -> None:
            calls.append(event)
            await release.wait()

        clock = FakeClock(T0)
        async with Timer(MemoryTimerStore(lease_s=30.0), handler=slow, clock=clock) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            while not calls:
                await asyncio.sleep(0.001)
            for _ in range(3):  # passes while the call runs: each claims the timer again
                clock.advance(1)
                await asyncio.sleep(0.01)
            release.set()
            await timer.wait_until_idle()
            stored = await timer.get("shop-1", "order-1")
        assert stored is not None and stored.state is TimerState.REACHED
        assert len(calls) == 1
