"""FiringPipeline.drain: batch after batch in due order, store work overlapping the deliveries."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from timer_adapters_memory import (
    FakeClock,
    LeasingMemoryTimerStore,
    MemoryEventBus,
    MemoryTimerStore,
)
from timer_core import (
    DueCursor,
    DueTimeReached,
    EventPublisher,
    MessageEnvelope,
    PublishError,
    StoreUnavailable,
    TenantId,
    TimerEntry,
    TimerState,
    firing,
    tell_delivered,
)
from timer_core.delivery import Delivery, Outcome
from timer_core.firing import DrainReport, FiringPipeline

T0 = datetime(2030, 1, 1, tzinfo=UTC)


class Journal:
    """The order in which a drain read, published and marked, as ``(what, calls)`` lines."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, list[str]]] = []

    def note(self, what: str, calls: Sequence[str]) -> None:
        self.lines.append((what, list(calls)))

    def index(self, what: str, call: str) -> int:
        """Where ``call`` was first ``what`` ("read", "published" or "marked")."""
        return next(i for i, (w, calls) in enumerate(self.lines) if w == what and call in calls)


class JournalStore(MemoryTimerStore):
    """A memory store that notes reads and marks, and can hold a mark until released."""

    def __init__(self, journal: Journal, *, lease_s: float | None = None) -> None:
        super().__init__(lease_s=lease_s)
        self.journal = journal
        self.reads = 0
        self.hold_marks = asyncio.Event()
        self.hold_marks.set()
        self.mark_started = asyncio.Event()

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        self.reads += 1
        found = await super().find_due(now, limit, after=after)
        self.journal.note("read", [str(e.service_call_id) for e in found])
        return found

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        self.reads += 1
        found = await super().find_due_by_tenant(now, limit, after=after)
        self.journal.note("read", [str(e.service_call_id) for e in found])
        return found

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        self.mark_started.set()
        await self.hold_marks.wait()
        changed = await super().mark_reached(entries)
        self.journal.note("marked", [str(e.service_call_id) for e in entries])
        return changed


class LeasingJournalStore(JournalStore, LeasingMemoryTimerStore):
    """A journal store that claims what it finds, as a store several instances share."""


class JournalBus(EventPublisher):
    """Publishes through a memory bus, noting each batch and every timer's stored state."""

    def __init__(self, journal: Journal, store: MemoryTimerStore) -> None:
        self.journal = journal
        self.store = store
        self.bus = MemoryEventBus()
        self.states: dict[str, TimerState | None] = {}
        self.batches = 0
        self.before_batch: list[asyncio.Event] = []

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        if self.batches < len(self.before_batch):
            await self.before_batch[self.batches].wait()
        self.batches += 1
        calls = [str(e.payload.service_call_id) for e in envelopes]
        for envelope in envelopes:
            stored = await self.store.get(envelope.tenant_id, envelope.payload.service_call_id)
            self.states[str(envelope.payload.service_call_id)] = stored and stored.state
        results = await self.bus.publish_many(envelopes)
        self.journal.note("published", [c for c, r in zip(calls, results, strict=True) if not r])
        return results


class Rig:
    def __init__(self, *, lease_s: float | None = None) -> None:
        self.journal = Journal()
        self.store = (
            JournalStore(self.journal)
            if lease_s is None
            else LeasingJournalStore(self.journal, lease_s=lease_s)
        )
        self.publisher = JournalBus(self.journal, self.store)
        self.clock = FakeClock(T0)

    async def schedule(self, count: int) -> list[str]:
        """``count`` timers due one second apart before T0; their call ids, in due order."""
        calls = [f"c{i:03d}" for i in range(count)]
        await self.store.apply(
            [
                TimerEntry(
                    tenant_id="tenant-a",
                    service_call_id=call,
                    due_at=T0 - timedelta(seconds=count - i),
                    registered_at=T0 - timedelta(hours=1),
                )
                for i, call in enumerate(calls)
            ]
        )
        return calls

    def states(self) -> dict[str, TimerState]:
        return {str(e.service_call_id): e.state for e in self.store.entries()}

    async def drain(self) -> DrainReport:
        return await FiringPipeline(
            self.store, self.publisher, self.clock, batch_size=10, mark_at_once=1
        ).drain()


