"""The core's lease fence in the firing pipeline, on the memory adapters and a fake clock.

A leasing store (``claim_lease_s`` set) must never see its claimed timers published once the
lease may have run out; these tests drive that with the memory store's leasing mode (whose
claiming is made slow on the test's clock), so they need no database. Whether a timer was
handed back is read the way another instance sees it: it can claim the timer at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta

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
    LeasesClaims,
    MessageEnvelope,
    PublishError,
    TimerEntry,
    TimerState,
)
from timer_core.firing import FiringPipeline

START = datetime.fromisoformat("2030-01-01T00:00:00+00:00")
LEASE = 10.0


class SlowlyClaimingStore(LeasingMemoryTimerStore):
    """The memory store leasing for ``LEASE`` seconds, whose claiming takes time."""

    def __init__(self, clock: FakeClock, *, claim_takes: float = 0.0) -> None:
        super().__init__(lease_s=LEASE, clock=clock)
        self.clock = clock
        self.claim_takes = claim_takes

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        due = await super().find_due(now, limit, after=after)
        self.clock.advance(self.claim_takes)  # a slow database, on the test's clock
        return due


async def released(store: MemoryTimerStore, clock: FakeClock) -> list[str]:
    """The due timers another instance over ``store``'s storage can claim now (released)."""
    other = MemoryTimerStore(shared_with=store, lease_s=LEASE, clock=clock)
    await other.start()
    return [str(e.service_call_id) for e in await other.find_due(clock.now(), 100)]


class StallingPublisher(EventPublisher):
    """A broker that never acknowledges: publish_many waits until it is cancelled."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cancelled = False

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


def timer(call: str, due_s: float = -1.0) -> TimerEntry:
    return TimerEntry(
        tenant_id="tenant-a",
        service_call_id=call,
        due_at=START + timedelta(seconds=due_s),
        registered_at=START - timedelta(seconds=60),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


class TestWithoutLease:
    """Stores that take no lease behave as before the fence existed."""

    async def test_a_store_without_lease_is_no_leasing_store(self) -> None:
        """A store made without a lease is not a LeasesClaims, and what it finds carries no
        claim; one made with a lease is, and its finds carry their claims."""
        store = MemoryTimerStore()
        await store.start()
        await store.schedule(timer("a"))
        assert not isinstance(store, LeasesClaims)
        (found,) = await store.find_due(timer("a").due_at, 10)
        assert found.claim is None
        leasing = MemoryTimerStore(shared_with=store, lease_s=5)
        await leasing.start()
        assert isinstance(leasing, LeasesClaims)
        (claimed,) = await leasing.find_due(timer("a").due_at, 10)
        assert claimed.claim is not None and claimed == found

    async def test_fires_and_marks_without_lease(self, clock: FakeClock) -> None:
        """Without a lease, due timers are published and marked, nothing is reported expired."""
        store, bus = MemoryTimerStore(), MemoryEventBus()
        await store.start()
        await store.schedule(timer("a"))
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in report.fired] == ["a"]
        assert report.expired == []
        assert len(bus.published) == 1


class TestLeaseFence:
    """The firing pipeline publishes claimed timers only within the store's claim lease."""

    async def test_publishes_and_marks_within_the_lease(self, clock: FakeClock) -> None:
        """A claim and publish well within the lease fire and mark as usual."""
        store, bus = SlowlyClaimingStore(clock, claim_takes=1.0), MemoryEventBus()
        await store.start()
        await store.apply([timer("a"), timer("b")])
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert len(report.fired) == 2
        assert report.expired == [] and report.failed == []
        assert await released(store, clock) == []
        assert [e.state for e in store.entries()] == [TimerState.REACHED] * 2

    async def test_claim_that_outlasted_the_lease_publishes_nothing(self, clock: FakeClock) -> None:
        """When find_due itself took the whole lease, nothing is published or marked."""
        store, bus = SlowlyClaimingStore(clock, claim_takes=LEASE), MemoryEventBus()
        await store.start()
        await store.apply([timer("a"), timer("b")])
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in report.expired] == ["a", "b"]
        assert report.fired == [] and report.found == 2
        assert bus.publish_attempts == []
        assert await released(store, clock) == [e.service_call_id for e in report.expired]
        assert [e.state for e in store.entries()] == [TimerState.SCHEDULED] * 2

    async def test_publish_is_abandoned_when_the_lease_runs_out(self, clock: FakeClock) -> None:
        """A publish still unacknowledged at the end of the lease is cancelled and fails."""
        store, publisher = SlowlyClaimingStore(clock, claim_takes=3.0), StallingPublisher()
        await store.start()
        await store.apply([timer("a"), timer("b")])
        firing = asyncio.create_task(FiringPipeline(store, publisher, clock, batch_size=10).fire())
        await publisher.entered.wait()
        await clock.wait_for_sleepers(1)
        assert clock.pending_sleeps() == [pytest.approx(LEASE - 3.0)]
        clock.advance(LEASE - 3.0)
        report = await firing
        assert publisher.cancelled
        assert report.fired == []
        assert [e.service_call_id for e, _ in report.failed] == ["a", "b"]
        assert all(isinstance(error, PublishError) for _, error in report.failed)
        assert await released(store, clock) == ["a", "b"]
        assert [e.state for e in store.entries()] == [TimerState.SCHEDULED] * 2

    async def test_failed_publishes_are_released_and_the_rest_marked(
        self, clock: FakeClock
    ) -> None:
        """Timers whose publish failed are handed back at once; the published ones are marked."""
        store, bus = SlowlyClaimingStore(clock), MemoryEventBus()
        await store.start()
        await store.apply([timer("a"), timer("b"), timer("c")])
        bus.fail_when(lambda envelope: envelope.payload.service_call_id == "b")
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in report.fired] == ["a", "c"]
        assert await released(store, clock) == ["b"]
        states = {e.service_call_id: e.state for e in store.entries()}
        assert states == {"a": TimerState.REACHED, "b": TimerState.SCHEDULED, "c": "Reached"}

    async def test_a_failing_release_does_not_fail_the_pass(self, clock: FakeClock) -> None:
        """Releasing is a shortcut: if the store cannot release, the pass still completes."""
        store, bus = SlowlyClaimingStore(clock), MemoryEventBus()
        await store.start()
        await store.apply([timer("a"), timer("b")])
        store.fail_next(1, methods=["release_claims"])
        bus.fail_when(lambda envelope: envelope.payload.service_call_id == "a")
        report = await FiringPipeline(store, bus, clock, batch_size=10).fire()
        assert [e.service_call_id for e in report.fired] == ["b"]
        assert [e.service_call_id for e, _ in report.failed] == ["a"]
