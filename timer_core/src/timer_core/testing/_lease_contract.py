"""The conformance suite of the ``TimerStore`` lease promise: claims, the mark fence, release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

from timer_core._entry import TimerEntry, TimerState
from timer_core._ids import ServiceCallId, TenantId
from timer_core.ports import DueCursor, FindsDueByTenant, LeasesClaims, TimerStore

__all__ = ["TimerStoreLeaseContract"]

T0 = datetime(2030, 1, 1, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)
A = TenantId("tenant-a")
#: Long enough never to run out during a test.
HELD = 30.0
#: Short enough to wait out; ``let_time_pass(SHORT + MARGIN)`` sees it expired.
SHORT = 0.3
MARGIN = 0.2

MakeLeasingStore = Callable[[float], TimerStore]


def timer(call: str, due_s: float = -60.0, tenant: str = "tenant-a") -> TimerEntry:
    """A ``Scheduled`` timer due ``due_s`` seconds from the suite's ``NOW``."""
    return TimerEntry(
        tenant_id=tenant,
        service_call_id=call,
        due_at=NOW + timedelta(seconds=due_s),
        registered_at=T0,
    )


def calls(entries: list[TimerEntry]) -> list[str]:
    """The service call ids of ``entries``, in their order."""
    return [str(entry.service_call_id) for entry in entries]