@pytest.fixture
async def rig() -> Rig:
    made = Rig()
    await made.store.start()
    return made


class TestDrain:
    """A drain fires every due timer, batch after batch, in due order, publish before mark."""

    async def test_fires_every_batch_in_due_order(self, rig: Rig) -> None:
        """35 due timers in batches of 10: four batches, published in due order, all Reached."""
        calls = await rig.schedule(35)
        report = await rig.drain()
        assert (report.batches, report.fired, report.failed) == (4, 35, [])
        assert [str(e.payload.service_call_id) for e in rig.publisher.bus.published] == calls
        assert set(rig.states().values()) == {TimerState.REACHED}

    async def test_every_timer_is_published_before_it_is_marked(self, rig: Rig) -> None:
        """Each timer is still Scheduled when published and marked only after its publish."""
        calls = await rig.schedule(35)
        await rig.drain()
        assert set(rig.publisher.states.values()) == {TimerState.SCHEDULED}
        for call in calls:
            assert rig.journal.index("published", call) < rig.journal.index("marked", call)

    async def test_the_next_batch_is_read_while_this_one_is_published(self, rig: Rig) -> None:
        """The first batch's publish waits for the second batch's read, which happens."""
        await rig.schedule(25)
        second_read = asyncio.Event()
        rig.publisher.before_batch = [second_read]

        async def watch() -> None:
            while rig.store.reads < 2:
                await asyncio.sleep(0)
            second_read.set()

        watcher = asyncio.ensure_future(watch())
        async with asyncio.timeout(5):
            report = await rig.drain()
        await watcher
        assert report.fired == 25

    async def test_a_batch_is_marked_while_the_next_is_published(self, rig: Rig) -> None:
        """The second batch is published while the first batch's mark is still running."""
        await rig.schedule(20)
        rig.store.hold_marks.clear()
        rig.publisher.before_batch = [asyncio.Event(), rig.store.mark_started]
        rig.publisher.before_batch[0].set()
        draining = asyncio.ensure_future(rig.drain())
        async with asyncio.timeout(5):
            while rig.publisher.batches < 2:
                await asyncio.sleep(0)
        assert rig.states()["c000"] is TimerState.SCHEDULED  # first mark still held
        rig.store.hold_marks.set()
        async with asyncio.timeout(5):
            report = await draining
        assert report.fired == 20

    async def test_returns_only_once_every_mark_is_done(self, rig: Rig) -> None:
        """When the drain returns, every timer it fired is stored as Reached."""
        await rig.schedule(30)

        async def slow_marks() -> None:
            await asyncio.sleep(0.01)
            rig.store.hold_marks.set()

        rig.store.hold_marks.clear()
        releaser = asyncio.ensure_future(slow_marks())
        await rig.drain()
        await releaser
        assert set(rig.states().values()) == {TimerState.REACHED}

    async def test_failed_publishes_are_stepped_over(self, rig: Rig) -> None:
        """Failing timers stay Scheduled and are reported; later batches still fire."""
        calls = await rig.schedule(30)
        rig.publisher.bus.fail_when(lambda e: e.payload.service_call_id < "c012")
        report = await rig.drain()
        assert [str(entry.service_call_id) for entry, _ in report.failed] == calls[:12]
        assert report.fired == 18
        assert [c for c, s in rig.states().items() if s is TimerState.SCHEDULED] == calls[:12]


