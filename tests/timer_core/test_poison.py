"""A timer whose publish keeps failing (a poison timer) is backed off on its own and, after a
bounded number of failures while others are published, quarantined: the others keep their
lateness; the poison one is reported and can be retried. Driven by a FakeClock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import (
    CancelTimer,
    Command,
    EnvelopeId,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    ScheduleTimer,
    Timer,
    TimerEntry,
    TimerKey,
    TimerWorker,
)
from timer_core.commands import handle_commands

T0 = datetime(2030, 1, 1, tzinfo=UTC)
POISON = "poison"
QUARANTINE_AFTER = 10


class Reports(Instrumentation):
    """Records quarantines and the quarantine's size as the worker reports them."""

    def __init__(self) -> None:
        self.quarantined: list[tuple[TimerEntry, int]] = []
        self.sizes: list[int] = []
        self.oldest: list[datetime | None] = []

    def timer_quarantined(self, entry: TimerEntry, error: PublishError, failures: int) -> None:
        self.quarantined.append((entry, failures))

    def quarantine_size(self, count: int) -> None:
        self.sizes.append(count)

    def quarantine_oldest(self, since: datetime | None) -> None:
        self.oldest.append(since)


class Rig:
    """A memory store and bus, a fake clock, and one worker with the defaults' backoff."""

    def __init__(
        self, *, lease_s: float | None = None, instrumentation: Instrumentation | None = None
    ) -> None:
        self.clock = FakeClock(T0)
        self.store = MemoryTimerStore(lease_s=lease_s, clock=self.clock)
        self.bus = MemoryEventBus()
        self.reports = Reports()
        self.worker = TimerWorker(
            self.store,
            self.bus,
            self.clock,
            polling_interval=5.0,
            batch_size=10,
            instrumentation=instrumentation or self.reports,
            quarantine_after=QUARANTINE_AFTER,
        )
        self.task: asyncio.Future[None] | None = None

    async def send(self, *commands: Command) -> None:
        envelopes: list[MessageEnvelope[Command]] = [
            MessageEnvelope(id=EnvelopeId.generate(), payload=command, timestamp_ms=0)
            for command in commands
        ]
        await handle_commands(self.store, envelopes, self.clock)

    async def schedule(self, call: str, due_s: float, tenant: str = "tenant-a") -> None:
        """Store a timer and tell the worker, as the command path does."""
        due = T0 + timedelta(seconds=due_s)
        await self.send(ScheduleTimer(tenant, call, due))
        self.worker.notify_scheduled(due)

    async def run_until(self, seconds: float) -> None:
        """Let fake time pass up to T0 + ``seconds``, one worker wake-up after another."""
        end = T0 + timedelta(seconds=seconds)
        while True:
            # The worker's own sleep, never longer than its polling interval (a publish in
            # flight sleeps on the clock too, for its claim lease, with a leasing store).
            async with asyncio.timeout(5):
                while not self.clock.pending_sleeps() or self.clock.pending_sleeps()[0] > 5.0:
                    await asyncio.sleep(0)
            (wait,) = self.clock.pending_sleeps()
            left = (end - self.clock.now()).total_seconds()
            if left <= 0:
                return
            self.clock.advance(min(wait, left))

    def attempts(self, call: str) -> int:
        return sum(e.payload.service_call_id == call for e in self.bus.publish_attempts)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    rig = Rig()
    await rig.store.start()
    rig.bus.fail_when(lambda event: event.payload.service_call_id == POISON)
    rig.task = asyncio.ensure_future(rig.worker.run())
    try:
        yield rig
    finally:
        rig.worker.stop()
        await asyncio.wait_for(rig.task, 5)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