class TimerStoreLeaseContract:
    """Conformance tests of a :class:`~timer_core.ports.TimerStore` that leases its claims.

    For stores several instances share (:class:`~timer_core.ports.LeasesClaims`):
    :meth:`~TimerStore.find_due` claims, each entry carrying its claim,
    :meth:`~TimerStore.mark_reached` is fenced by the claim the entry carries,
    :meth:`~timer_core.ports.LeasesClaims.release_claims` hands claims back, and
    :meth:`~TimerStore.next_due_at` leaves out what others hold. Subclass it as a
    ``Test...`` class and override ``make_leasing_store``: it returns a callable taking a
    lease in seconds and returning a new, not yet started store, a distinct instance (lease
    owner) over the same storage on every call::

        class TestPostgresLeases(TimerStoreLeaseContract):
            @pytest.fixture
            def make_leasing_store(self, postgres_url):
                return lambda lease_s: PostgresTimerStore(postgres_url, lease_s=lease_s)

    ``let_time_pass(seconds)`` must let that much time pass on the clock the leases run on;
    it sleeps by default (a database's own clock), and a store on a fake clock overrides it.
    """

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_leasing_store(self) -> MakeLeasingStore:
        """The factory hook: override it to return a callable making unstarted stores."""
        raise NotImplementedError(
            "override the make_leasing_store fixture to bind TimerStoreLeaseContract"
        )

    @pytest.fixture
    def let_time_pass(self) -> Callable[[float], Awaitable[None]]:
        """Let ``seconds`` pass on the leases' clock: real time unless overridden."""
        return asyncio.sleep

    @pytest_asyncio.fixture
    async def instances(
        self, make_leasing_store: MakeLeasingStore
    ) -> AsyncIterator[Callable[..., Awaitable[TimerStore]]]:
        """``await instances(lease_s=HELD)``: a started instance, closed after the test."""
        started: list[TimerStore] = []

        async def make(lease_s: float = HELD) -> TimerStore:
            store = make_leasing_store(lease_s)
            await store.start()
            started.append(store)
            return store

        try:
            yield make
        finally:
            for store in started:
                await store.aclose()

    async def test_claim_lease_is_the_one_configured(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """A leasing store reports its lease as ``claim_lease_s``."""
        store = await instances(HELD)
        assert isinstance(store, LeasesClaims)
        assert store.claim_lease_s == pytest.approx(HELD)

    async def test_simultaneous_claims_never_share_a_timer(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """Claims issued at the same moment by four instances split the due timers."""
        stores = [await instances() for _ in range(4)]
        await stores[0].apply([timer(f"call-{i:03d}", -i) for i in range(100)])
        claims = await asyncio.gather(*(store.find_due(NOW, 40) for store in stores))
        claimed = [call for batch in claims for call in calls(batch)]
        assert len(claimed) == len(set(claimed)) == 100

    async def test_concurrent_drains_get_each_timer_once(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """Three instances claiming and marking one backlog at once share none of it."""
        stores = [await instances() for _ in range(3)]
        await stores[0].apply([timer(f"call-{i:04d}", -i) for i in range(600)])

        async def drain(store: TimerStore) -> list[str]:
            mine: list[str] = []
            while batch := await store.find_due(NOW, 25):
                mine.extend(calls(batch))
                assert await store.mark_reached([e.reach(NOW) for e in batch]) == len(batch)
            return mine

        claimed = await asyncio.gather(*(drain(store) for store in stores))
        everything = [call for mine in claimed for call in mine]
        assert len(everything) == len(set(everything)) == 600
        assert await stores[0].count_scheduled() == 0

    async def test_a_store_claims_its_own_timers_again(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """The same instance gets the timers it holds again; another does not."""
        store, other = await instances(), await instances()
        await store.schedule(timer("call-1"))
        assert await store.find_due(NOW, 10) == [timer("call-1")]
        assert await store.find_due(NOW, 10) == [timer("call-1")]
        assert await other.find_due(NOW, 10) == []

    async def test_claims_honour_the_keyset_cursor(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """With ``after``, only timers strictly after the cursor are claimed."""
        first, second = await instances(), await instances()
        await first.apply([timer("a", -3), timer("b", -2), timer("c", -1)])
        claimed = await first.find_due(NOW, 10, after=DueCursor.of(timer("a", -3)))
        assert calls(claimed) == ["b", "c"]
        assert calls(await second.find_due(NOW, 10)) == ["a"]

    async def test_claims_are_taken_over_once_the_lease_ran_out(
        self,
        instances: Callable[..., Awaitable[TimerStore]],
        let_time_pass: Callable[[float], Awaitable[None]],
    ) -> None:
        """Timers claimed by an instance that never marks them go to another after the lease."""
        crashed, survivor = await instances(SHORT), await instances()
        await crashed.apply([timer("call-1"), timer("call-2")])
        assert len(await crashed.find_due(NOW, 10)) == 2
        await crashed.aclose()  # it "crashes": never marks, never releases
        assert await survivor.find_due(NOW, 10) == []
        await let_time_pass(SHORT + MARGIN)
        assert sorted(calls(await survivor.find_due(NOW, 10))) == ["call-1", "call-2"]

    async def test_a_mark_under_a_claim_taken_over_changes_nothing(
        self,
        instances: Callable[..., Awaitable[TimerStore]],
        let_time_pass: Callable[[float], Awaitable[None]],
    ) -> None:
        """The fence: a slow owner's mark and release after a takeover change nothing."""
        slow, fast, third = await instances(SHORT), await instances(), await instances()
        await slow.schedule(timer("call-1"))
        (mine,) = await slow.find_due(NOW, 10)
        await let_time_pass(SHORT + MARGIN)
        (theirs,) = await fast.find_due(NOW, 10)
        assert await slow.mark_reached([mine.reach(NOW)]) == 0
        await _leasing(slow).release_claims([mine])
        assert await third.find_due(NOW, 10) == []  # still fast's claim
        assert await fast.mark_reached([theirs.reach(NOW)]) == 1
        stored = await fast.get(A, ServiceCallId("call-1"))
        assert stored is not None and stored.state is TimerState.REACHED

    async def test_a_late_mark_under_an_expired_untaken_claim_counts(
        self,
        instances: Callable[..., Awaitable[TimerStore]],
        let_time_pass: Callable[[float], Awaitable[None]],
    ) -> None:
        """If nobody claimed the timer since, its owner's mark after the lease still counts."""
        store = await instances(SHORT)
        await store.schedule(timer("call-1"))
        (claimed,) = await store.find_due(NOW, 10)
        await let_time_pass(SHORT + MARGIN)
        assert await store.mark_reached([claimed.reach(NOW)]) == 1

    async def test_release_lets_another_store_claim_at_once(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """Released claims are claimable by other instances without waiting for the lease."""
        owner, other = await instances(), await instances()
        await owner.apply([timer("call-1", -2), timer("call-2", -1)])
        claimed = await owner.find_due(NOW, 10)
        assert await other.find_due(NOW, 10) == []
        await _leasing(owner).release_claims(claimed[:1])
        assert calls(await other.find_due(NOW, 10)) == ["call-1"]

    async def test_reschedule_drops_the_lease(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """A rescheduled timer can be claimed at once; the old claim can no longer mark it."""
        owner, other = await instances(), await instances()
        await owner.schedule(timer("call-1", -10))
        (old,) = await owner.find_due(NOW, 10)
        moved = timer("call-1", -5)
        await other.schedule(moved)
        assert await other.find_due(NOW, 10) == [moved]
        assert await owner.mark_reached([old.reach(NOW)]) == 0

    async def test_an_unclaimed_mark_never_overwrites_a_live_claim(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """An instance marking a timer it never claimed waits until nobody holds it."""
        owner, other = await instances(), await instances()
        await owner.schedule(timer("call-1"))
        (claimed,) = await owner.find_due(NOW, 10)
        assert await other.mark_reached([timer("call-1").reach(NOW)]) == 0
        await _leasing(owner).release_claims([claimed])
        assert await other.mark_reached([timer("call-1").reach(NOW)]) == 1

    async def test_next_due_at_skips_timers_others_hold(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """``next_due_at`` leaves out timers another instance holds, not the store's own."""
        owner, other = await instances(), await instances()
        await owner.apply([timer("held", -10), timer("later", 3600)])
        await owner.find_due(NOW, 10)
        assert await owner.next_due_at() == timer("held", -10).due_at
        assert await other.next_due_at() == timer("later", 3600).due_at

    async def test_finds_shared_among_tenants_claim_too(
        self, instances: Callable[..., Awaitable[TimerStore]]
    ) -> None:
        """``find_due_by_tenant`` claims what it returns, as ``find_due`` does (when offered)."""
        owner, other = await instances(), await instances()
        if not isinstance(owner, FindsDueByTenant) or not isinstance(other, FindsDueByTenant):
            return  # a store that does not find by tenant has nothing to claim this way
        await owner.apply([timer("a-1", -2, "tenant-a"), timer("b-1", -1, "tenant-b")])
        claimed = await owner.find_due_by_tenant(NOW, 10, after={})
        assert sorted(calls(claimed)) == ["a-1", "b-1"]
        assert await other.find_due_by_tenant(NOW, 10, after={}) == []
        assert await other.find_due(NOW, 10) == []


def _leasing(store: TimerStore) -> LeasesClaims:
    """``store`` as the leasing store the suite is bound to."""
    assert isinstance(store, LeasesClaims)
    return store