class TestGatheredMarks:
    """On a store without leases, a drain's delivered batches are marked together."""

    async def test_batches_are_marked_together_up_to_the_count(self, rig: Rig) -> None:
        """35 timers in batches of 10, marks of at most 20: fewer marks than batches, none
        over 20, each after its timers' publishes, all Reached on return."""
        calls = await rig.schedule(35)
        report = await FiringPipeline(
            rig.store, rig.publisher, rig.clock, batch_size=10, mark_at_once=20
        ).drain()
        assert (report.batches, report.fired) == (4, 35)
        marks = [marked for what, marked in rig.journal.lines if what == "marked"]
        assert sorted(call for mark in marks for call in mark) == calls
        assert len(marks) < 4 and max(len(mark) for mark in marks) <= 20
        for call in calls:
            assert rig.journal.index("published", call) < rig.journal.index("marked", call)
        assert set(rig.states().values()) == {TimerState.REACHED}

    async def test_a_publish_that_raises_fails_only_its_own_timers(self, rig: Rig) -> None:
        """A publisher call that raises (a bug) fails that call's timers, which stay
        Scheduled and are reported; the batches before and after it are marked."""
        calls = await rig.schedule(30)
        failing = {"count": 0}
        publish_many = rig.publisher.publish_many

        async def publish_then_fail(envelopes: list[Any]) -> list[PublishError | None]:
            failing["count"] += 1
            if failing["count"] == 3:
                raise RuntimeError("the broker went away")
            return await publish_many(envelopes)

        rig.publisher.publish_many = publish_then_fail  # type: ignore[method-assign]
        report = await FiringPipeline(rig.store, rig.publisher, rig.clock, batch_size=10).drain()
        assert sorted(str(entry.service_call_id) for entry, _ in report.failed) == calls[20:]
        states = rig.states()
        assert [c for c in calls if states[c] is TimerState.REACHED] == calls[:20]
        assert [c for c in calls if states[c] is TimerState.SCHEDULED] == calls[20:]


class TestEndingEarly:
    """Stopping and store failures end a drain cleanly: what was published is marked or kept."""

    async def test_a_failed_mark_fails_the_drain_and_the_firing_is_repeated(self, rig: Rig) -> None:
        """A mark that fails raises from the drain; its timers stay Scheduled and the next
        drain publishes them again under the same envelope ids."""
        await rig.schedule(25)
        rig.store.fail_next(1, methods=["mark_reached"])
        with pytest.raises(StoreUnavailable):
            await rig.drain()
        first_ids = {e.payload.service_call_id: e.id for e in rig.publisher.bus.publish_attempts}
        assert rig.states()["c000"] is TimerState.SCHEDULED
        report = await rig.drain()
        assert set(rig.states().values()) == {TimerState.REACHED}
        again = [
            e
            for e in rig.publisher.bus.publish_attempts
            if e.payload.service_call_id in {"c000", "c009"}
        ]
        assert {e.id for e in again} == {first_ids["c000"], first_ids["c009"]}
        assert report.failed == []

    async def test_a_leasing_store_publishes_in_order_and_marks_every_claim(self) -> None:
        """With claim leases, every claimed timer is published in due order and marked
        under its claim before the drain returns."""
        rig = Rig(lease_s=30.0)
        await rig.store.start()
        calls = await rig.schedule(25)
        report = await FiringPipeline(
            rig.store, rig.publisher, rig.clock, batch_size=10, mark_at_once=1
        ).drain()
        assert report.fired == 25
        assert set(rig.states().values()) == {TimerState.REACHED}
        assert [str(e.payload.service_call_id) for e in rig.publisher.bus.published] == calls
        for call in calls:
            assert rig.journal.index("published", call) < rig.journal.index("marked", call)


class OrderedBus(JournalBus):
    """A bus that keeps the order of concurrent calls: each call's envelopes are sent (noted)
    at once, and the acks of the first call wait until ``first_acked`` is set."""

    def __init__(self, journal: Journal, store: MemoryTimerStore) -> None:
        super().__init__(journal, store)
        self.first_acked = asyncio.Event()

    @property
    def keeps_call_order(self) -> bool:
        return True

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        self.batches += 1
        first = self.batches == 1
        calls = [str(e.payload.service_call_id) for e in envelopes]
        self.journal.note("sent", calls)
        results = await self.bus.publish_many(envelopes)
        if first:
            await self.first_acked.wait()
        self.journal.note("published", calls)
        return results


class TestOverlappedPublishing:
    async def test_the_next_batch_is_sent_while_the_acks_come_back(self) -> None:
        """With a publisher that keeps call order, batch two is sent before batch one's acks
        are back; every timer is still published in due order and marked after its ack."""
        rig = Rig()
        rig.publisher = OrderedBus(rig.journal, rig.store)
        await rig.store.start()
        calls = await rig.schedule(25)
        draining = asyncio.ensure_future(rig.drain())
        while rig.publisher.batches < 2:
            await asyncio.sleep(0)
        assert rig.states()["c000"] is TimerState.SCHEDULED  # not marked before its ack
        rig.publisher.first_acked.set()
        report = await draining
        assert (report.batches, report.fired) == (3, 25)
        kinds = [what for what, noted in rig.journal.lines if noted and what != "read"]
        assert kinds[:3] == ["sent", "sent", "published"]
        assert [str(e.payload.service_call_id) for e in rig.publisher.bus.published] == calls
        for call in calls:
            assert rig.journal.index("published", call) < rig.journal.index("marked", call)
        assert set(rig.states().values()) == {TimerState.REACHED}