class TestPoisonTimer:
    async def test_others_keep_their_lateness_and_the_poison_one_is_quarantined(
        self, rig: Rig, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With a timer that can never be published due first, 300 others due over 30 s fire
        with p99 lateness under 1 s (the worker does not back off for them), and the poison
        one is quarantined after a bounded number of failures: logged, reported, listed."""
        await rig.schedule(POISON, 0)
        for i in range(300):
            await rig.schedule(f"call-{i}", 0.05 + 0.1 * i, tenant=f"tenant-{i % 3}")
        with caplog.at_level(logging.ERROR, logger="timer_core.worker"):
            await rig.run_until(40)
        lateness = [
            (e.payload.reached_at - e.payload.due_at).total_seconds() for e in rig.bus.published
        ]
        assert len(lateness) == 300
        assert p99(lateness) < 1.0, sorted(lateness)[-5:]
        assert max(lateness) <= 0.25  # at worst one look while the poison one hides the next
        # Quarantined once, after the bounded number of failures while others were published
        # (its first one, alone in the first pass, proves nothing), and not tried since.
        ((entry, failures),) = rig.reports.quarantined
        assert entry.service_call_id == POISON
        assert QUARANTINE_AFTER <= failures <= QUARANTINE_AFTER + 1
        assert rig.attempts(POISON) == failures
        assert rig.reports.sizes == [1]
        (listed,) = rig.worker.quarantined
        assert listed.entry.key == TimerKey("tenant-a", POISON)
        assert listed.failures == failures
        assert "refused on purpose" in listed.error
        (record,) = [r for r in caplog.records if "quarantined" in r.getMessage()]
        assert record.levelno == logging.ERROR
        assert "tenant-a/poison" in record.getMessage()

    async def test_a_quarantined_timer_fires_once_retried(self, rig: Rig) -> None:
        """Retrying a quarantined timer (once its cause is fixed) puts it back: it fires. The
        instrumentation was told when the oldest quarantine began, then that none is left."""
        await rig.schedule(POISON, 0)
        for i in range(120):
            await rig.schedule(f"call-{i}", 0.5 * i)
        await rig.run_until(60)
        (quarantined,) = rig.worker.quarantined
        assert quarantined.entry.service_call_id == POISON
        rig.bus.fail_when(None)
        assert rig.worker.retry_quarantined([TimerKey("tenant-a", "other")]) == 0
        assert rig.worker.retry_quarantined() == 1
        (event,) = [
            e for e in await rig.bus.wait_for_published(121) if e.payload.service_call_id == POISON
        ]
        assert event.payload.due_at == T0
        assert rig.worker.quarantined == []
        assert rig.reports.sizes == [1, 0]
        assert rig.reports.oldest == [quarantined.since, None]

    async def test_an_outage_backs_off_but_quarantines_nothing(self, rig: Rig) -> None:
        """When nothing can be published (broker down), failures back off per timer but do not
        count as poison: once the broker is back, every timer fires by itself."""
        for i in range(5):
            await rig.schedule(f"call-{i}", i)
        rig.bus.set_unavailable(True)
        await rig.run_until(120)
        assert rig.attempts("call-0") > QUARANTINE_AFTER
        assert rig.worker.quarantined == []
        rig.bus.set_unavailable(False)
        await rig.run_until(126)
        assert sorted(e.payload.service_call_id for e in rig.bus.published) == [
            f"call-{i}" for i in range(5)
        ]

    async def test_an_outage_over_a_backlog_backs_off_a_few_batches_not_every_timer(
        self, rig: Rig
    ) -> None:
        """An outage with 2,000 timers overdue (200 batches): the worker tries a few batches
        and waits for their retries instead of stepping through the whole backlog (a backoff
        record per due timer); once the broker is back, every timer fires once."""
        await rig.store.apply(
            [
                TimerEntry(
                    tenant_id=f"tenant-{i % 5}",
                    service_call_id=f"call-{i:04d}",
                    due_at=T0 - timedelta(seconds=1 + i % 600),
                    registered_at=T0 - timedelta(hours=1),
                )
                for i in range(2000)
            ]
        )
        rig.bus.set_unavailable(True)
        rig.worker.notify_scheduled(T0)
        await rig.run_until(60)
        tried = {e.payload.service_call_id for e in rig.bus.publish_attempts}
        assert 0 < len(tried) <= 5 * 10, len(tried)
        assert rig.worker.quarantined == []
        rig.bus.set_unavailable(False)
        await rig.run_until(70)
        published = [e.payload.service_call_id for e in rig.bus.published]
        assert sorted(published) == [f"call-{i:04d}" for i in range(2000)]

    async def test_batches_of_poison_timers_do_not_hold_the_others_back(self, rig: Rig) -> None:
        """35 timers that can never be published (three and a half batches) first in due
        order, then 50 others due with them: the others fire at once (the fake clock
        standing still: no backoff waited for them), as the broker is fine."""
        rig.bus.fail_when(lambda event: event.payload.service_call_id.startswith("a-poison"))
        calls = [f"a-poison-{i:02d}" for i in range(35)] + [f"call-{i:02d}" for i in range(50)]
        await rig.store.apply(
            [
                TimerEntry(tenant_id="tenant-a", service_call_id=call, due_at=T0, registered_at=T0)
                for call in calls
            ]
        )
        rig.worker.notify_scheduled(T0)
        # The fake clock stands still: a worker waiting for a backoff would never get there.
        async with asyncio.timeout(5):
            published = await rig.bus.wait_for_published(50)
        assert sorted(e.payload.service_call_id for e in published) == calls[35:]
        assert all(e.payload.reached_at == T0 for e in published)

    async def test_a_cancelled_quarantined_timer_is_forgotten(self, rig: Rig) -> None:
        """A quarantined timer that is cancelled meanwhile leaves the quarantine by itself."""
        await rig.schedule(POISON, 0)
        for i in range(120):
            await rig.schedule(f"call-{i}", 0.5 * i)
        await rig.run_until(60)
        assert len(rig.worker.quarantined) == 1
        await rig.send(CancelTimer("tenant-a", POISON))
        await rig.run_until(180)
        assert rig.worker.quarantined == []
        assert rig.reports.sizes == [1, 0]


class TestLeasingStore:
    async def test_a_left_out_timer_is_not_held_by_its_claim(self) -> None:
        """With a leasing store (several instances), the poison timer left out of a pass has
        its claim released at once: another instance may take it without waiting for the
        lease, and this one's other timers keep their lateness."""
        rig = Rig(lease_s=30.0)
        await rig.store.start()
        other = MemoryTimerStore(shared_with=rig.store, lease_s=30.0, clock=rig.clock)
        await other.start()
        rig.bus.fail_when(lambda event: event.payload.service_call_id == POISON)
        rig.task = asyncio.ensure_future(rig.worker.run())
        try:
            await rig.schedule(POISON, 0)
            for i in range(120):
                await rig.schedule(f"call-{i}", 0.5 * i)
            await rig.run_until(60)
            assert [q.entry.service_call_id for q in rig.worker.quarantined] == [POISON]
            lateness = [
                (e.payload.reached_at - e.payload.due_at).total_seconds() for e in rig.bus.published
            ]
            assert len(lateness) == 120 and max(lateness) <= 0.25
            (claimed,) = await other.find_due(rig.clock.now(), 10)
            assert claimed.service_call_id == POISON
        finally:
            rig.worker.stop()
            await asyncio.wait_for(rig.task, 5)


class TestTimerRuntime:
    async def test_the_timer_shows_and_retries_its_workers_quarantine(self) -> None:
        """Timer.quarantined and Timer.retry_quarantined are its worker's, for hosts."""
        clock = FakeClock(T0)
        store, bus = MemoryTimerStore(), MemoryEventBus()
        bus.fail_when(lambda event: event.payload.service_call_id == POISON)
        async with Timer(store, bus, clock=clock, polling_interval=5.0) as timer:
            await timer.schedule("tenant-a", POISON, T0)
            for i in range(120):
                await timer.schedule("tenant-a", f"call-{i}", T0 + timedelta(seconds=0.5 * i))
            while not timer.quarantined:
                async with asyncio.timeout(5):
                    while not clock.pending_sleeps() or clock.pending_sleeps()[0] > 5.0:
                        await asyncio.sleep(0)
                (wait,) = clock.pending_sleeps()
                assert clock.monotonic() < 120, "never quarantined"
                clock.advance(wait)
            (quarantined,) = timer.quarantined
            assert quarantined.entry.service_call_id == POISON
            bus.fail_when(None)
            assert timer.retry_quarantined() == 1
            assert timer.quarantined == []
            await bus.wait_for_published(len(bus.published) + 1)
