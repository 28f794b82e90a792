"""Leased claiming on a real PostgreSQL: several stores share one table without sharing a timer."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.pg import wait_until_blocked
from timer_adapters_memory import MemoryEventBus
from timer_adapters_postgres import PostgresTimerStore, _lanes, _tenants
from timer_core import (
    CommandOutcome,
    DueCursor,
    DueTimeReached,
    EventPublisher,
    MessageEnvelope,
    PublishError,
    StoreError,
    SystemClock,
    TimerEntry,
    TimerState,
    TimerWorker,
)
from timer_core.firing import FiringPipeline

MakeStore = Callable[..., Awaitable[PostgresTimerStore]]

NOW = datetime.now(UTC).replace(microsecond=0)


def timer(call: str, due_s: float = -60.0, tenant: str = "tenant-a") -> TimerEntry:
    """A Scheduled timer due ``due_s`` seconds from the start of this test module."""
    return TimerEntry(
        tenant_id=tenant,
        service_call_id=call,
        due_at=NOW + timedelta(seconds=due_s),
        registered_at=NOW - timedelta(seconds=120),
    )


def lease_of(sql: psycopg.Connection[Any], call: str) -> tuple[Any, ...]:
    """``(state, lease_owner, lease_token)`` of one of the test's timers, read behind the store."""
    row = sql.execute(
        "SELECT state, lease_owner, lease_token FROM timer_schedules WHERE service_call_id = %s",
        (call,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def claiming_statements(store: PostgresTimerStore) -> list[str]:
    """Every statement the store runs on its claiming connection from now on, as sent."""
    assert store._claiming is not None
    store._claiming.statements = []
    return store._claiming.statements


async def claim_until_found(store: PostgresTimerStore, limit: int = 10) -> list[TimerEntry]:
    """Poll ``find_due`` until it claims something (the lease of another store must run out)."""
    async with asyncio.timeout(10):
        while not (claimed := await store.find_due(datetime.now(UTC), limit)):
            await asyncio.sleep(0.02)  # polling the database: no event says "lease ran out"
    return claimed


class TestClaiming:
    """find_due claims, seen in the lease columns; the lease promise itself is the shipped
    TimerStoreLeaseContract, bound in test_contract.py."""

    async def test_a_store_claims_its_own_timers_again(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """The same store gets its claimed timers again, each claim with a new token."""
        store = await make_started_store(owner_id="me")
        await store.schedule(timer("call-1"))
        assert await store.find_due(datetime.now(UTC), 10) == [timer("call-1")]
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "me", 1)
        assert await store.find_due(datetime.now(UTC), 10) == [timer("call-1")]
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "me", 2)

    async def test_a_crashed_owners_claims_are_taken_over_after_the_lease(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """Claims of a store that stopped without marking go to another store once expired."""
        crashed = await make_started_store(owner_id="crashed", lease_s=0.4)
        survivor = await make_started_store(owner_id="survivor")
        await crashed.apply([timer("call-1"), timer("call-2")])
        claimed_at = time.monotonic()
        assert len(await crashed.find_due(datetime.now(UTC), 10)) == 2
        await crashed.aclose()  # it "crashes": never marks, never releases
        assert await survivor.find_due(datetime.now(UTC), 10) == []
        taken = await claim_until_found(survivor)
        assert time.monotonic() - claimed_at >= 0.4
        assert sorted(e.service_call_id for e in taken) == ["call-1", "call-2"]
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "survivor", 2)

    async def test_fenced_mark_by_the_old_owner_changes_nothing(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A slow owner marking after its claim was taken over changes nothing; the new one can."""
        slow = await make_started_store(owner_id="slow", lease_s=0.3)
        fast = await make_started_store(owner_id="fast")
        await slow.schedule(timer("call-1"))
        (mine,) = await slow.find_due(datetime.now(UTC), 10)
        (theirs,) = await claim_until_found(fast)
        assert await slow.mark_reached([mine.reach(datetime.now(UTC))]) == 0
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "fast", 2)
        await slow.release_claims([mine])  # the old owner's release is fenced as well
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "fast", 2)
        assert await fast.mark_reached([theirs.reach(datetime.now(UTC))]) == 1
        assert lease_of(postgres_sql, "call-1") == ("Reached", None, 2)


class TestClaimingByTenant:
    """find_due_by_tenant claims with the same leases and fence as find_due."""

    async def test_concurrent_shared_claims_never_share_a_timer(
        self, make_started_store: MakeStore
    ) -> None:
        """Three stores claiming by tenant at once get disjoint sets covering the backlog."""
        stores = [await make_started_store(owner_id=f"owner-{i}") for i in range(3)]
        await stores[0].apply(
            [timer(f"call-{i:04d}", -(i % 9), f"tenant-{i % 4}") for i in range(400)]
        )

        async def drain(store: PostgresTimerStore) -> list[str]:
            mine: list[str] = []
            while batch := await store.find_due_by_tenant(datetime.now(UTC), 25, after={}):
                mine.extend(entry.service_call_id for entry in batch)
                now = datetime.now(UTC)
                assert await store.mark_reached([entry.reach(now) for entry in batch]) == len(batch)
            return mine

        claimed = await asyncio.gather(*(drain(store) for store in stores))
        every = [call for mine in claimed for call in mine]
        assert sorted(every) == [f"call-{i:04d}" for i in range(400)]

    async def test_fenced_mark_after_a_shared_claim_was_taken_over(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A slow owner's by-tenant claim taken over after its lease: its mark changes nothing."""
        slow = await make_started_store(owner_id="slow", lease_s=0.3)
        fast = await make_started_store(owner_id="fast")
        await slow.apply([timer("call-1"), timer("call-2", tenant="tenant-b")])
        mine = await slow.find_due_by_tenant(datetime.now(UTC), 10, after={})
        assert len(mine) == 2
        # (That nobody else gets them while the lease lasts is the concurrent test's: here the
        # lease is short, and a busy machine may outlast it before any check.)
        async with asyncio.timeout(10):
            while not (theirs := await fast.find_due_by_tenant(datetime.now(UTC), 10, after={})):
                await asyncio.sleep(0.02)  # polling the database: no event says "lease ran out"
        assert len(theirs) == 2
        assert await slow.mark_reached([e.reach(datetime.now(UTC)) for e in mine]) == 0
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", "fast", 2)
        assert await fast.mark_reached([e.reach(datetime.now(UTC)) for e in theirs]) == 2
        assert lease_of(postgres_sql, "call-2") == ("Reached", None, 2)


def frozen_monotonic(monkeypatch: Any) -> list[float]:
    """The claims' monotonic clock, stopped: the test moves ``clock[0]`` itself."""
    clock = [1000.0]
    monkeypatch.setattr(_tenants, "monotonic", lambda: clock[0])
    return clock


async def two_tenants_due(make_started_store: MakeStore) -> PostgresTimerStore:
    """A store with ten timers due for each of tenant-a and tenant-b."""
    store = await make_started_store()
    await store.apply(
        [timer(f"call-{t}{i}", -60 + i, f"tenant-{t}") for t in "ab" for i in range(10)]
    )
    return store


async def claim_as_a_drain(
    store: PostgresTimerStore, limit: int, after: dict[Any, Any]
) -> list[TimerEntry]:
    """A claim by tenant after ``after``, which then holds each tenant's last one claimed,
    as a drain keeps its cursors."""
    batch = await store.find_due_by_tenant(datetime.now(UTC), limit, after=after)
    for entry in batch:
        after[entry.tenant_id] = DueCursor.of(entry)
    return batch


class TestDueThatFits:
    async def test_all_that_fits_is_claimed_without_listing_tenants(
        self, make_started_store: MakeStore, monkeypatch: Any
    ) -> None:
        """A drain's first claim by tenant, with all that is due fitting in it, claims it in
        due order without the list of tenants (here made to fail); with more due, it lists
        them."""
        store = await make_started_store()
        await store.apply([timer(f"call-{i}", -60 + i, f"tenant-{i % 3}") for i in range(5)])
        monkeypatch.setattr(_tenants, "DUE_TENANTS_NEAR_SQL", "SELECT no_such_function()")
        batch = await store.find_due_by_tenant(datetime.now(UTC), 5, after={})
        assert [e.service_call_id for e in batch] == [f"call-{i}" for i in range(5)]
        await store.apply([timer(f"call-{i}", -60 + i, f"tenant-{i % 3}") for i in range(5, 12)])
        with pytest.raises(StoreError):
            await store.find_due_by_tenant(datetime.now(UTC), 5, after={})


class TestTenantsOfAClaim:
    """The claim by tenant lists the tenants with due timers, and reuses a complete list for
    the next claims of a drain for a moment (a claim is then one statement)."""

    async def test_claims_are_planned_without_sorts_bitmap_scans_or_jit(
        self, make_started_store: MakeStore
    ) -> None:
        """Its own connection carries the planner settings; the store's others do not."""
        store = await make_started_store()
        names = ("enable_sort", "enable_bitmapscan", "enable_incremental_sort", "jit")

        def settings(conn: Any) -> list[str]:
            return [conn.exec_driver_sql(f"SHOW {name}").scalar_one() for name in names]

        async def lane_settings(lane: _lanes.StatementLane | None) -> list[str]:
            assert lane is not None
            return [(await lane.fetch("read", f"SHOW {name}", {}))[0][0] for name in names]

        assert await lane_settings(store._claiming) == ["off"] * 4
        assert await lane_settings(store._marking) == ["on"] * 4
        assert await store._run("read", settings) == ["on"] * 4
        # Both claims run there.
        statements = claiming_statements(store)
        await store.apply([timer("call-1")])
        assert len(await store.find_due(datetime.now(UTC), 10)) == 1
        await store.find_due_by_tenant(datetime.now(UTC), 10, after={})
        # (All that is due fits in the claim: counted, then claimed in due order.)
        assert [s.split()[0] for s in statements] == ["UPDATE", "SELECT", "UPDATE"]

    async def test_its_threads_run_as_batch_work_and_the_loop_keeps_its_policy(
        self, make_started_store: MakeStore
    ) -> None:
        """Statements run on threads scheduled SCHED_BATCH (waking one does not preempt the
        event loop's thread, which holds the GIL it needs); the caller's thread is untouched."""
        store = await make_started_store()
        policy = await store._run("read", lambda conn: os.sched_getscheduler(0))
        assert policy == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER

    async def test_a_tenant_falling_due_during_a_drain_joins_once_the_list_is_old(
        self, make_started_store: MakeStore, monkeypatch: Any
    ) -> None:
        """Tenants a and b fill their shares; c's timers, stored after the first claim, are
        claimed once the reused list is older than TENANTS_REUSED_S, not before."""
        clock = frozen_monotonic(monkeypatch)
        store = await two_tenants_due(make_started_store)
        after: dict[Any, Any] = {}

        async def claim() -> set[str]:
            batch = await claim_as_a_drain(store, 4, after)
            assert len(batch) == 4
            return {entry.tenant_id for entry in batch}

        assert await claim() == {"tenant-a", "tenant-b"}
        await store.apply([timer(f"call-c{i}", -120 + i, "tenant-c") for i in range(10)])
        clock[0] += _tenants.TENANTS_REUSED_S / 2
        assert await claim() == {"tenant-a", "tenant-b"}  # the list of the first claim
        clock[0] += _tenants.TENANTS_REUSED_S
        assert await claim() == {"tenant-a", "tenant-b", "tenant-c"}

    @pytest.mark.parametrize(
        ("walked", "listing"),
        [(_tenants.DUE_WALKED, ["SELECT"]), (5, ["SELECT", "WITH"])],
        ids=["walk", "seeks"],
    )
    async def test_an_uneven_split_is_one_statement(
        self, make_started_store: MakeStore, monkeypatch: Any, walked: int, listing: list[str]
    ) -> None:
        """10 among 3 tenants: 4, 3 and 3 (the longest waiting gets the one left), claimed by
        one statement after the tenants' list, not a second one for what was left over. The
        tenants come from a walk of what is due, or, with more due than DUE_WALKED (here 5),
        from a seek per tenant after the walk gave up: the same list, the same shares."""
        monkeypatch.setattr(_tenants, "DUE_WALKED", walked)
        store = await make_started_store()
        await store.apply(
            [
                timer(f"call-{t}{i}", -60 + i + n, f"tenant-{t}")
                for n, t in enumerate("abc")
                for i in range(10)
            ]
        )
        statements = claiming_statements(store)
        batch = await store.find_due_by_tenant(datetime.now(UTC), 10, after={})
        counts = {
            t: sum(1 for e in batch if e.tenant_id == t)
            for t in ("tenant-a", "tenant-b", "tenant-c")
        }
        assert counts == {"tenant-a": 4, "tenant-b": 3, "tenant-c": 3}
        # More is due than the claim holds (counted first), so: the tenants, then the claim.
        assert [s.split()[0] for s in statements] == ["SELECT", *listing, "UPDATE"]

    async def test_a_timer_due_before_its_tenants_listed_earliest_joins_with_the_next_list(
        self, make_started_store: MakeStore, monkeypatch: Any
    ) -> None:
        """A tenant's claim starts at its earliest due timer as listed: one stored later with
        an earlier due time is claimed once the list is read again, not lost."""
        clock = frozen_monotonic(monkeypatch)
        store = await two_tenants_due(make_started_store)
        after: dict[Any, Any] = {}

        async def claim() -> list[str]:
            return [entry.service_call_id for entry in await claim_as_a_drain(store, 4, after)]

        assert sorted(await claim()) == ["call-a0", "call-a1", "call-b0", "call-b1"]
        await store.apply([timer("call-a-early", -600, "tenant-a")])
        del after["tenant-a"]  # no cursor: tenant-a's claim starts at its listed earliest
        clock[0] += _tenants.TENANTS_REUSED_S / 2
        assert "call-a-early" not in await claim()
        clock[0] += _tenants.TENANTS_REUSED_S
        after.clear()
        assert "call-a-early" in await claim()

    async def test_more_tenants_than_the_claim_go_round_one_list(
        self, make_started_store: MakeStore, monkeypatch: Any
    ) -> None:
        """With more tenants due than the claim's limit, one list serves the drain's next
        claims: those the first claim did not reach come next (longest waiting first), and
        the list is not read again while it is young."""
        monkeypatch.setattr(_tenants, "monotonic", lambda: 1000.0)
        store = await make_started_store()
        await store.apply(
            [
                timer(f"call-{t}{i}", -60 + n + i / 10, f"tenant-{t}")
                for n, t in enumerate("abc")
                for i in range(10)
            ]
        )
        first = await store.find_due_by_tenant(datetime.now(UTC), 2, after={})
        assert {entry.tenant_id for entry in first} == {"tenant-a", "tenant-b"}
        after = {entry.tenant_id: DueCursor.of(entry) for entry in first}
        statements = claiming_statements(store)
        second = await store.find_due_by_tenant(datetime.now(UTC), 2, after=after)
        assert {entry.tenant_id for entry in second} == {"tenant-c", "tenant-a"}
        assert [s.split()[0] for s in statements] == ["UPDATE"]  # the claim alone


class StallingPublisher(EventPublisher):
    """A broker that never acknowledges (the publish is abandoned by the lease fence)."""

    def __init__(self) -> None:
        self.offered: list[str] = []

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        self.offered.extend(e.payload.service_call_id for e in envelopes)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class TestFiringAcrossInstances:
    """The firing pipeline and TimerWorker on several stores over one database."""

    async def test_stalled_instance_gives_up_and_another_fires_once(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """An instance whose broker stalls past the lease neither marks nor keeps the timer."""
        stalled = await make_started_store(owner_id="stalled", lease_s=0.3)
        healthy = await make_started_store(owner_id="healthy")
        await stalled.schedule(timer("call-1"))
        stalled_publisher = StallingPublisher()
        report = await FiringPipeline(
            stalled, stalled_publisher, SystemClock(), batch_size=10
        ).fire()
        assert stalled_publisher.offered == ["call-1"]
        assert [e.service_call_id for e, _ in report.failed] == ["call-1"]
        assert lease_of(postgres_sql, "call-1") == ("Scheduled", None, 1)  # released
        bus = MemoryEventBus()
        report = await FiringPipeline(healthy, bus, SystemClock(), batch_size=10).fire()
        assert [e.service_call_id for e in report.fired] == ["call-1"]
        assert [e.payload.service_call_id for e in bus.published] == ["call-1"]
        assert lease_of(postgres_sql, "call-1") == ("Reached", None, 2)

    async def test_two_workers_fire_every_timer_exactly_once(
        self, make_started_store: MakeStore
    ) -> None:
        """Two workers on two stores fire a 400-timer backlog with no duplicate publish."""
        stores = [await make_started_store(owner_id=f"worker-{i}") for i in range(2)]
        bus = MemoryEventBus(deduplicate=False)
        await stores[0].apply(
            [timer(f"call-{i:03d}", -i % 7, f"tenant-{i % 5}") for i in range(400)]
        )
        workers = [
            TimerWorker(store, bus, SystemClock(), polling_interval=0.05, batch_size=20)
            for store in stores
        ]
        runs = [asyncio.create_task(worker.run()) for worker in workers]
        try:
            await asyncio.wait_for(bus.wait_for_published(400), timeout=30)
        finally:
            for worker in workers:
                worker.stop()
            await asyncio.gather(*runs)
        assert len(bus.publish_attempts) == 400
        assert bus.duplicates == 0
        assert await stores[0].count_scheduled() == 0
        states = {
            e.state for e in await stores[1].list_for_tenant(timer("x", 0, "tenant-0").tenant_id)
        }
        assert states == {TimerState.REACHED}


class TestRacingWriters:
    """apply stays exact when another transaction inserts the same new key at the same time."""

    async def test_a_key_inserted_concurrently_is_rescheduled(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """If a concurrent transaction inserts the key first, apply re-runs and reschedules it."""
        store = await make_started_store()
        with psycopg.connect(postgres_sql.info.dsn) as other:
            other.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at)"
                " VALUES ('tenant-a', 'raced', now(), now())"
            )
            applying = asyncio.create_task(store.apply([timer("raced", 30)]))
            await wait_until_blocked(postgres_sql)
            other.commit()
        assert await applying == [CommandOutcome.SCHEDULED]
        assert await store.get(timer("raced").tenant_id, timer("raced").service_call_id) == timer(
            "raced", 30
        )

    async def test_a_key_reached_concurrently_is_not_rearmed(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """If the concurrently inserted key is Reached, the schedule is ignored, as it must be."""
        store = await make_started_store()
        with psycopg.connect(postgres_sql.info.dsn) as other:
            other.execute(
                "INSERT INTO timer_schedules"
                " (tenant_id, service_call_id, due_at, registered_at, state, reached_at)"
                " VALUES ('tenant-a', 'raced', now(), now(), 'Reached', now())"
            )
            applying = asyncio.create_task(store.apply([timer("raced", 30), timer("other")]))
            await wait_until_blocked(postgres_sql)
            other.commit()
        assert await applying == [CommandOutcome.IGNORED_REACHED, CommandOutcome.SCHEDULED]
        stored = await store.get(timer("raced").tenant_id, timer("raced").service_call_id)
        assert stored is not None and stored.state is TimerState.REACHED