class ReadsAtStart(Delivery):
    """Delivers at once, noting how many finds the store had begun when each batch came."""

    def __init__(self, store: JournalStore) -> None:
        self.store = store
        self.reads_at_start: list[int] = []
        self.handed: list[str] = []

    def start(self, envelopes: Sequence[MessageEnvelope[DueTimeReached]], done: Outcome) -> None:
        self.reads_at_start.append(self.store.reads)
        self.handed += [str(e.payload.service_call_id) for e in envelopes]
        tell_delivered(done, range(len(envelopes)))

    async def aclose(self) -> None:
        return None


class TestReadAhead:
    """While a drain goes on, its next page is read before this one is handed out, on a
    store that takes no claims; a restart drops the page read ahead."""

    async def test_the_next_page_is_read_before_this_one_is_handed_out(
        self, rig: Rig, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each full batch reaches the delivery after the next batch's read began (pages
        read ahead of a batch's size)."""
        monkeypatch.setattr(firing, "READ_AHEAD", 10)
        await rig.schedule(35)
        delivery = ReadsAtStart(rig.store)
        pipeline = FiringPipeline(rig.store, delivery, rig.clock, batch_size=10)
        report = await pipeline.drain()
        assert report.fired == 35 and delivery.handed == sorted(delivery.handed)
        assert delivery.reads_at_start[:3] == [2, 3, 4]

    async def test_a_page_read_ahead_is_handed_out_a_batch_at_a_time(
        self, rig: Rig, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Pages of up to READ_AHEAD timers are read ahead and handed out batch_size at a
        time, the page after it read as soon as its first batch goes: 95 timers, batches of
        10, pages of 40: the first batch read alone, then three reads for the other 85
        (read as pages 2, 3 and 4 begin to be handed out), in due order."""
        monkeypatch.setattr(firing, "READ_AHEAD", 40)
        await rig.schedule(95)
        delivery = ReadsAtStart(rig.store)
        report = await FiringPipeline(rig.store, delivery, rig.clock, batch_size=10).drain()
        assert report.fired == 95 and delivery.handed == sorted(delivery.handed)
        assert rig.store.reads == 4
        assert delivery.reads_at_start == [2, 3, 3, 3, 3, 4, 4, 4, 4, 4]

    async def test_a_leasing_store_is_not_read_ahead(self) -> None:
        """A read ahead would claim timers a restart might drop: a leasing store's next page
        is read only once this one is handed out."""
        rig = Rig(lease_s=30.0)
        await rig.store.start()
        await rig.schedule(35)
        delivery = ReadsAtStart(rig.store)
        report = await FiringPipeline(rig.store, delivery, rig.clock, batch_size=10).drain()
        assert report.fired == 35
        assert delivery.reads_at_start == [1, 2, 3, 4]

    async def test_a_restart_drops_the_page_read_ahead(self, rig: Rig) -> None:
        """A timer scheduled before where the drain stands restarts it: the next batch starts
        from the first due timer, not from the page read ahead."""
        await rig.schedule(30)
        delivery = ReadsAtStart(rig.store)
        pipeline = FiringPipeline(rig.store, delivery, rig.clock, batch_size=10)
        await pipeline.step()
        assert pipeline.cursor is not None and rig.store.reads == 2  # the next page, ahead
        await rig.store.apply(
            [TimerEntry("tenant-a", "early", T0 - timedelta(days=1), T0 - timedelta(hours=1))]
        )
        pipeline.restart()
        await pipeline.step()
        assert delivery.handed[10] == "early"
        await pipeline.drain()
        assert sorted(delivery.handed) == sorted({*delivery.handed})
        assert set(rig.states().values()) == {TimerState.REACHED}
